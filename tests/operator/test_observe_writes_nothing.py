"""Observe only reads (issue 55): the operator's CA Secret is created by act when the serving plan
says so (CreateControlCA), and when the pair's TLS Secret was last seen is remembered by act
(TLSSecretSeen), never by observe. First the plan as a table, then observe on the real API server
as the chart's ServiceAccount, proven by the API server's own audit log: every request it made
there was a read (or a dry run, which persists nothing)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import time

import pytest

import plan_tables
from plan_tables import CURRENT_TLS, MODEL, NOW, NS, PAIR, TLS, UID, kinds
from specpair_operator.desired import manifests
from specpair_operator.desired import tls as tls_mod
from specpair_operator.observe.serving_world import ServingWorld
from specpair_operator.plan import serving_plan as sp
from specpair_operator.plan import serving_steps

SPEC = {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "abc"}, "draft": {"drafter": "ngram"},
        "rollout": {"replicas": 1}}


def world(tls, status_tls=CURRENT_TLS, **changes) -> ServingWorld:
    w = ServingWorld(pair=PAIR, namespace=NS, uid=UID, model=MODEL, aliases={"champion": "1"}, desired="1",
                     spec=SPEC, status={"engineTLS": status_tls} if status_tls else {}, now=NOW,
                     tags=plan_tables.release_tags(SPEC), verdict={"passed": True}, tls=tls)
    return dataclasses.replace(w, **changes)


CERTIFICATE_STEPS = ("CreateControlCA", "TLSSecretSeen", "IssueCertificate", "SetStatus engineTLS")
NO_CA = dataclasses.replace(TLS, ca_fingerprint="", issued_for="", ca_missing=True)   # as observe says it


@pytest.mark.parametrize("what, tls, status_tls, expected", [
    ("no CA: act makes it, then issues from it", NO_CA, None, ["CreateControlCA", "IssueCertificate"]),
    ("no CA while status knows a certificate from the last one (its Secret deleted by hand)",
     NO_CA, CURRENT_TLS, ["CreateControlCA", "IssueCertificate"]),
    ("the pair's Secret just seen there: act remembers when", dataclasses.replace(TLS, seen_at=123.5), CURRENT_TLS,
     ["TLSSecretSeen", "SetStatus engineTLS"]),
    ("not asked this pass: nothing to remember", TLS, CURRENT_TLS, ["SetStatus engineTLS"]),
])
def test_the_serving_plan_has_act_create_the_ca_and_remember_the_secret_seen(what, tls, status_tls, expected):
    steps = sp.plan_serving(world(tls, status_tls))
    got = [k for k in kinds(steps) if k.startswith(CERTIFICATE_STEPS)]
    assert [k.split(" engine pods")[0].split(" no certificate")[0] for k in got] == expected, what
    seen = [s for s in steps if isinstance(s, serving_steps.TLSSecretSeen)]
    assert [s.at for s in seen] == ([tls.seen_at] if tls.seen_at is not None else []), what


# -- observe on the real API server, audited --------------------------------------------------------

READS = {"get", "list", "watch"}


def _ca_role(namespace: str, user: str) -> list[dict]:
    """The chart's CA Role (operator/rbac.yaml, specpair-operator-ca) in a namespace of this test's
    own, so the test's CA Secret is not the session's."""
    rules = [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": [tls_mod.CA_SECRET]},
             {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]
    account = user.rsplit(":", 2)
    return [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": "specpair-operator-ca", "namespace": namespace}, "rules": rules},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "specpair-operator-ca", "namespace": namespace},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "specpair-operator-ca"},
             "subjects": [{"kind": "ServiceAccount", "namespace": account[1], "name": account[2]}]}]


def test_observe_writes_nothing_and_act_creates_the_ca(operator_env, devcluster, ns):
    """As the chart's ServiceAccount on the real API server: observing a pair's engine with no CA
    Secret reads only (the audit log says so) and leaves none behind; act's CreateControlCA
    creates it; observing again asks (dry run) whether the pair's Secret is there and says when
    it saw it, without touching the operator's memory."""
    import kopf
    from cluster_env import OPERATOR_ACCOUNT, OPERATOR_NAMESPACE, Namespace

    from specpair_operator.act.control_ca import create_control_ca
    from specpair_operator.clients.kube import Kube
    from specpair_operator.observe import reads
    from specpair_operator.plan import serving_plan
    from specpair_operator.state import OperatorState

    user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_ACCOUNT}"
    home = Namespace(devcluster)      # the operator's namespace for this test: no CA Secret in it yet
    try:
        for obj in _ca_role(home.name, user):
            home.create(obj)
        op = OperatorState(kube=Kube.from_connection_info(kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())),
                           operator_namespace=home.name)
        pair = world(None, status_tls=None, pair="obs", namespace=ns.name, uid="uid-obs")

        def requests_since(start: str) -> list[dict]:
            return [e for e in devcluster.audit_events(user) if e["requestReceivedTimestamp"] >= start
                    and (e.get("objectRef") or {}).get("namespace") in (ns.name, home.name)]

        def writes(events: list[dict]) -> list[str]:
            return [f"{e['verb']} {e['requestURI']}" for e in events
                    if e["verb"] not in READS and "dryRun=All" not in e["requestURI"]]

        async def scenario() -> None:
            start = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            seen = await reads._observe_engine(op, pair, serving_plan)
            events = requests_since(start)
            assert {"get secrets", "get deployments"} <= {f"{e['verb']} {e['objectRef']['resource']}"
                                                          for e in events}, "the reads were audited"
            assert writes(events) == [], "observe wrote"
            assert seen.tls.ca_missing and home.get("v1", "Secret", tls_mod.CA_SECRET) is None
            steps = sp.plan_serving(dataclasses.replace(seen, aliases={"champion": "1"}))
            assert kinds(steps).index("CreateControlCA") < [k.startswith("IssueCertificate")
                                                            for k in kinds(steps)].index(True)

            start = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            ca = await create_control_ca(op)
            assert [e["verb"] for e in requests_since(start)] == ["create"], "act's one write"
            made = home.get("v1", "Secret", tls_mod.CA_SECRET)
            assert made is not None and op.ca == ca

            # The pair's certificate as status records it, and its Secret there: observe asks.
            names = tls_mod.engine_dns_names(manifests.engine_name("obs"), ns.name)
            ns.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": manifests.engine_tls_secret_name("obs")},
                       "data": {}})
            current = {"secret": manifests.engine_tls_secret_name("obs"), "caFingerprint": tls_mod.fingerprint(ca.cert_pem),
                       "names": list(names), "notAfter": "2099-01-01T00:00:00Z"}
            before = time.monotonic()
            start = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            again = await reads._observe_engine(op, dataclasses.replace(pair, status={"engineTLS": current}), serving_plan)
            events = requests_since(start)
            assert writes(events) == [], "observe wrote"
            assert any(e["verb"] == "create" and "dryRun=All" in e["requestURI"] for e in events), \
                "the Secret was asked after (dry run)"
            assert not again.tls.ca_missing and not again.tls.missing
            assert again.tls.seen_at is not None and again.tls.seen_at >= before
            assert op.tls_checked_at == {}, "observe changed the operator's memory"
            remembered = [s for s in sp.plan_serving(dataclasses.replace(again, aliases={"champion": "1"}))
                          if isinstance(s, serving_steps.TLSSecretSeen)]
            assert [s.at for s in remembered] == [again.tls.seen_at]

        asyncio.run(scenario())
    finally:
        home.delete()
