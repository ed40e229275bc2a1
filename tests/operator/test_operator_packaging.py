"""The operator's entry point, its torch-free imports, and the CRD agreeing with the code."""

import json
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml
from specpair.config import RELEASE_SPECULATION_KEYS

from specpair_operator.policy import drift
from specpair_operator.release import content as release

REPO = Path(__file__).resolve().parents[2]


def test_operator_modules_import_without_torch():
    code = ("import sys, specpair_operator.handlers, specpair_operator.gate.runner, specpair_operator.__main__;"
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "specpair_operator", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--namespace" in out.stdout


def _schema():
    crd = yaml.safe_load((REPO / "crds" / "specmodelpair.yaml").read_text())
    return crd, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


def test_crd_is_valid_and_names_what_the_issue_asks():
    crd, _ = _schema()
    kubernetes_validate.validate(crd, "1.33.0", strict=True)
    names = crd["spec"]["names"]
    assert (crd["spec"]["group"], names["kind"], names["plural"], names["shortNames"], crd["spec"]["scope"]) == \
        ("specpair.io", "SpecModelPair", "specmodelpairs", ["smp"], "Namespaced")
    v = crd["spec"]["versions"][0]
    assert v["name"] == "v1alpha1" and v["subresources"] == {"status": {}, "scale": {"specReplicasPath": ".spec.rollout.replicas", "statusReplicasPath": ".status.replicas", "labelSelectorPath": ".status.selector"}}
    assert [c["name"] for c in v["additionalPrinterColumns"]] == ["Phase", "Serving", "Acceptance", "Speedup", "Age"]


def test_crd_defaults_are_the_defaults_the_operator_hashes_with():
    _, spec = _schema()
    sp = {k: v["default"] for k, v in spec["speculation"]["properties"].items() if "default" in v}
    assert sp == release.SPECULATION_DEFAULTS
    # Every setting the CRD admits is one the engine reads (SpeculationConfig.with_release).
    assert set(spec["speculation"]["properties"]) <= set(RELEASE_SPECULATION_KEYS)
    # A token tree is opt-in and has no default, so releases written before it keep their hashes.
    assert "default" not in spec["speculation"]["properties"]["treeWidth"]
    th = spec["gating"]["properties"]["thresholds"]["properties"]
    assert {k: v["default"] for k, v in th.items() if "default" in v} == \
        {k: v for k, v in release.THRESHOLD_DEFAULTS.items() if k != "minCategoryAcceptance"}
    assert spec["gating"]["properties"]["maxNewTokens"]["default"] == release.DEFAULT_MAX_NEW_TOKENS
    # The gate's sweeps: no default persisted into pairs (the gate has them, contract.TUNING_DEFAULTS),
    # so releases made before gating.tuning keep their hashes; a swept k is one a spec may ask for.
    tuning = spec["gating"]["properties"]["tuning"]
    assert "default" not in tuning and all("default" not in v for v in tuning["properties"].values())
    assert tuning["properties"]["kValues"]["items"]["maximum"] == spec["speculation"]["properties"]["k"]["maximum"]
    # No image default is persisted into pairs: the operator resolves it (the chart's engine.image,
    # whose default is the operator's own).
    assert "default" not in spec["rollout"]["properties"]["image"]
    values = yaml.safe_load((REPO / "charts" / "specpair" / "values.yaml").read_text())
    assert values["engine"]["image"] == release.ENGINE_IMAGE
    d = spec["drift"]["properties"]
    policy = drift.DriftPolicy()
    assert (d["tolerance"]["default"], d["noiseAllowance"]["default"], d["minDraftedTokens"]["default"],
            d["consecutiveBreaches"]["default"], d["windowSeconds"]["default"], tuple(d["ladder"]["default"])) == \
        (policy.tolerance, policy.noise_allowance, policy.min_drafted, policy.consecutive, policy.window_seconds,
         policy.ladder)


def test_rbac_is_a_valid_role_that_reads_no_secret_but_its_ca_and_deletes_only_autoscalers_and_routes():
    # Which verbs are needed is proven against a real API server (the audit log check in
    # test_operator_e2e.py); here only what must never be granted.
    docs = [d for d in yaml.safe_load_all((REPO / "operator" / "rbac.yaml").read_text()) if d]
    role, ca_role = docs[0], next(d for d in docs if d["metadata"]["name"] == "specpair-operator-ca")
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33.0", strict=True)
    granted = {(g, r, verb) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for verb in rule["verbs"]}
    # Secrets in pairs' namespaces: written (TLS certificates), never read or listed.
    assert {v for _, r, v in granted if r == "secrets"} == {"create", "patch"}
    # The deletions, each of a pair's own object by uid: its autoscaler (autoscaling removed, KEDA
    # come or gone), its Gateway routes and their Services (no Gateway named, an old version's).
    assert {(g, r) for g, r, v in granted if v == "delete"} == {("autoscaling", "horizontalpodautoscalers"),
                                                                ("keda.sh", "scaledobjects"),
                                                                ("gateway.networking.k8s.io", "httproutes"),
                                                                ("gateway.networking.k8s.io", "grpcroutes"),
                                                                ("", "services")}
    assert not any(v == "*" for _, _, v in granted)
    reads = [rule for rule in ca_role["rules"] if "get" in rule["verbs"]]
    assert reads and all(rule.get("resourceNames") == ["specpair-operator-ca"] for rule in reads)


def test_engine_command_serves_the_release_file_with_the_engine_cli(tmp_path):
    """The Deployment's command line is one the engine's own parser accepts, and what the engine
    serves (models, pinned revisions, speculation, pair, version) comes from the release file,
    whose content hash it reports: the hash the operator checks."""
    from specpair.cli import build_parser
    from specpair.server.cli import read_release, served_pair, server_options

    from specpair_operator.desired import engine_objects, manifests

    for draft in ({"drafter": "ngram"}, {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "12fd25f"}):
        rel = release.with_mlflow(release.build_release(
            "p", "ns", {"target": {"source": "HuggingFaceTB/SmolLM2-360M", "revision": "abc123"}, "draft": draft,
                        "speculation": {"dynamicK": False, "k": 3}},
            [{"prompt": "x"}]), "http://m", "ns-p", "4")
        cmd = engine_objects.engine_command(rel, 50051)
        assert cmd[cmd.index("--release") + 1] == manifests.RELEASE_FILE
        (tmp_path / "release.json").write_text(json.dumps(rel))
        cmd[cmd.index("--release") + 1] = str(tmp_path / "release.json")  # where the pod mounts it
        args = build_parser().parse_args(cmd[1:])
        served = read_release(args.release)
        options = server_options(args, served)
        assert options.content_hash == release.content_hash(rel)
        pair = served_pair(args, served, "cpu")
        assert (options.pair, options.version, options.port, pair.speculation.k,
                pair.speculation.dynamic_k, options.tls) == ("p", "4", 50051, 3, False, None)
        assert (pair.drafter == "ngram") if "drafter" in draft else (pair.draft.source == draft["source"])
        # Serving loads the same pinned revisions the gate measured.
        assert pair.target.revision == "abc123"
        assert (pair.draft and pair.draft.revision) == (None if "drafter" in draft else "12fd25f")
