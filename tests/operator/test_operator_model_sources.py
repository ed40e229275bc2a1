"""Model sources that would read outside the model cache, and Secrets a pair may not hand to its
pods (issue 54): the decisions as tables (engine/specpair/model_fetch.py's rules, the operator's
own check of a spec), and the fill Job's command itself run on real folders, real MLflow
artifact code included: what it refuses copies nothing. The API server's refusal of the same
specs, in the operator's words, is in test_operator_hostile_specs.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpair import model_fetch as fetch
from specpair.errors import SpecpairError
from specpair_operator.desired import manifests, tls
from specpair_operator.crd import names
from specpair_operator.crd.validation import validate_spec

LOCAL = ["mlflow:file:///var/run/secrets", "mlflow:FILE:/etc", "mlflow:/etc", "mlflow:.", "mlflow:..",
         "mlflow:models", "mlflow:relative/dir", "mlflow:./x"]
DOTTED = ["models:/..", "models:/m/..", "runs:/abc/../../x", "mlflow:models:/m/.", "mlflow:runs:/r/./model",
          "mlflow:s3://bucket/../other"]
REMOTE = ["models:/chat/3", "runs:/0af1/model", "mlflow:models:/chat/3", "mlflow:runs:/0af1/model",
          "mlflow:mlflow-artifacts:/1/abc/artifacts/model", "mlflow:s3://bucket/models/chat",
          "models:/chat.v2/1", "runs:/0af1/model..v2"]
NOT_MLFLOW = ["default", "HuggingFaceTB/SmolLM2-135M", "/models/local", "./x", "../x", "draft.gguf"]


def spec(**sides: str) -> dict:
    out = {"target": {"source": "default"}, "draft": {"drafter": "ngram"}}
    for role, source in sides.items():
        out[role] = {"source": source}
    return out


@pytest.mark.parametrize("source", LOCAL + DOTTED)
def test_sources_outside_the_cache_are_refused_by_the_fetch_rule(source):
    assert fetch.mlflow_source_problem(source)


@pytest.mark.parametrize("source", REMOTE + NOT_MLFLOW)
def test_remote_mlflow_and_other_sources_pass_the_fetch_rule(source):
    assert fetch.mlflow_source_problem(source) == ""


@pytest.mark.parametrize("source", LOCAL)
@pytest.mark.parametrize("role", ["target", "draft"])
def test_the_operator_refuses_a_local_mlflow_source_naming_the_field(role, source):
    errors = validate_spec(spec(**{role: source}))
    says = f"spec.{role}.source: Invalid value: {json.dumps(source)}: an mlflow: source must be a remote artifact URI"
    assert any(e.startswith(says) for e in errors), errors


@pytest.mark.parametrize("source", DOTTED)
def test_the_operator_refuses_a_dot_segment(source):
    errors = validate_spec(spec(target=source))
    assert f"spec.target.source: Invalid value: {json.dumps(source)}: an MLflow source may not have a '.' or '..' path segment: " \
           f"it names its own model's folder" in errors, errors


@pytest.mark.parametrize("source", REMOTE + NOT_MLFLOW)
def test_the_operator_accepts_remote_and_other_sources(source):
    assert validate_spec(spec(target=source, draft=source)) == []


@pytest.mark.parametrize("key", ["", ".", "..", ".staging-models_x_1", ".models_x.lock", "a/b", "..\\x", "a\0b",
                                 "x" * 256])
def test_a_cache_key_that_is_not_one_folder_of_its_own_is_refused(key):
    with pytest.raises(SpecpairError, match="is not a folder name of its own"):
        fetch.safe_cache_key(key)


@pytest.mark.parametrize("key", ["models_chat_3", "runs_0af1_model", "s3__bucket_models_chat", "models_chat.v2_1"])
def test_a_cache_key_of_a_remote_source_is_kept(key):
    assert fetch.safe_cache_key(key) == key


def _release(source: str) -> dict:
    return {"pair": "p", "namespace": "ns", "target": {"source": source}, "draft": {"drafter": "ngram"}}


@pytest.fixture
def cache_with_another_pairs_model(tmp_path) -> Path:
    """A shared cache that holds another pair's MLflow model, and beside it (outside the cache) a
    folder with a model and a secret that the fetch container could read."""
    cache = tmp_path / "hub"
    other = cache / "specpair-mlflow" / "models_other-pair_1"
    other.mkdir(parents=True)
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "owner": "other"}))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (outside / "secret.txt").write_text("s3cr3t")
    return cache


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("source", ["mlflow:file://{outside}", "mlflow:{outside}", "mlflow:.", "mlflow:..",
                                    "mlflow:models:/other-pair/1/.."])
def test_the_fill_job_copies_nothing_from_outside_and_never_takes_another_pairs_model(
        cache_with_another_pairs_model, tmp_path, monkeypatch, source):
    """The fill Job's own command (`specpair fetch-models`, as the Job runs it) on a release made
    before the rules (the operator's check and the CRD's are not there to stop it): the issue's
    sources copied a folder with a secret into the shared cache, or reported another pair's model
    as fetched for this one. Now it stops, naming the field, and the cache is as it was."""
    from specpair import cli

    cache = cache_with_another_pairs_model
    monkeypatch.chdir(cache / "specpair-mlflow")   # `mlflow:.` relative to a working folder with a model
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path / 'mlruns'}")
    before = _files(cache)
    release_file = tmp_path / "release.json"
    release_file.write_text(json.dumps(_release(source.format(outside=tmp_path / "outside"))))
    log = tmp_path / "termination-log"
    rc = cli.main(["fetch-models", "--release", str(release_file), "--cache-dir", str(cache),
                   "--termination-log", str(log)])
    assert rc == 2
    assert _files(cache) == before
    assert not (cache / ".specpair").exists()                       # nothing marked fetched
    # What the pair's status shows (model_fetch.fetch_state reads the termination message).
    assert json.loads(log.read_text())["error"].startswith("target.source: ")


@pytest.mark.parametrize("ref, says", [
    ({"name": "chat-engine-tls", "key": "token"}, "names a Secret the operator issues"),
    ({"name": names.object_name("a" * 80, names.ENGINE_TLS)}, "names a Secret the operator issues"),
    ({"name": tls.CA_SECRET}, "names a Secret the operator issues"),
    ({"name": "serving-token", "key": "tls.key"}, "names a certificate or private key"),
    ({"name": "serving-token", "key": "ca.crt"}, "names a certificate or private key"),
    ({"name": "serving-token", "namespace": "other"}, "tokenSecretRef.namespace is not supported"),
])
def test_a_token_ref_to_the_operators_secrets_or_keys_or_namespace_is_refused(ref, says):
    errors = validate_spec({**spec(), "rollout": {"auth": {"tokenSecretRef": ref}}})
    assert any(e.startswith("spec.rollout.auth.tokenSecretRef: Invalid value: rollout.auth.tokenSecretRef.")
               and says in e for e in errors), errors


@pytest.mark.parametrize("ref", [{"name": "serving-token"}, {"name": "serving-token", "key": "token"},
                                 {"name": "my-tls-token", "key": "bearer"}, {"name": "engine-tls-token"}])
def test_a_token_ref_to_a_token_secret_is_accepted(ref):
    assert validate_spec({**spec(), "rollout": {"auth": {"tokenSecretRef": ref}}}) == []


@pytest.mark.parametrize("pair", ["chat", "a.b", "1abc", "x" * 70, "chat-" + "y" * 60])
def test_every_secret_the_operator_issues_is_in_the_one_list(pair):
    assert names.operator_owned_secret(manifests.engine_tls_secret_name(pair))
    assert names.operator_owned_secret(tls.CA_SECRET)
