"""The gate runner's writes to MLflow, over MLflow's REST API (2.0) without importing `mlflow`.

A gate Job's runner starts, runs the gate command, records what it said and exits. Importing the
`mlflow` package (its GenAI, data and server modules come with it) took 1.6-2.4 s of CPU in every
gate pod, more than recording itself and, with a quick gate, most of the Job's time. What the
runner writes needs six endpoints and, where the tracking server proxies artifacts (`mlflow
server`'s default: run artifact URIs `mlflow-artifacts:/...`), one HTTP PUT per file. For any
other artifact store (s3://, gs://, a shared path) the upload goes through MLflow's own artifact
repositories, importing `mlflow` for that only.

Authentication and TLS follow the variables MLflow's client reads (MLFLOW_TRACKING_TOKEN, or
MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD; MLFLOW_TRACKING_INSECURE_TLS,
MLFLOW_TRACKING_SERVER_CERT_PATH, MLFLOW_TRACKING_CLIENT_CERT_PATH), so the Job's environment
means the same to both. Connection failures, 5xx and 429 are RegistryUnavailable (the runner
retries until its deadline); any other refusal is MlflowRefused, with MLflow's error code.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.parse
from typing import Any, Callable

import requests

from specpair.contract import content_hash

from specpair_operator.release.registry_contract import (PARAMS_PER_BATCH, PER_PROMPT_TABLE, TAG_GATE_SUMMARY,
                                                         TAG_LOGGED_ARTIFACTS, TAG_RUN_DESCRIPTION, RegistryUnavailable,
                                                         experiment_tags, find_or_create, gate_attempt_filter,
                                                         gate_description, gate_error_tags, gate_experiment,
                                                         gate_metrics, gate_params, gate_run_tags, gate_summary,
                                                         gate_tags, golden_dataset_input, headline_metrics,
                                                         logged_model_id, per_prompt_table, with_gate_section)
from specpair_operator.release.registry_traces import TAG_TRACE_ARTIFACTS, TRACE_DATA_FILE, golden_trace

ARTIFACT_PROXY = "mlflow-artifacts:"
METRICS_PER_BATCH = 1000     # MLflow's limit for one log-batch
GOLDEN_OUTPUTS = "golden_outputs.json"   # the gate's per-prompt outputs, written beside its verdict


class MlflowRefused(Exception):
    """MLflow answered and refused (4xx other than 429)."""

    def __init__(self, message: str, error_code: str = ""):
        super().__init__(message)
        self.error_code = error_code


class GateRecord:
    """Records a gate's verdict, or its error, on a model version."""

    def __init__(self, tracking_uri: str, timeout_s: float | None = None):
        if urllib.parse.urlparse(tracking_uri).scheme not in ("http", "https"):
            raise ValueError(f"the gate runner records over HTTP(S); tracking URI {tracking_uri!r} is not")
        self.tracking_uri = tracking_uri.rstrip("/")
        self.timeout_s = timeout_s or float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", "20"))
        self.session = session_from_env()

    # -- what the runner records ---------------------------------------------------------------

    def record_gate(self, model_name: str, version: str, verdict: dict[str, Any],
                    extra_artifacts: list[str] = (), release: dict[str, Any] | None = None,
                    started_ms: int | None = None) -> str:
        """Log the gating run and link it to the version by tags, the status last; -> the run id.
        The run is an evaluation a reviewer reads in MLflow: the release's settings as parameters,
        the golden prompts as its dataset input, metrics, the per-prompt results as a table, a
        description stating the verdict against every floor, and the gate's real start
        (`started_ms`) and end. The version gets the headline figures on its logged model and a
        link to the run in its description. Reuses the run the gate itself opened
        (verdict.mlflowRunId) when there is one."""
        golden = _golden_outputs(extra_artifacts)
        tags = {TAG_RUN_DESCRIPTION: gate_description(verdict, release)[:8000]}
        if golden is not None:
            tags[TAG_LOGGED_ARTIFACTS] = json.dumps([{"path": PER_PROMPT_TABLE, "type": "table"}])
        run_id = verdict.get("mlflowRunId")
        if run_id:
            info = self._api("GET", "runs/get", params={"run_id": run_id})["run"]["info"]
        else:
            experiment_id = self._experiment(gate_experiment(model_name))
            # A try of this attempt that made the run and failed after (a lost reply, a 5xx) left
            # it to be finished, not doubled: every step below writes the same again.
            found = self._api("POST", "runs/search", {
                "experiment_ids": [experiment_id], "filter": gate_attempt_filter(version, started_ms),
                "max_results": 1}).get("runs") if started_ms else None
            info = found[0]["info"] if found else self._api("POST", "runs/create", {
                "experiment_id": experiment_id, "start_time": started_ms or _now_ms(), "run_name": f"gate-v{version}",
                "tags": [{"key": k, "value": v} for k, v in gate_run_tags(version, started_ms).items()]})["run"]["info"]
            run_id = info["run_id"]
        artifact_uri, experiment_id = info["artifact_uri"], info["experiment_id"]
        ts = _now_ms()
        metrics = [{"key": k, "value": _json_double(v), "timestamp": ts, "step": step}
                   for (k, step), v in gate_metrics(verdict).items()]
        params = [{"key": k, "value": v} for k, v in gate_params(release, verdict).items()] if release else []
        for i in range(0, len(metrics), METRICS_PER_BATCH):
            self._api("POST", "runs/log-batch", {"run_id": run_id, "metrics": metrics[i:i + METRICS_PER_BATCH]})
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self._api("POST", "runs/log-batch", {"run_id": run_id, "params": params[i:i + PARAMS_PER_BATCH]})
        self._api("POST", "runs/log-batch", {"run_id": run_id,
                                             "tags": [{"key": k, "value": v} for k, v in tags.items()]})
        if release:
            self._api("POST", "runs/log-inputs", {"run_id": run_id,
                                                  "datasets": [golden_dataset_input(release, content_hash(release))]})
        files = [("verdict.json", json.dumps(verdict, indent=2, sort_keys=True).encode())]
        for extra in extra_artifacts:
            if os.path.isfile(extra):
                with open(extra, "rb") as f:
                    files.append((os.path.basename(extra), f.read()))
        if golden is not None:
            files.append((os.path.basename(PER_PROMPT_TABLE), json.dumps(per_prompt_table(golden)).encode()))
        self._upload(run_id, artifact_uri, "gate", files)
        if golden:
            self._record_traces(golden, experiment_id, run_id, version, started_ms or _now_ms())
        self._api("POST", "runs/update", {"run_id": run_id, "status": "FINISHED", "end_time": _now_ms()})
        self._show_on_version(model_name, version, verdict, experiment_id, run_id)
        self.set_tags(model_name, version, {TAG_GATE_SUMMARY: gate_summary(verdict), **gate_tags(verdict, run_id)})
        return run_id

    def _record_traces(self, golden: list[dict[str, Any]], experiment_id: str, run_id: str, version: str,
                       start_ms: int) -> None:
        """Each golden prompt's generation as a trace of the gate run (registry_contract.golden_trace),
        so the run's and the experiment's Traces show the prompts, replies and timings. A server
        without MLflow 3's trace API (it refuses the endpoint) gets the run without them: the
        verdict must still land."""
        for index, row in enumerate(golden):
            body, spans = golden_trace(row, index, experiment_id, run_id, version, start_ms)
            try:
                info = self._send("POST", f"{self.tracking_uri}/api/3.0/mlflow/traces", json=body)["trace"]["trace_info"]
            except MlflowRefused as exc:
                if exc.error_code in ("ENDPOINT_NOT_FOUND", "") and "HTTP 404" in str(exc):
                    return
                raise
            location = (info.get("tags") or {})[TAG_TRACE_ARTIFACTS]
            self._upload_to(location, [(TRACE_DATA_FILE, json.dumps(spans).encode())])

    def _show_on_version(self, model_name: str, version: str, verdict: dict[str, Any], experiment_id: str,
                         run_id: str) -> None:
        """The headline figures where the version page shows metrics (its logged model's, logged
        on its release run), and the gate's result with a link to its run in its description."""
        mv = self._api("GET", "model-versions/get", params={"name": model_name, "version": str(version)})[
            "model_version"]
        model_id = logged_model_id(mv.get("source") or "")
        if model_id and mv.get("run_id"):
            ts = _now_ms()
            self._api("POST", "runs/log-batch", {"run_id": mv["run_id"], "metrics": [
                {"key": k, "value": _json_double(v), "timestamp": ts, "step": 0, "model_id": model_id}
                for k, v in headline_metrics(verdict).items()]})
        self._api("PATCH", "model-versions/update", {
            "name": model_name, "version": str(version),
            "description": with_gate_section(mv.get("description") or "", verdict, experiment_id, run_id)})

    def record_gate_error(self, model_name: str, version: str, message: str) -> None:
        self.set_tags(model_name, version, gate_error_tags(message))

    def set_tags(self, model_name: str, version: str, tags: dict[str, str]) -> None:
        """One request per tag (MLflow has no batch for version tags), in the dict's order."""
        for key, value in tags.items():
            self._api("POST", "model-versions/set-tag", {"name": model_name, "version": str(version),
                                                         "key": key, "value": value})

    # -- MLflow --------------------------------------------------------------------------------

    def _experiment(self, name: str) -> str:
        def find() -> str | None:
            try:
                return self._api("GET", "experiments/get-by-name", params={"experiment_name": name})["experiment"][
                    "experiment_id"]
            except MlflowRefused as exc:
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                return None
        return find_or_create(find, lambda: self._api("POST", "experiments/create", {
            "name": name, "tags": [{"key": k, "value": v} for k, v in experiment_tags().items()]})["experiment_id"])

    def _upload(self, run_id: str, artifact_uri: str, folder: str, files: list[tuple[str, bytes]]) -> None:
        if not artifact_uri.startswith(ARTIFACT_PROXY):
            self._upload_with_mlflow(f"run {run_id}", lambda client, path: client.log_artifact(run_id, path, folder),
                                     files)
            return
        self._put(f"{artifact_uri.rstrip('/')}/{folder}", files)

    def _upload_to(self, location: str, files: list[tuple[str, bytes]]) -> None:
        """Files at an artifact location that is not a run's (a trace's)."""
        if location.startswith(ARTIFACT_PROXY):
            self._put(location, files)
            return

        def log(_client: Any, path: str) -> None:
            from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
            get_artifact_repository(location).log_artifact(path)
        self._upload_with_mlflow(location, log, files)

    def _put(self, location: str, files: list[tuple[str, bytes]]) -> None:
        """Through the tracking server's artifact proxy: mlflow-artifacts:/PATH, or
        mlflow-artifacts://HOST:PORT/PATH for another server."""
        parsed = urllib.parse.urlparse(location)
        base = self.tracking_uri
        if parsed.netloc:
            base = f"{urllib.parse.urlparse(self.tracking_uri).scheme}://{parsed.netloc}"
        root = parsed.path.strip("/")
        for name, data in files:
            path = urllib.parse.quote(f"{root}/{name}")
            self._send("PUT", f"{base}/api/2.0/mlflow-artifacts/artifacts/{path}", data=data)

    def _upload_with_mlflow(self, where: str, log: Callable[[Any, str], None], files: list[tuple[str, bytes]]) -> None:
        """An artifact store the tracking server does not proxy: MLflow's own repositories."""
        import tempfile

        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        with tempfile.TemporaryDirectory() as d:
            for name, data in files:
                path = os.path.join(d, name)
                with open(path, "wb") as f:
                    f.write(data)
                try:
                    log(client, path)
                except (ConnectionError, OSError) as exc:
                    raise RegistryUnavailable(f"artifact upload to {where} failed: {exc}") from exc

    def _api(self, method: str, endpoint: str, body: dict[str, Any] | None = None,
             params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._send(method, f"{self.tracking_uri}/api/2.0/mlflow/{endpoint}", json=body, params=params)

    def _send(self, method: str, url: str, **kwargs: Any) -> dict[str, Any]:
        try:
            resp = self.session.request(method, url, timeout=self.timeout_s, **kwargs)
        except requests.RequestException as exc:
            raise RegistryUnavailable(f"MLflow at {self.tracking_uri} unreachable: {exc}") from exc
        if resp.status_code >= 500 or resp.status_code == 429:
            raise RegistryUnavailable(f"MLflow at {self.tracking_uri} answered {resp.status_code} to {method} "
                                      f"{url}: {resp.text[:300]}")
        try:
            payload = resp.json() if resp.content else {}
        except ValueError:
            payload = {"message": resp.text[:300]}
        if resp.status_code >= 400:
            code = payload.get("error_code", "") if isinstance(payload, dict) else ""
            message = payload.get("message", "") if isinstance(payload, dict) else str(payload)
            raise MlflowRefused(f"MLflow refused {method} {url}: HTTP {resp.status_code} {code}: {message}", code)
        return payload if isinstance(payload, dict) else {}


def session_from_env(env: dict[str, str] | None = None) -> requests.Session:
    """A session with the credentials and TLS settings MLflow's own client takes from these
    variables."""
    env = os.environ if env is None else env
    session = requests.Session()
    if env.get("MLFLOW_TRACKING_TOKEN"):
        session.headers["Authorization"] = f"Bearer {env['MLFLOW_TRACKING_TOKEN']}"
    elif env.get("MLFLOW_TRACKING_USERNAME") and env.get("MLFLOW_TRACKING_PASSWORD"):
        session.auth = (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"])
    if env.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
        session.verify = False
    elif env.get("MLFLOW_TRACKING_SERVER_CERT_PATH"):
        session.verify = env["MLFLOW_TRACKING_SERVER_CERT_PATH"]
    if env.get("MLFLOW_TRACKING_CLIENT_CERT_PATH"):
        session.cert = env["MLFLOW_TRACKING_CLIENT_CERT_PATH"]
    return session


def _golden_outputs(paths: list[str]) -> list[dict[str, Any]] | None:
    """The gate's per-prompt outputs among its files, or None (a gate that stopped before decoding
    writes none; a file that is not a list of results is not them)."""
    for path in paths:
        if os.path.basename(path) == GOLDEN_OUTPUTS and os.path.isfile(path):
            try:
                with open(path) as f:
                    golden = json.load(f)
            except ValueError:
                return None
            return [g for g in golden if isinstance(g, dict)] if isinstance(golden, list) else None
    return None


def _json_double(value: float) -> float | str:
    """A double as MLflow's REST API (protobuf's JSON) takes it: NaN and the infinities are the
    strings "NaN", "Infinity" and "-Infinity" (JSON has no such numbers)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _now_ms() -> int:
    return int(time.time() * 1000)
