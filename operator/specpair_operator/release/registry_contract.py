"""What the registry holds for specpair, with no MLflow client: the tag names, a gate's tags and
metrics from its verdict, a version's gate result from its tags, the error every registry
adapter raises when MLflow cannot be reached, and how an adapter finds or creates what two
writers may create at once. The operator's adapter (clients/registry.py, MlflowClient) and the gate
runner's (gate/record.py, MLflow's REST API without importing mlflow) both write and read
through these, so they cannot disagree on a name, a shape or a race. (The golden prompts'
generations as traces, which only the gate runner writes: registry_traces.py.)"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

from specpair.contract import GOLDEN_STRUCTURE_KEYS, STRUCTURE_FLOORS, shipped_target_only, speedup_floor

T = TypeVar("T")

TAG_HASH = "specpair.content_hash"
TAG_GATE_STATUS = "specpair.gate.status"  # pending | passed | failed | error
TAG_GATE_VERDICT = "specpair.gate.verdict"
TAG_GATE_RUN = "specpair.gate.run_id"
TAG_GATE_MESSAGE = "specpair.gate.message"
TAG_ROLLED_BACK = "specpair.rolled_back"
TAG_TOKENIZER_TARGET = "specpair.tokenizer.target_fingerprint"
TAG_TOKENIZER_DRAFT = "specpair.tokenizer.draft_fingerprint"
TAG_BEST_SPECULATION = "specpair.gate.best_speculation"


class RegistryUnavailable(Exception):
    """MLflow could not be reached (or answered 5xx) after the in-call retries."""


TAG_OWNER, TAG_OWNER_UID = "specpair.pair", "specpair.pair_uid"
# A version's release document (JSON): what its gate and engine pods are given.
TAG_RELEASE = "specpair.release"


def find_or_create(find: Callable[[], T | None], create: Callable[[], T]) -> T:
    """What `find` returns, else what `create` makes. Another writer may create the same thing
    between the two (a pair's experiment is made by the operator's release run or by a gate
    runner, whichever comes first): MLflow refuses the later create with error_code
    RESOURCE_ALREADY_EXISTS (on MlflowClient's RestException and on gate_record's MlflowRefused
    alike) and `find` is asked again. Any other error, or a thing still not found, raises the
    create's error."""
    found = find()
    if found is not None:
        return found
    try:
        return create()
    except Exception as exc:
        if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
            raise
        found = find()
        if found is None:
            raise
        return found


def gate_tags(verdict: dict[str, Any], run_id: str) -> dict[str, str]:
    """The tags a recorded verdict puts on its model version, the status last (dicts keep their
    order): the operator acts on the status, so everything it points at must be written first."""
    tok = verdict.get("tokenizer") or {}
    tags = {
        TAG_GATE_RUN: run_id,
        TAG_GATE_VERDICT: json.dumps({**verdict, "mlflowRunId": run_id}, sort_keys=True, separators=(",", ":")),
        TAG_GATE_MESSAGE: "; ".join(verdict.get("reasons") or []) or "passed",
    }
    if tok.get("targetFingerprint"):
        tags[TAG_TOKENIZER_TARGET] = str(tok["targetFingerprint"])
    if tok.get("draftFingerprint"):
        tags[TAG_TOKENIZER_DRAFT] = str(tok["draftFingerprint"])
    if verdict.get("bestSpeculation"):
        tags[TAG_BEST_SPECULATION] = json.dumps(verdict["bestSpeculation"], sort_keys=True)
    tags[TAG_GATE_STATUS] = "passed" if verdict.get("passed") is True else "failed"
    return tags


def gate_error_tags(message: str) -> dict[str, str]:
    """The tags of a gate that ended in an error instead of a verdict (status last)."""
    return {TAG_GATE_MESSAGE: message[-4000:], TAG_GATE_STATUS: "error"}


TAG_GATE_STARTED = "specpair.gate.started_ms"   # on a gate run: which gate attempt it records


def gate_run_tags(version: str, started_ms: int | None = None) -> dict[str, str]:
    """The tags of the run a gate's verdict is logged to when the gate opened none. The attempt's
    start (the runner's, fixed for all its tries) finds the run again when a try that made it
    failed later: a retry records into it instead of making a second gate-vN run."""
    tags = {"mlflow.runName": f"gate-v{version}", "specpair.model_version": str(version)}
    if started_ms is not None:
        tags[TAG_GATE_STARTED] = str(started_ms)
    return tags


def gate_attempt_filter(version: str, started_ms: int) -> str:
    """MLflow's run search for the gate run of one attempt (gate_run_tags)."""
    return f"tags.`specpair.model_version` = '{version}' and tags.`{TAG_GATE_STARTED}` = '{started_ms}'"


def gate_experiment(model_name: str) -> str:
    """The MLflow experiment a pair's release and gate runs go to."""
    return f"specpair/{model_name}"


def gate_result_of(tags: dict[str, str]) -> tuple[str, dict[str, Any] | None, str]:
    """(status, verdict or None, message) from a version's tags."""
    verdict = None
    if tags.get(TAG_GATE_VERDICT):
        try:
            verdict = json.loads(tags[TAG_GATE_VERDICT])
        except (ValueError, RecursionError):  # not JSON, or nested deeper than a verdict is
            verdict = None
    return tags.get(TAG_GATE_STATUS, "pending"), verdict, tags.get(TAG_GATE_MESSAGE, "")



def release_of_tags(tags: Mapping[str, str]) -> dict[str, Any] | None:
    """A version's release from its specpair.release tag (None: none, or not a release)."""
    try:
        release = json.loads(tags.get(TAG_RELEASE) or "null")
    except ValueError:
        return None
    return release if isinstance(release, dict) else None

# The verdict's rates for golden prompts that asked for structure (gate/structured.py), as
# metrics: present only where such prompts were judged.
STRUCTURE_METRICS = (("schemaValidity", "schema_validity"), ("toolCallParse", "tool_call_parse"))


def gate_metrics(verdict: dict[str, Any]) -> dict[tuple[str, int], float]:
    """MLflow metrics from a verdict: overall, per category, per draft position, k sweep."""
    out: dict[tuple[str, int], float] = {}

    def put(name: str, value: Any, step: int = 0) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[(name, step)] = float(value)

    for key, name in (("acceptanceRate", "acceptance_rate"), ("meanAcceptanceLength", "mean_acceptance_length"),
                      ("speedup", "speedup"), ("greedyIdentity", "greedy_identity"), *STRUCTURE_METRICS,
                      ("speedupNoise", "speedup_noise")):
        put(name, verdict.get(key))
    for cat, vals in (verdict.get("categories") or {}).items():
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(cat))
        for key, name in (("acceptanceRate", "acceptance_rate"), ("speedup", "speedup"),
                          ("greedyIdentity", "greedy_identity"), ("meanAcceptanceLength", "mean_acceptance_length"),
                          *STRUCTURE_METRICS):
            put(f"{name}.{safe}", (vals or {}).get(key))
    for pos, v in enumerate(verdict.get("acceptancePerPosition") or []):
        put("acceptance_per_position", v, pos)
    for row in verdict.get("kSweep") or []:
        if isinstance(row, dict) and isinstance(row.get("k"), int):
            put("speedup_by_k", row.get("speedup"), row["k"])
    for row in verdict.get("batchSweep") or []:
        # The concurrencies a vLLM gate measured k by load at (our engine's: its batch sizes).
        if isinstance(row, dict) and isinstance(row.get("batchSize"), int):
            put("speedup_by_batch_size", row.get("speedup"), row["batchSize"])
    out[("passed", 0)] = 1.0 if verdict.get("passed") is True else 0.0
    return out


# -- what a reviewer reads in MLflow's UI (docs/mlflow.md) ---------------------------------------

# MLflow 3 opens an experiment of this kind on its runs (not on the GenAI traces overview).
TAG_EXPERIMENT_KIND, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
# MLflow 3.17's UI takes the view from its GenAI / Model training switch instead, unless a link
# names it: links to a pair's experiment do.
RUNS_VIEW = "workflowType=machine_learning"
TAG_RUN_DESCRIPTION = "mlflow.note.content"      # the run page's Description
TAG_LOGGED_ARTIFACTS = "mlflow.loggedArtifacts"  # which artifacts are tables (mlflow.log_table's tag)
TAG_LOGGED_MODEL = "specpair.logged_model_id"    # on a release run: its version's logged model
TAG_GATE_SUMMARY = "specpair.gate.summary"       # the verdict and its headline figures, in words
GOLDEN_DATASET = "golden-prompts"
PER_PROMPT_TABLE = "gate/per_prompt.json"
PER_PROMPT_COLUMNS = ("category", "prompt", "output_tokens", "acceptance", "accepted_length", "speedup", "identical",
                      "schema_valid", "tool_call_parsed")     # the last two: None where the prompt asked for neither
DATASET_DIGEST_LEN = 12                          # MLflow keeps at most 36 characters
PARAMS_PER_BATCH = 100                           # MLflow's limit for one log-batch's parameters


def unlogged(wanted: dict[str, Any], logged: dict[str, Any]) -> list[tuple[str, Any]]:
    """What of `wanted` (parameters or metrics by key) a run does not hold yet, in batches' order.
    A key it holds is done whatever its value: MLflow never changes a parameter (it refuses the
    request), and a value from an older operator's wording must not stall the release."""
    return [(k, v) for k, v in wanted.items() if k not in logged]


def experiment_tags() -> dict[str, str]:
    return {TAG_EXPERIMENT_KIND: EXPERIMENT_KIND}


def _safe_key(name: Any) -> str:
    """A category as MLflow takes it in a metric or parameter key."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(name))


def _model_ref(side: dict[str, Any] | None) -> str:
    side = side or {}
    if side.get("drafter"):
        return f"drafter:{side['drafter']}"
    rev = f"@{side['revision']}" if side.get("revision") else ""
    return f"{side.get('source')}{rev}"


def release_params(release: dict[str, Any]) -> dict[str, str]:
    """A release's settings as MLflow parameters, the same on its release run and its gate run, so
    MLflow's run comparison lines two releases up setting by setting."""
    spec = release.get("speculation") or {}
    gating = release.get("gating") or {}
    th = gating.get("thresholds") or {}
    out = {"target": _model_ref(release.get("target")), "draft": _model_ref(release.get("draft")),
           "method": str((release.get("draft") or {}).get("method") or (release.get("draft") or {}).get("drafter")
                         or "draft-model"),
           "engine": str((release.get("engine") or {}).get("kind") or "specpair"),
           "engine.image": str((release.get("engine") or {}).get("image") or ""),
           "golden_prompts": str(len(gating.get("prompts") or [])),
           "max_new_tokens": str(gating.get("maxNewTokens", "")),
           "threshold.requireGreedyIdentity": str(th.get("requireGreedyIdentity", True)),
           "threshold.minAcceptance": str(th.get("minAcceptance", 0.0)),
           # Absent: target-only's speed less the noise the gate measures (contract.speedup_floor).
           "threshold.minSpeedup": str(th.get("minSpeedup", "default: 1.0 less the measured noise"))}
    for key, value in sorted(spec.items()):
        out[f"speculation.{key}"] = str(value)
    for cat, floor in sorted((th.get("minCategoryAcceptance") or {}).items()):
        out[f"threshold.minCategoryAcceptance.{_safe_key(cat)}"] = str(floor)
    if any(p.get(key) is not None for p in gating.get("prompts") or [] for key in GOLDEN_STRUCTURE_KEYS):
        for floor_name, (_, _, default) in STRUCTURE_FLOORS.items():
            out[f"threshold.{floor_name}"] = str(th.get(floor_name, default))
    for key, value in sorted((release.get("parallelism") or {}).items()):
        out[f"parallelism.{key}"] = str(value)
    return {k: v[:6000] for k, v in out.items()}


def gate_params(release: dict[str, Any], verdict: dict[str, Any]) -> dict[str, str]:
    """The release's parameters plus what the gate tuned on its hardware (k, batch threshold)."""
    out = release_params(release)
    for key, value in sorted((verdict.get("bestSpeculation") or {}).items()):
        out[f"tuned.{key}"] = str(value)
    if verdict.get("device"):
        out["device"] = str(verdict["device"])
    return out


def prompts_digest(prompts: list[dict[str, Any]]) -> str:
    """The golden prompts' content digest: sha256 of their canonical JSON (the form the release's
    content hash covers them in), cut to DATASET_DIGEST_LEN."""
    canonical = json.dumps(prompts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:DATASET_DIGEST_LEN]


def golden_dataset_input(release: dict[str, Any], release_hash: str) -> dict[str, Any]:
    """The golden prompts as a run's dataset input (MLflow REST `runs/log-inputs`), marked as the
    evaluation's: name, digest, where they come from (the release), schema and profile."""
    prompts = (release.get("gating") or {}).get("prompts") or []
    counts: dict[str, int] = {}
    for p in prompts:
        counts[str(p.get("category"))] = counts.get(str(p.get("category")), 0) + 1
    schema = {"mlflow_colspec": [{"type": "string", "name": "prompt", "required": True},
                                 {"type": "string", "name": "category", "required": True}]}
    return {"dataset": {"name": GOLDEN_DATASET, "digest": prompts_digest(prompts), "source_type": "code",
                        "source": json.dumps({"tags": {TAG_HASH: release_hash,
                                                       "mlflow.source.name": "release.gating.prompts"}}),
                        "schema": json.dumps(schema),
                        "profile": json.dumps({"num_rows": len(prompts), "categories": counts})},
            "tags": [{"key": "mlflow.data.context", "value": "eval"}]}


def per_prompt_table(golden: list[dict[str, Any]]) -> dict[str, list]:
    """The gate's per-prompt results as MLflow stores a logged table (pandas' "split" JSON, what
    mlflow.log_table writes and MlflowClient.load_table reads)."""
    rows = []
    for g in golden:
        tokens = g.get("output_tokens", len(g.get("token_ids") or []))
        rows.append([str(g.get("category")), str(g.get("prompt")), tokens, g.get("acceptance_rate"),
                     g.get("mean_acceptance_length"), g.get("speedup"), bool(g.get("identical")),
                     g.get("schema_valid"), g.get("tool_call_parsed")])
    return {"columns": list(PER_PROMPT_COLUMNS), "data": rows}


def _pct(v: Any) -> str:
    return f"{float(v) * 100:.1f}%" if _is_number(v) else "n/a"


def _times(v: Any) -> str:
    return f"{float(v):.2f}x" if _is_number(v) else "n/a"


def _floor(v: Any) -> float:
    return float(v) if _is_number(v) else 0.0


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def slowed_categories(verdict: dict[str, Any]) -> list[tuple[str, float]]:
    """Categories speculation made slower (speedup below 1): a gate may pass with one."""
    return [(str(cat), float(vals["speedup"])) for cat, vals in sorted((verdict.get("categories") or {}).items())
            if _is_number((vals or {}).get("speedup")) and float(vals["speedup"]) < 1.0]


def gate_summary(verdict: dict[str, Any]) -> str:
    """One line a reviewer reads on the version: verdict, overall and per-category figures."""
    head = "passed" if verdict.get("passed") is True else "failed"
    parts = [f"{head}: acceptance {_pct(verdict.get('acceptanceRate'))}, speedup {_times(verdict.get('speedup'))}"]
    for cat, vals in sorted((verdict.get("categories") or {}).items()):
        vals = vals or {}
        parts.append(f"{cat} {_pct(vals.get('acceptanceRate'))} / {_times(vals.get('speedup'))}")
    slowed = slowed_categories(verdict)
    if slowed:
        parts.append("slower with speculation: " + ", ".join(f"{c} {_times(s)}" for c, s in slowed))
    return "; ".join(parts)[:4000]


def _speedup_floor_shown(verdict: dict[str, Any], th: dict[str, Any]) -> str:
    floor, defaulted = speedup_floor(verdict, th)
    if not defaulted:
        return f">= {floor:.2f}x"
    off = "; slower: speculation shipped off" if shipped_target_only(verdict) else ""
    return f">= {floor:.2f}x (default: target-only less the {1.0 - floor:.3f} noise measured{off})"


def gate_description(verdict: dict[str, Any], release: dict[str, Any] | None) -> str:
    """The gate run's description (markdown): the verdict, every floor it was held to with the
    figure it was held against, and any category speculation slowed down."""
    th = ((release or {}).get("gating") or {}).get("thresholds") or {}
    cats = verdict.get("categories") or {}
    identity = verdict.get("greedyIdentityWithinTies", verdict.get("greedyIdentity"))
    shown_identity = f"{float(identity):.3f}" if _is_number(identity) else "n/a"
    lines = [f"**Gate {'passed' if verdict.get('passed') is True else 'failed'}** "
             f"on {verdict.get('device') or 'an unnamed device'}."]
    if release is None:
        lines += ["", "(The release's floors were not handed to the recorder.)"]
    else:
        lines += ["", "| floor | required | measured |", "|---|---|---|",
                  f"| greedy identity | {'1.000' if th.get('requireGreedyIdentity', True) else 'not required'} "
                  f"| {shown_identity} |",
                  f"| acceptance | >= {_floor(th.get('minAcceptance')):.3f} | {_pct(verdict.get('acceptanceRate'))} |",
                  f"| speedup | {_speedup_floor_shown(verdict, th)} | {_times(verdict.get('speedup'))} |"]
        for cat, floor in sorted((th.get("minCategoryAcceptance") or {}).items()):
            measured = _pct((cats.get(cat) or {}).get("acceptanceRate"))
            lines.append(f"| acceptance of {cat} | >= {_floor(floor):.3f} | {measured} |")
        for floor_name, (key, words, default) in STRUCTURE_FLOORS.items():
            floor = th.get(floor_name, default)
            for cat, vals in sorted(cats.items()):
                if _is_number((vals or {}).get(key)):
                    lines.append(f"| {words} of {cat} | >= {_floor(floor):.3f} | {_pct(vals[key])} |")
        floors_at_zero = [n for n in ("minAcceptance", "minSpeedup") if not _floor(th.get(n)) > 0
                          and not (n == "minSpeedup" and th.get(n) is None)]    # (its default is a floor)
        if floors_at_zero:
            lines += ["", f"No floor set for {' and '.join(floors_at_zero)}: any figure passes it."]
    if cats:
        lines += ["", "| category | acceptance | accepted length | speedup |", "|---|---|---|---|"]
        for cat, vals in sorted(cats.items()):
            vals = vals or {}
            length = vals.get("meanAcceptanceLength")
            lines.append(f"| {cat} | {_pct(vals.get('acceptanceRate'))} | "
                         f"{f'{float(length):.2f}' if _is_number(length) else 'n/a'} | {_times(vals.get('speedup'))} |")
    slowed = slowed_categories(verdict)
    if slowed:
        lines += ["", "**Slower with speculation** (speedup floors hold the overall figure, not a category): "
                  + ", ".join(f"speedup.{c} {s:.2f}" for c, s in slowed) + "."]
    if verdict.get("bestSpeculation"):
        lines += ["", "Tuned on this hardware: " + ", ".join(f"{k} = {v}" for k, v in
                                                            sorted(verdict["bestSpeculation"].items())) + "."]
    if verdict.get("reasons"):
        lines += ["", "Reasons it failed:", *[f"- {r}" for r in verdict["reasons"]]]
    return "\n".join(lines)


def headline_metrics(verdict: dict[str, Any]) -> dict[str, float]:
    """What a model version shows as its metrics: overall and per-category acceptance and speedup."""
    out = {}
    for key, name in (("acceptanceRate", "acceptance_rate"), ("speedup", "speedup"),
                      ("greedyIdentity", "greedy_identity"), *STRUCTURE_METRICS):
        if _is_number(verdict.get(key)):
            out[name] = float(verdict[key])
    for cat, vals in (verdict.get("categories") or {}).items():
        for key, name in (("acceptanceRate", "acceptance_rate"), ("speedup", "speedup"), *STRUCTURE_METRICS):
            if _is_number((vals or {}).get(key)):
                out[f"{name}.{_safe_key(cat)}"] = float(vals[key])
    out["passed"] = 1.0 if verdict.get("passed") is True else 0.0
    return out


def logged_model_id(version_source: str) -> str | None:
    """The logged model a version was registered from (source `models:/m-...`), else None (a
    version made before releases had one)."""
    if version_source.startswith("models:/m-") and "/" not in version_source[len("models:/"):]:
        return version_source[len("models:/"):]
    return None


GATE_SECTION = "\n\n---\n### Gate\n"
HISTORY_SECTION = "\n\n---\n### History\n"
DESCRIPTION_CHARS = 5000          # what MLflow's database keeps of a version's description
HISTORY_LINE_CHARS = 400


def _description_parts(description: str) -> tuple[str, str, list[str]]:
    """(the release's text, the gate section's body, the history's lines) of a version's description."""
    rest, _, history = (description or "").partition(HISTORY_SECTION)
    base, _, gate = rest.partition(GATE_SECTION)
    return base, gate, [line for line in history.split("\n") if line.strip()]


def _description(base: str, gate: str, history: list[str]) -> str:
    """The parts put together; the oldest history lines go first when MLflow would cut it."""
    while True:
        text = base + (GATE_SECTION + gate if gate else "") + (HISTORY_SECTION + "\n".join(history) if history else "")
        if len(text) <= DESCRIPTION_CHARS or not history:
            return text[:DESCRIPTION_CHARS]
        history = history[1:]


def with_gate_section(description: str, verdict: dict[str, Any], experiment_id: str, run_id: str) -> str:
    """A version's description with its gate's result and a link to the gate run (replacing the
    section an earlier gate of the same version wrote; its history kept)."""
    base, _, history = _description_parts(description)
    gate = (f"{gate_summary(verdict)}\n\nEvidence: [gate run](#/experiments/{experiment_id}/runs/{run_id}) "
            f"(parameters, golden prompts dataset, per-prompt table `{PER_PROMPT_TABLE}`, verdict); every "
            f"release, gate and event of this pair: [runs](#/experiments/{experiment_id}?{RUNS_VIEW}).")
    return _description(base, gate, history)


def with_history_line(description: str, line: str) -> str:
    """A version's description with one more line in its history section."""
    base, gate, history = _description_parts(description)
    return _description(base, gate, [*history, "- " + line[:HISTORY_LINE_CHARS]])

# -- live events on the record -------------------------------------------------------------------
# The operator marks each change of a version's standing with a tag it reads back (crash safety:
# plan/release_plan.py, plan/serving_*.py, policy/shadow_run.py). What a reviewer reads of the same event is written
# beside the mark: a short tag in words on the version, a line in its description's history, and
# the evidence in a run of its own with metrics.

TAG_PROMOTED_AT = "specpair.promoted_at"
TAG_SPECULATION_OFF = "specpair.drift.speculation_off"
TAG_SHADOW_VERDICT = "specpair.shadow.verdict"
# On a version a training Job registered (gate/training_runner.py, issue 58): its lineage. The
# release plan reads `release` and `category` to gate, shadow and promote it as a learned draft
# (plan/learned_release.py).
LINEAGE = "specpair.lineage"
TAG_LINEAGE_RELEASE = f"{LINEAGE}.release"           # the version whose draft was retrained
TAG_LINEAGE_RELEASE_HASH = f"{LINEAGE}.release_hash"  # that release's content hash
TAG_LINEAGE_CATEGORY = f"{LINEAGE}.category"
TAG_LINEAGE_CAPTURE = f"{LINEAGE}.capture"           # JSON: requests, tokens, releases, first, last
TAG_LINEAGE_RUN = f"{LINEAGE}.training_run"          # the MLflow run holding the draft
TAG_LINEAGE_JOB = f"{LINEAGE}.job"                   # the training Job (its pod's name)
TAG_DRIFT_PROBE = "specpair.drift.probe"    # a drift probe began or ended (probe_mark)
TAG_EVENT = "specpair.event"               # on an event run: which event
TAG_EVENT_KEY = "specpair.event.key"       # on an event run: what makes writing it again a no-op
EVENT_NAMES = {TAG_PROMOTED_AT: "promotion", TAG_SHADOW_VERDICT: "shadow-verdict",
               TAG_SPECULATION_OFF: "speculation-off", TAG_ROLLED_BACK: "rollback", TAG_DRIFT_PROBE: "probe"}
SUMMARY_CHARS = 300

# drift.Judged.message(): "category 'code' acceptance 0.210 (upper bound 0.250) over 40 requests /
# 300 drafted tokens < floor 0.400 (gated 0.600)"
_DRIFT_JUDGEMENT = re.compile(
    r"(?:category '(?P<cat>[^']*)'|overall \(gated categories\)) acceptance (?P<live>[\d.]+) \(upper bound "
    r"(?P<upper>[\d.]+)\) over (?P<requests>[\d.]+) requests / (?P<drafted>\d+) drafted tokens \S+ floor "
    r"(?P<floor>[\d.]+) \(gated (?P<gated>[\d.]+)\)")


@dataclass(frozen=True)
class EventRecord:
    name: str                   # promotion | shadow-verdict | speculation-off | speculation-on | probe | rollback
    summary: str                # the decision and its figures in words (a version tag, a history line)
    description: str            # the event run's description (markdown)
    metrics: dict[str, float]   # the figures behind it
    key: str                    # the same event written twice is one record

    @property
    def version_tag(self) -> str:
        return f"specpair.event.{self.name}"


def drift_figures(text: str) -> dict[str, float]:
    """The figures of each drift judgement in a reason (drift.Judged.message), by category."""
    out: dict[str, float] = {}
    for m in _DRIFT_JUDGEMENT.finditer(text):
        cat = _safe_key(m.group("cat")) if m.group("cat") is not None else "overall"
        for field in ("live", "upper", "floor", "gated", "requests", "drafted"):
            out[f"{field}_acceptance.{cat}" if field in ("live", "upper", "gated") else f"{field}.{cat}"] = \
                float(m.group(field))
    return out


def probe_mark(on: bool, at: float) -> str:
    """The drift probe mark's value: a probe that began (speculation on with the draft while it
    was off for drift) or ended (off again), at `at` (epoch seconds, from the drift memory the
    status keeps, so a pass that is run again writes the same mark: one record per probe)."""
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    if on:
        return (f"on at {when}: speculation on with the draft to measure it again (nothing was drafted "
                "while speculation was off for drift)")
    return f"over at {when}: speculation off again (the probe's acceptance did not recover)"


def event_record(tag: str, value: str, version: str, version_tags: dict[str, str]) -> EventRecord | None:
    """What a reviewer reads of an event mark `tag`=`value` on `version` (None: not an event)."""
    name = EVENT_NAMES.get(tag)
    if name is None:
        return None
    key = hashlib.sha256(json.dumps([tag, value, str(version)]).encode()).hexdigest()[:24]
    if tag == TAG_PROMOTED_AT:
        _, verdict, _ = gate_result_of(version_tags)
        gate = gate_summary(verdict) if verdict else "no gate verdict recorded"
        summary = f"v{version} promoted to champion at {value} (gate {gate})"
        return EventRecord(name, summary[:SUMMARY_CHARS], summary, headline_metrics(verdict) if verdict else {}, key)
    if tag == TAG_SHADOW_VERDICT:
        try:
            verdict = json.loads(value)
        except ValueError:
            verdict = {}
        verdict = verdict if isinstance(verdict, dict) else {}
        metrics: dict[str, float] = {}
        lines = []
        # A learned draft (issue 58) is judged on its category against a fixed reference, which
        # its numbers carry in the champion's place there.
        learned = verdict.get("learned") if isinstance(verdict.get("learned"), dict) else {}
        for field, v in sorted(learned.items()):
            if _is_number(v):
                metrics[f"learned.{field}"] = float(v)
        for cat, n in sorted((verdict.get("categories") or {}).items()):
            label = "pooled" if cat == "*" else _safe_key(cat)
            for field, v in sorted((n or {}).items()):
                if _is_number(v):
                    metrics[f"{field}.{label}"] = float(v)
            against = "reference" if learned and cat == learned.get("category") else "champion"
            lines.append(f"- {label}: candidate {(n or {}).get('candidateAlpha')} vs {against} "
                         f"{(n or {}).get('championAlpha')} over {(n or {}).get('requests')} requests "
                         f"({(n or {}).get('status')})")
        what = f"learned draft for '{learned.get('category')}' " if learned else ""
        summary = f"shadow verdict on {what}v{version}: {verdict.get('result')}: {verdict.get('reason', '')}"
        return EventRecord(name, summary[:SUMMARY_CHARS], "\n".join([summary, "", *lines]), metrics, key)
    if tag == TAG_SPECULATION_OFF:
        if not value:
            return EventRecord("speculation-on", f"v{version}: speculation back on (acceptance recovered)",
                               f"v{version}: speculation back on (acceptance recovered)", {}, key)
        summary = f"v{version} serving target-only (speculation off): {value}"
        return EventRecord(name, summary[:SUMMARY_CHARS], summary, drift_figures(value), key)
    if tag == TAG_DRIFT_PROBE:
        summary = f"v{version} drift probe {value}"
        return EventRecord(name, summary[:SUMMARY_CHARS], summary,
                           {"probing": 1.0 if value.startswith("on") else 0.0}, key)
    summary = f"v{version} rolled back (lost the champion alias): {value}"
    return EventRecord(name, summary[:SUMMARY_CHARS], summary, drift_figures(value), key)
