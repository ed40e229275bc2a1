"""The gate's golden prompts' generations as MLflow traces: what the gate runner writes so that the
gate run's and the experiment's Traces show each prompt, its reply and its timings (docs/mlflow.md).
Pure: the runner's adapter (gate/record.py) sends what this builds."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from typing import Any

# Written as MLflow 3's client writes them where the server keeps spans as artifacts: the trace's
# info (REST `POST /api/3.0/mlflow/traces`, StartTraceV3), then its spans as `traces.json` in the
# artifact location the server answered with. Both `mlflow server`s (uvicorn or gunicorn) take it.
TRACE_DATA_FILE = "traces.json"
TAG_TRACE_ARTIFACTS = "mlflow.artifactLocation"   # on a started trace: where its spans go
TRACE_PREVIEW_CHARS = 1000


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _hex_id(seed: str, length: int) -> str:
    return hashlib.sha256(seed.encode()).hexdigest()[:length]


def _otel_id(hex_id: str) -> str:
    """A trace or span id as MLflow's traces.json holds it (OTel bytes, base64)."""
    return base64.b64encode(bytes.fromhex(hex_id)).decode("ascii")


def _span(trace_hex: str, span_hex: str, parent_hex: str | None, name: str, start_ns: int, end_ns: int,
          span_type: str, inputs: Any, outputs: Any, attributes: dict[str, Any]) -> dict[str, Any]:
    attrs = {"mlflow.traceRequestId": json.dumps(f"tr-{trace_hex}"), "mlflow.spanType": json.dumps(span_type),
             "mlflow.spanInputs": json.dumps(inputs, ensure_ascii=False),
             "mlflow.spanOutputs": json.dumps(outputs, ensure_ascii=False),
             **{k: json.dumps(v) for k, v in attributes.items()}}
    return {"trace_id": _otel_id(trace_hex), "span_id": _otel_id(span_hex),
            "parent_span_id": _otel_id(parent_hex) if parent_hex else None, "name": name,
            "start_time_unix_nano": start_ns, "end_time_unix_nano": end_ns, "events": [],
            "status": {"code": "STATUS_CODE_OK", "message": ""}, "attributes": attrs, "links": []}


def golden_trace(row: dict[str, Any], index: int, experiment_id: str, run_id: str, version: str,
                 start_ms: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One golden prompt's generation as an MLflow trace: (the StartTraceV3 body, its spans as
    traces.json). The root span holds the prompt, the reply served (the speculative one) and the
    prompt's figures; its children the target-only and the speculative generation, each as long as
    the median of its timings (golden_outputs' `seconds`), laid end to end from the moment the
    prompt's timings began (`started_at`, else `start_ms`). A gate that timed nothing per prompt
    gives spans without length. The ids follow from the gate run and the prompt's place, so the
    same record written again is the same trace."""
    trace_hex = _hex_id(f"{run_id}/golden/{index}", 32)
    seconds = row.get("seconds") if isinstance(row.get("seconds"), dict) else {}
    t_base = float(seconds["target_only"]) if _is_number(seconds.get("target_only")) else 0.0
    t_spec = float(seconds["speculative"]) if _is_number(seconds.get("speculative")) else 0.0
    # (to the microsecond: a float's seconds times 1e9 is off by a few nanoseconds)
    start_ns = round(float(row["started_at"]) * 1e6) * 1000 if _is_number(row.get("started_at")) \
        else start_ms * 1_000_000
    base_end = start_ns + round(t_base * 1e6) * 1000
    end_ns = base_end + round(t_spec * 1e6) * 1000
    category = str(row.get("category"))
    figures = {k: row[k] for k in ("output_tokens", "acceptance_rate", "mean_acceptance_length", "speedup", "identical")
               if k in row}
    root_hex = _hex_id(f"{trace_hex}/root", 16)
    prompt = {"prompt": str(row.get("prompt")), "category": category}
    spans = [_span(trace_hex, root_hex, None, f"golden {index + 1}: {category}", start_ns, end_ns, "CHAIN",
                   prompt, {"reply": row.get("speculative"), **figures},
                   {f"specpair.{k}": v for k, v in figures.items()}),
             _span(trace_hex, _hex_id(f"{trace_hex}/target-only", 16), root_hex, "target-only", start_ns, base_end,
                   "LLM", prompt, {"reply": row.get("target_only")}, {"specpair.seconds": t_base}),
             _span(trace_hex, _hex_id(f"{trace_hex}/speculative", 16), root_hex, "speculative", base_end, end_ns,
                   "LLM", prompt, {"reply": row.get("speculative")},
                   {"specpair.seconds": t_spec, **{f"specpair.{k}": row[k] for k in
                                                   ("acceptance_rate", "mean_acceptance_length") if k in row}})]
    info = {"trace_id": f"tr-{trace_hex}",
            "trace_location": {"type": "MLFLOW_EXPERIMENT", "mlflow_experiment": {"experiment_id": str(experiment_id)}},
            "request_time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(start_ns / 1e9))
                            + f".{(start_ns // 1_000_000) % 1000:03d}Z",
            "execution_duration": f"{(end_ns - start_ns) / 1e9:.3f}s", "state": "OK",
            "request_preview": str(row.get("prompt"))[:TRACE_PREVIEW_CHARS],
            "response_preview": str(row.get("speculative") or "")[:TRACE_PREVIEW_CHARS],
            "trace_metadata": {"mlflow.sourceRun": run_id, "mlflow.trace_schema.version": "3"},
            "tags": {"mlflow.traceName": f"golden {index + 1}: {category}", "specpair.category": category,
                     "specpair.model_version": str(version)}}
    return {"trace": {"trace_info": info}}, {"spans": spans}
