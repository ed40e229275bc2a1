"""Names and label values derived from a pair's name, always valid and never colliding.

A SpecModelPair's name may be up to 253 characters with dots; a label value or a Service name
may not (63, and no dots for a Service). Cutting a long name short would make two pairs that
share a prefix fight over one Deployment, so a shortened name keeps a hash of the full one; so
does a name that had to be changed to be a label at all (`a.b` is `a-b-<hash of a.b>`, never
the `a-b` of a pair named so). A name that is a label already is kept as it is.
"""

from __future__ import annotations

import hashlib
import re

LABEL_LIMIT = 63
# The CA the operator issues engine certificates from (desired/tls.py), in its own namespace.
CA_SECRET = "specpair-operator-ca"
# The engine pod's metrics port: the CRD refuses it for the serving and control ports.
METRICS_PORT = 9400
# The pair's certificate Secret (tls.crt, tls.key, ca.crt): object_name(pair, ENGINE_TLS).
ENGINE_TLS = "engine-tls"
# Secrets the operator writes, the one list of them: the CA it issues engine certificates from
# (tls.CA_SECRET, in its own namespace) and each pair's certificate, whatever the pair's name. A
# pair hands a Secret to its pods by reference (rollout.auth.tokenSecretRef), so naming one of
# these would mount another pair's private key (or the CA's) into its pods; the CRD's CEL rule
# and validation.py refuse them by these names. A Secret the operator begins to issue joins here.
OWNED_SECRET_SUFFIXES = ("-" + ENGINE_TLS,)
OWNED_SECRETS = (CA_SECRET,)
# Keys of a kubernetes.io/tls Secret: certificates and private keys, never a bearer token.
CERTIFICATE_KEYS = ("tls.key", "tls.crt", "ca.crt", "ca.key")
# A DNS-1035 label: what a Service's name must be (and so every child's, for one rule).
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _shorten(text: str, room: int, full: str) -> str:
    if len(text) <= room:
        return text
    return text[: room - 9].rstrip("-.") + "-" + _hash(full)


def label_value(name: str) -> str:
    """`name` as a label value: itself when it fits, else a prefix plus a hash of the whole."""
    return _shorten(name, LABEL_LIMIT, name)


def legacy_object_name(pair: str, *suffix: str) -> str:
    """The name object_name gave before non-label names got a hash (dots as dashes, 'p-' before
    a leading digit): where an engine Deployment of such a pair may still run. Equal to
    object_name for a pair whose name is a label."""
    tail = "-".join(s for s in suffix if s)
    base = pair.replace(".", "-")
    if not base[:1].isalpha():
        base = "p-" + base
    base = _shorten(base, LABEL_LIMIT - (len(tail) + 1 if tail else 0), pair)
    return f"{base}-{tail}" if tail else base


def object_name(pair: str, *suffix: str) -> str:
    """A DNS-1035 label (valid for Services, Jobs, Deployments and their pods' labels): the
    pair's name when it is such a label, else the name with dots as dashes (and a leading
    letter) plus a hash of the real name; shortened with a hash when pair + suffix exceed 63."""
    tail = "-".join(s for s in suffix if s)
    room = LABEL_LIMIT - (len(tail) + 1 if tail else 0)
    if DNS_LABEL.fullmatch(pair):
        base = _shorten(pair, room, pair)
    else:
        sanitized = pair.replace(".", "-")
        if not sanitized[:1].isalpha():
            sanitized = "p-" + sanitized
        base = sanitized[: room - 9].rstrip("-") + "-" + _hash(pair)
    return f"{base}-{tail}" if tail else base


def operator_owned_secret(name: str) -> bool:
    """Whether `name` is a Secret the operator issues (OWNED_SECRETS, OWNED_SECRET_SUFFIXES)."""
    return name in OWNED_SECRETS or name.endswith(OWNED_SECRET_SUFFIXES)
