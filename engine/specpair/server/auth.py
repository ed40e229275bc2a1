"""The serving ports' bearer token (--auth-token-file): one check for gRPC metadata and HTTP headers."""

from __future__ import annotations

import hmac
from pathlib import Path

from specpair.errors import SpecpairError


def bearer_token_matches(header: str, token: str) -> bool:
    """`header` is "Bearer <token>" (scheme case-insensitive), compared in constant time."""
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def read_token_file(path: str, flag: str = "--auth-token-file") -> str:
    """The token in a file (a mounted Secret): its text without surrounding whitespace, not empty."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecpairError(f"{flag}: {exc}") from exc
    if not token:
        raise SpecpairError(f"{flag} {path} is empty")
    return token
