"""Names and label values derived from a pair's name, always valid and never colliding.

A SpecModelPair's name may be up to 253 characters with dots; a label value or a Service name
may not (63, and no dots for a Service). Cutting a long name short would make two pairs that
share a prefix fight over one Deployment, so a shortened name keeps a hash of the full one.
"""

from __future__ import annotations

import hashlib

LABEL_LIMIT = 63


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _shorten(text: str, room: int, full: str) -> str:
    if len(text) <= room:
        return text
    return text[: room - 9].rstrip("-.") + "-" + _hash(full)


def label_value(name: str) -> str:
    """`name` as a label value: itself when it fits, else a prefix plus a hash of the whole."""
    return _shorten(name, LABEL_LIMIT, name)


def object_name(pair: str, *suffix: str) -> str:
    """A DNS-1035 label (valid for Services, Jobs, Deployments and their pods' labels):
    the pair name with dots as dashes, shortened with a hash when pair + suffix exceed 63."""
    tail = "-".join(s for s in suffix if s)
    base = pair.replace(".", "-")
    if not base[:1].isalpha():
        base = "p-" + base
    room = LABEL_LIMIT - (len(tail) + 1 if tail else 0)
    base = _shorten(base, room, pair)
    return f"{base}-{tail}" if tail else base
