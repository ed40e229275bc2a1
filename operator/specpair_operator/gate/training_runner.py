"""Entry point of the training Job (desired/training_job.py): train a new draft for one category of
a release on the traffic the pair captured, and register it in MLflow as a new version that
changes only the draft side, with its lineage.

    python -m specpair_operator.gate.training_runner --release /etc/specpair/release.json \
        --model llm.chat --version 3 --capture-dir /var/lib/specpair/capture --category extraction \
        --max-seconds 1080 --out /tmp/training --termination-log /dev/termination-log

1. `specpair distill --from-capture DIR --category C --golden-release RELEASE` (a child process:
   the operator's code never imports torch) within `--max-seconds` of training;
2. the draft it wrote is logged as the artifacts of a training run in the pair's experiment
   (`draft/`), tagged with its lineage;
3. the release document of `--version` with its draft replaced by that run's `draft/`
   (`learned_release`: target, speculation, golden prompts, thresholds and image unchanged) is
   registered like any release (ReleaseRegistry.ensure_release: found by its content hash, so a
   runner run again registers nothing twice), with `specpair.lineage.*` tags: which release, which
   capture (requests, tokens, the releases it was captured under, its first and last time), which
   category, which training run and Job.

The termination message is the report the operator reads (training_job.training_state):
`{"version": <registered>, "summary": ...}`, or `{"error": ...}` and exit 1; no gate runs here, the
new version goes the usual road (gate, shadow, promotion).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from specpair.contract import DEFAULT_CATEGORY, content_hash

from specpair_operator.desired import training_job
from specpair_operator.gate.runner import write_termination_message
from specpair_operator.release.registry_contract import TAG_RELEASE, experiment_tags, gate_experiment
# The lineage tags' one home is the registry contract (the release plan reads them back).
from specpair_operator.release.registry_contract import (  # noqa: F401
    LINEAGE, TAG_LINEAGE_CAPTURE, TAG_LINEAGE_CATEGORY, TAG_LINEAGE_JOB, TAG_LINEAGE_RELEASE, TAG_LINEAGE_RELEASE_HASH,
    TAG_LINEAGE_RUN)

# Left out of the draft's artifacts: the optimiser state and the target's replies are not the draft.
NOT_THE_DRAFT = ("checkpoints", "replies.jsonl")


def learned_release(release: dict[str, Any], run_id: str, method: str, category: str = "",
                    chat_share: float | None = None) -> dict[str, Any]:
    """The release with only its draft replaced by the trained one (`runs:/<run>/draft`); where it
    is deployed (its mlflow block) left out, as every registered release leaves it out.

    Its golden prompts of `category` are scored by the gate in the format that category was
    served in (`chat_share`: the share of its captured requests that came chat-formatted,
    distill_capture.chat_share; None: not told): a prompt whose format differs from gating.chat
    says its own (`chat`, gate/structured.golden_chat). A draft trained on plain completions
    otherwise met chat-formatted golden prompts it never saw and failed its gate at 0.000."""
    out = copy.deepcopy(release)
    out.pop("mlflow", None)
    draft: dict[str, Any] = {"source": f"runs:/{run_id}/draft", "revision": None}
    if method != "draft":
        draft["method"] = method
    out["draft"] = draft
    gating = out.get("gating") or {}
    if category and chat_share is not None and isinstance(gating.get("prompts"), list):
        served_chat = chat_share >= 0.5
        for prompt in gating["prompts"]:
            if isinstance(prompt, dict) and str(prompt.get("category") or DEFAULT_CATEGORY) == category \
                    and not prompt.get("tools") and "chat" not in prompt \
                    and served_chat != bool(gating.get("chat", True)):
                prompt["chat"] = served_chat     # tools need the template: such a prompt keeps it
    return out


def lineage_tags(parent_version: str, parent: dict[str, Any], category: str, capture: dict[str, Any] | None,
                 run_id: str, job: str) -> dict[str, str]:
    parent = {k: v for k, v in parent.items() if k != "mlflow"}
    captured = {k: (capture or {}).get(k) for k in ("requests", "tokens", "releases", "first", "last")}
    return {TAG_LINEAGE_RELEASE: str(parent_version), TAG_LINEAGE_RELEASE_HASH: content_hash(parent),
            TAG_LINEAGE_CATEGORY: category, TAG_LINEAGE_CAPTURE: json.dumps(captured, sort_keys=True),
            TAG_LINEAGE_RUN: run_id, TAG_LINEAGE_JOB: job}


def _fail(path: str | None, message: str) -> int:
    print(message, file=sys.stderr)
    write_termination_message(path, {"error": message[-training_job.MESSAGE_LIMIT:]})
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specpair_operator.gate.training_runner")
    ap.add_argument("--release", required=True, help="the release JSON whose draft is retrained")
    ap.add_argument("--model", required=True, help="the pair's registered model")
    ap.add_argument("--version", required=True, help="the release's model version")
    ap.add_argument("--capture-dir", required=True)
    ap.add_argument("--category", required=True)
    # Always given by the Job (spec.learning.training, defaults in the CRD): no second home here.
    ap.add_argument("--method", required=True, choices=["draft", "eagle3"])
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--max-seconds", type=float, required=True, help="the training loop's budget")
    ap.add_argument("--out", required=True, help="where the draft is written before its upload")
    ap.add_argument("--device", default=None)
    ap.add_argument("--distill-command", default=os.environ.get("SPECPAIR_DISTILL_COMMAND", "specpair distill"),
                    help="the command that trains (takes distill's arguments)")
    ap.add_argument("--distill-args", default=os.environ.get("SPECPAIR_DISTILL_ARGS", ""),
                    help="more arguments for distill (e.g. '--init truncate --layers 1')")
    ap.add_argument("--termination-log", default=os.environ.get("SPECPAIR_TERMINATION_LOG", "/dev/termination-log"))
    args = ap.parse_args(argv)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    with open(args.release) as f:
        release = json.load(f)
    tracking_uri = (release.get("mlflow") or {}).get("trackingUri") or os.environ.get("MLFLOW_TRACKING_URI")
    if not tracking_uri:
        return _fail(args.termination_log, "no MLflow: the release has no mlflow.trackingUri and "
                                           "MLFLOW_TRACKING_URI is not set")
    target = (release.get("target") or {}).get("source")
    cmd = [*shlex.split(args.distill_command), "--from-capture", args.capture_dir, "--category", args.category,
           "--golden-release", args.release, "--method", args.method, "--steps", str(args.steps),
           "--max-seconds", str(args.max_seconds), "--out", args.out,
           *(["--target", str(target)] if target else []), *(["--device", args.device] if args.device else []),
           *shlex.split(args.distill_args)]
    print("training: " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(proc.stderr[-20000:])
    summary_path = Path(args.out) / "distill_summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-3:]
        return _fail(args.termination_log, f"distill exited {proc.returncode}: " + " | ".join(last))
    summary = json.loads(summary_path.read_text())

    from mlflow import MlflowClient   # the registry only once there is a draft to register

    from specpair_operator.clients.registry import ReleaseRegistry

    registry = ReleaseRegistry(tracking_uri)
    client: MlflowClient = registry.client
    name = gate_experiment(args.model)
    experiment = client.get_experiment_by_name(name)
    exp_id = experiment.experiment_id if experiment is not None else client.create_experiment(
        name, tags=experiment_tags())
    job = os.environ.get(training_job.JOB_ENV) or os.environ.get("HOSTNAME", "")   # by hand: the host
    run = client.create_run(exp_id, tags={"mlflow.runName": f"training-v{args.version}-{args.category}"[:250],
                                          TAG_LINEAGE_RELEASE: str(args.version), TAG_LINEAGE_CATEGORY: args.category,
                                          TAG_LINEAGE_JOB: job})
    run_id = run.info.run_id
    for key in ("steps", "loss_first10", "loss_last10", "acceptance_before", "acceptance_after", "seconds"):
        if isinstance(summary.get(key), (int, float)):
            client.log_metric(run_id, key, float(summary[key]))
    out = Path(args.out)
    for item in sorted(out.iterdir()):
        if item.name in NOT_THE_DRAFT:
            continue
        if item.is_dir():
            client.log_artifacts(run_id, str(item), f"draft/{item.name}")
        else:
            client.log_artifact(run_id, str(item), "draft")
    client.set_terminated(run_id)
    rel = learned_release(release, run_id, args.method, args.category, (summary.get("capture") or {}).get("chat"))
    digest = content_hash(rel)
    version = registry.ensure_release(args.model, rel, digest)
    # The release document on the version, as the operator writes it for the spec's releases
    # (what serving, rollback and the draft swap read), then the lineage.
    registry.set_tags(args.model, version, {
        TAG_RELEASE: json.dumps(rel, sort_keys=True, separators=(",", ":")),
        **lineage_tags(args.version, release, args.category, summary.get("capture"), run_id, job)})
    said = (f"{(summary.get('capture') or {}).get('requests')} captured requests of '{args.category}', "
            f"{summary.get('steps')} steps in {summary.get('seconds')} s; golden-prompt acceptance "
            f"{summary.get('acceptance_before')} -> {summary.get('acceptance_after')}")
    write_termination_message(args.termination_log, {training_job.REPORT_VERSION: version, "summary": said,
                                                     "run": run_id})
    print(json.dumps({"version": version, "run": run_id, "summary": said}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
