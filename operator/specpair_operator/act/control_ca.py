"""Act's write of the operator's own CA: the CA Secret in the operator's namespace, created when a
pass found none (the serving plan's CreateControlCA). Observe only reads it (state.read_control_ca)."""

from __future__ import annotations

import asyncio
import base64

from specpair_operator.desired import tls as tls_mod
from specpair_operator.state import OperatorState, use_control_ca


def control_ca_secret(namespace: str, ca: tls_mod.KeyPair) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": tls_mod.CA_SECRET, "namespace": namespace,
                         "labels": {"app.kubernetes.io/managed-by": "specpair-operator"}},
            "data": {"tls.crt": base64.b64encode(ca.cert_pem).decode(),
                     "tls.key": base64.b64encode(ca.key_pem).decode()}}


async def create_control_ca(state: OperatorState) -> tls_mod.KeyPair:
    """A new CA into the CA Secret, then kept as the one engine certificates are issued from. A
    replica (or a pass) that created it first wins: its Secret is read back (409) and used."""
    if state.ca_lock is None:
        state.ca_lock = asyncio.Lock()
    async with state.ca_lock:
        secret = await state.kube.create(control_ca_secret(state.operator_namespace, tls_mod.new_ca()))
        return use_control_ca(state, secret)
