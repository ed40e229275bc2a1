"""Which series each engine exports for each `rollout.autoscaling.metric`, and the refusal of a
metric the pair's engine cannot export: part of the contract, since the spec's own check refuses
such a pair (engine_limits.refusals, called by validation.validate_spec) before anything is
gated or served. One metric name means the same on both engines; SIGNALS maps it to each
engine's series (the specpair engine's engine/specpair/server/metrics.py, vLLM's
vllm/v1/metrics/loggers.py). The autoscaler built from them is desired/autoscaling.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from specpair_operator.crd.schema import autoscaling_with_defaults, has_gpu

# How far back a rate looks: the counters' per-second rates, and the live acceptance.
RATE_WINDOW = "1m"
# How far back effectiveLoad reads the tokens a step yielded when the pair emitted nothing in
# RATE_WINDOW (idle): long enough to span an idle stretch between bursts, short enough that a
# pair's acceptance from before a quiet night is not taken for today's.
HISTORY_WINDOW = "1h"


@dataclass(frozen=True)
class Series:
    """One signal on one engine: how KEDA queries it over a pair's pods (a sum, divided by the
    target per replica), and the per-pod series an HPA averages (None: the signal is several
    series, which only a query can combine)."""
    promql: str                # {selector}: the pair's label matchers; {window}: RATE_WINDOW
    pod_metric: str | None


@dataclass(frozen=True)
class Signal:
    meaning: str
    engines: Mapping[str, Series]   # engine kind -> its series; an engine absent cannot export it


def _sum_rate(series: str, window: str) -> str:
    """sum(rate(series[window])) over the pair's pods, as a Series.promql template."""
    return f"sum(rate({series}{{{{{{selector}}}}}}[{window}]))"


def _tokens_a_step(emitted: str, accepted: str, window: str) -> str:
    """Each step of a row emits its accepted draft tokens plus one, so steps = emitted - accepted
    and tokens a step = emitted / (emitted - accepted): 1 target-only, ~3 at acceptance length 3.
    Absent where the window holds no step (or no accepted series)."""
    emitted_rate, accepted_rate = _sum_rate(emitted, window), _sum_rate(accepted, window)
    return f"({emitted_rate} / ({emitted_rate} - {accepted_rate} > 0))"


def _effective_load(waiting: str, emitted: str, accepted: str) -> str:
    """Queued requests over the tokens a step yields at the live acceptance (RATE_WINDOW): a pair
    whose acceptance collapses serves its queue slower, so the same queue is more load.
    A pair that emitted nothing in RATE_WINDOW (idle; the first seconds of a burst, before a scrape
    of its steps) has no live acceptance: its last HISTORY_WINDOW's stands in, else the first
    reading of a burst after idle is the raw queue (3x the load at acceptance length 3) and
    KEDA's HPA scales out on it. The history stands in only where the pair emitted nothing in
    RATE_WINDOW (the `unless`): a pair emitting without accepted drafts (speculation off, vLLM
    without a drafter: no accepted series, so no live ratio either) yields one token a step now,
    whatever it yielded an hour ago. A pair with no history (brand new) counts one token a step:
    the raw queue, the side that scales out sooner rather than later."""
    live = _tokens_a_step(emitted, accepted, "{window}")
    history = _tokens_a_step(emitted, accepted, HISTORY_WINDOW)
    emitting = f"{_sum_rate(emitted, '{window}')} > 0"
    return f"sum({waiting}{{{{{{selector}}}}}}) / ({live} or ({history} unless {emitting}) or vector(1))"


SPECPAIR, VLLM = "specpair", "vllm"
SIGNALS: dict[str, Signal] = {
    "queueLength": Signal("requests queued for a batch slot", {
        SPECPAIR: Series("sum(specpair_num_requests_waiting{{{selector}}})", "specpair_num_requests_waiting"),
        VLLM: Series("sum(vllm:num_requests_waiting{{{selector}}})", "vllm:num_requests_waiting")}),
    "runningRequests": Signal("requests in the running batch", {
        SPECPAIR: Series("sum(specpair_num_requests_running{{{selector}}})", "specpair_num_requests_running"),
        VLLM: Series("sum(vllm:num_requests_running{{{selector}}})", "vllm:num_requests_running")}),
    "tokensPerSecond": Signal("tokens streamed to clients per second", {
        SPECPAIR: Series("sum(rate(specpair_num_emitted_tokens_total{{{selector}}}[{window}]))",
                         "specpair_num_emitted_tokens"),
        VLLM: Series("sum(rate(vllm:generation_tokens_total{{{selector}}}[{window}]))", "vllm:generation_tokens")}),
    # The specpair engine has a KV budget on CUDA (by default) or with rollout.kvBudget (its
    # --kv-budget), vLLM always (its KV cache blocks).
    "kvCacheUsage": Signal("share of the KV cache the running requests hold", {
        SPECPAIR: Series("sum(specpair_kv_cache_usage_ratio{{{selector}}})", "specpair_kv_cache_usage_ratio"),
        VLLM: Series("sum(vllm:kv_cache_usage_perc{{{selector}}})", "vllm:kv_cache_usage_perc")}),
    "effectiveLoad": Signal("queued requests over the tokens each step yields at the live acceptance", {
        SPECPAIR: Series(_effective_load("specpair_num_requests_waiting", "specpair_num_emitted_tokens_total",
                                         "specpair_num_accepted_tokens_total"), None),
        VLLM: Series(_effective_load("vllm:num_requests_waiting", "vllm:generation_tokens_total",
                                     "vllm:spec_decode_num_accepted_tokens_total"), None)}),
}


def engine_of(spec: Mapping[str, Any]) -> str:
    """The engine kind that serves the pair (spec.engine; the CRD's default)."""
    return str(spec.get("engine") or SPECPAIR)


def spec_refusals(spec: Any) -> list[str]:
    """metric_refusal in the words of validation.validate_spec (which calls it through engine_limits): a spec the
    CRD's schema lets through whose metric its engine cannot export."""
    why = metric_refusal(spec) if isinstance(spec, dict) else None
    if why is None:
        return []
    metric = autoscaling_with_defaults(spec["rollout"]["autoscaling"])["metric"]
    return [f'spec.rollout.autoscaling.metric: Invalid value: "{metric}": {why}']


def metric_refusal(spec: Mapping[str, Any]) -> str | None:
    """Why the pair's engine cannot export the series its `rollout.autoscaling.metric` scales on
    (None: it can, or the pair is not autoscaled, or the metric is not one of SIGNALS: the CRD's
    enum says that). An autoscaler on a series that never exists is written and never scales."""
    raw = (spec.get("rollout") or {}).get("autoscaling") if isinstance(spec.get("rollout"), dict) else None
    if not isinstance(raw, dict):
        return None
    metric, engine = autoscaling_with_defaults(raw).get("metric"), engine_of(spec)
    signal = SIGNALS.get(metric) if isinstance(metric, str) else None
    if signal is None:
        return None
    if engine not in signal.engines:
        return (f"rollout.autoscaling.metric {metric} ({signal.meaning}) is not a series engine {engine} exports; "
                f"engine {engine} offers {', '.join(m for m, s in SIGNALS.items() if engine in s.engines)}")
    rollout = dict(spec.get("rollout") or {})
    if metric == "kvCacheUsage" and engine == SPECPAIR and not has_gpu(rollout) \
            and rollout.get("kvBudget") is None:
        return (f"rollout.autoscaling.metric {metric}: engine {engine} exports specpair_kv_cache_usage_ratio only "
                f"with a KV budget, which it has on a GPU or with rollout.kvBudget (this pair has neither): the "
                f"autoscaler would never scale; set rollout.kvBudget, or use queueLength, runningRequests, "
                f"tokensPerSecond or effectiveLoad")
    return None
