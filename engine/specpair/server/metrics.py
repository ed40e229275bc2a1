"""Prometheus metrics, named the way vLLM names its speculative-decoding metrics, prefixed specpair_.

Each server owns its CollectorRegistry (tests run several servers in one process). Counters are
fed per engine step, so they move while a long request is still streaming. Category labels come
from clients, so their number is capped: categories beyond `max_categories` count as "other".
Per-request series (requests by status, the latency histograms) are also labelled `protocol`
(`grpc` or `http`, the OpenAI-compatible front); acceptance counters are the pair's, per category.
Every series is labelled `engine`: the engine that served it (`specpair`, or `vllm` where the vLLM
pod's companion counts vLLM's per-request figures into these same series), so one dashboard reads
both engines' pairs and can tell them apart.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specpair.stats import AcceptanceStats

# Neighbouring bounds at most 1.5x apart where GPU and CPU requests live (TTFT 5 ms to 2.5 s, TPOT
# 1 ms to 300 ms): the operator judges p95s against 1.5x-2x their baseline (serving health, the
# canary), interpolating inside a bucket, and coarser buckets move a p95 by a whole bucket. Bounds
# are only added, never moved: the operator adds histograms over the bounds both have
# (serving_health.Histogram), so pods of engines with fewer bounds are still judged beside these.
LATENCY_BUCKETS = (0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3,
                   0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04,
                 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
OTHER_CATEGORY = "other"
# The `engine` label's value on our engine's series (the companion's is "vllm").
ENGINE = "specpair"

# Shadow drafting (specpair/shadow.py): a candidate drafter scored on live requests, labelled with
# the candidate's version and content hash, counted per finished request. Each row: key, metric
# name, help, and what it counts in the scorer's per-category totals (shadow.CategoryShadow).
SHADOW_COUNTERS = (
    ("requests", "specpair_shadow_requests", "Finished requests the candidate drafter was scored on.",
     lambda c: c.requests),
    ("positions", "specpair_shadow_num_draft_positions", "First draft positions the candidate was scored at.",
     lambda c: c.candidate_alpha.drafted),
    ("alpha", "specpair_shadow_alpha_sum", "Sum over scored positions of the candidate's first-position "
     "acceptance sum_x min(p(x), q(x)).", lambda c: c.candidate_alpha.accepted),
    ("champion_positions", "specpair_shadow_champion_num_draft_positions", "First draft positions of the "
     "serving drafter in shadowed requests.", lambda c: c.champion_alpha.drafted),
    ("champion_alpha", "specpair_shadow_champion_alpha_sum", "The serving drafter's first-position "
     "acceptance summed over them.", lambda c: c.champion_alpha.accepted),
    ("drafted", "specpair_shadow_num_draft_tokens", "Greedy requests: draft tokens of the candidate's "
     "replayed chains.", lambda c: c.candidate_chain.drafted),
    ("accepted", "specpair_shadow_num_accepted_tokens", "Greedy requests: of those, the tokens the target's "
     "committed tokens accept.", lambda c: c.candidate_chain.accepted),
    ("seconds", "specpair_shadow_draft_seconds", "Seconds the candidate spent drafting.",
     lambda c: c.draft_seconds),
    ("committed", "specpair_shadow_num_committed_tokens", "Tokens committed in shadowed requests (the "
     "cost's denominator).", lambda c: c.committed_tokens),
)


class EngineMetrics:
    def __init__(self, pair: str, version: str, max_categories: int = 32,
                 registry: CollectorRegistry | None = None, engine: str = ENGINE):
        self.registry = registry or CollectorRegistry()
        self.pair, self.version, self.engine = pair, version, engine
        self._base = (pair, version, engine)
        self.max_categories = max_categories
        self._categories: set[str] = set()
        self._lock = threading.Lock()
        # Label children by (metric, label values): prometheus_client's labels() validates and
        # hashes the values at every call (13 calls a request cost the vLLM companion ~25 us).
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        base = ["pair", "version", "engine"]
        cat = base + ["category"]
        req = cat + ["protocol"]
        self.num_drafts = Counter("specpair_num_drafts", "Verification rounds that had draft tokens.",
                                  cat, registry=r)
        self.num_draft_tokens = Counter("specpair_num_draft_tokens", "Draft tokens proposed.", cat, registry=r)
        self.num_accepted_tokens = Counter("specpair_num_accepted_tokens",
                                           "Draft tokens the target accepted.", cat, registry=r)
        self.num_accepted_tokens_per_pos = Counter(
            "specpair_num_accepted_tokens_per_pos", "Accepted draft tokens by draft position (0-based).",
            cat + ["position"], registry=r)
        self.num_emitted_tokens = Counter("specpair_num_emitted_tokens", "Tokens streamed to clients.",
                                          cat, registry=r)
        self.acceptance_rate = Gauge("specpair_acceptance_rate",
                                     "Acceptance over the last fallback-window draft tokens, all categories.",
                                     base, registry=r)
        self.category_acceptance_rate = Gauge(
            "specpair_category_acceptance_rate",
            "Acceptance over the last fallback-window draft tokens of one category.", cat, registry=r)
        self.speculation_k = Gauge("specpair_speculation_k",
                                   "Largest k used in the last engine step (0 = target-only).", base, registry=r)
        # The k each batch size may draft, measured at start-up (costs.k_for_rows: 0 where
        # drafting did not pay); absent where nothing was measured (a release's gated threshold).
        self.speculation_k_by_rows = Gauge("specpair_speculation_k_by_rows",
                                           "Largest k a round may draft at this many rows, measured at "
                                           "start-up (0 = target-only there).", base + ["rows"], registry=r)
        # The rows decoded together (worker.decode_rows): from step costs measured at start-up
        # where --max-batch-size is not set (cli.decide_decode_rows_at_startup), priced again at
        # the context served (EngineWorker._rows_at_context), else that setting.
        self.decode_rows = Gauge("specpair_decode_rows",
                                 "Rows decoded together a step (the admitted requests past them "
                                 "wait queued).", base, registry=r)
        self.speculation_enabled = Gauge("specpair_speculation_enabled",
                                         "1 while speculation is allowed and not in fallback.", base, registry=r)
        self.fallback_events = Counter("specpair_fallback_events",
                                       "Times windowed acceptance fell below the threshold.", base, registry=r)
        self.memory_fallback = Counter("specpair_memory_fallback",
                                       "Rows that stopped drafting (or were admitted target-only) "
                                       "to fit the KV budget.", base, registry=r)
        self._memory_fallbacks_seen = 0
        # vLLM's names: prompt tokens looked up in the prefix store, and those it served; their
        # ratio is the hit rate.
        self.prefix_cache_queries = Counter("specpair_prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix store.", base, registry=r)
        self.prefix_cache_hits = Counter("specpair_prefix_cache_hits",
                                         "Prompt tokens served from the prefix store (not prefilled).",
                                         base, registry=r)
        self._prefix_seen = (0, 0)
        # The paged cache (paged_cache.py): rows given back for want of KV blocks and recomputed.
        self.kv_preemptions = Counter("specpair_kv_preemptions",
                                      "Running requests preempted for want of KV blocks (recomputed "
                                      "later, output unchanged).", base, registry=r)
        self._preemptions_seen = 0
        self.requests = Counter("specpair_requests", "Finished requests by status.", req + ["status"], registry=r)
        self.time_to_first_token = Histogram("specpair_time_to_first_token_seconds",
                                             "Arrival to first streamed token.", req, buckets=LATENCY_BUCKETS,
                                             registry=r)
        self.time_per_output_token = Histogram("specpair_time_per_output_token_seconds",
                                               "Mean time between output tokens after the first.", req,
                                               buckets=TOKEN_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram("specpair_e2e_request_latency_seconds",
                                             "Arrival to last token.", req, buckets=LATENCY_BUCKETS, registry=r)
        self.request_queue_time = Histogram("specpair_request_queue_time_seconds",
                                            "Arrival to joining the running batch.", req,
                                            buckets=LATENCY_BUCKETS, registry=r)
        self.num_requests_waiting = Gauge("specpair_num_requests_waiting", "Requests queued for a batch slot.",
                                          base, registry=r)
        self.num_requests_running = Gauge("specpair_num_requests_running", "Requests in the running batch.",
                                          base, registry=r)
        # What an autoscaler reads as memory pressure: absent without a KV budget, since bytes
        # alone say nothing about how close a pod is to its limit.
        self.kv_cache_usage = Gauge("specpair_kv_cache_usage_ratio",
                                    "Share of the KV budget the running rows hold (0..1, past 1 when over it).",
                                    base, registry=r)
        self.control_denied = Counter("specpair_control_denied",
                                      "Control calls refused for want of an allowed client certificate.",
                                      base + ["method"], registry=r)
        # Capture of served traffic (capture.py, docs/learning.md): sampled requests written, and
        # dropped (the writer's queue full or the volume failing).
        self.capture_records = Counter("specpair_capture_records", "Sampled finished requests the capture "
                                       "wrote (outcome written) or dropped.", cat + ["outcome"], registry=r)
        shadow = cat + ["candidate_version", "candidate_hash"]
        self.shadow_counters = {key: Counter(name, doc, shadow, registry=r) for key, name, doc, _ in SHADOW_COUNTERS}
        self.shadow_skipped_steps = Counter("specpair_shadow_skipped_steps", "Steps not scored: batch above "
                                            "the threshold or KV memory short.",
                                            base + ["candidate_version", "candidate_hash"], registry=r)
        self._shadow_seen: dict[str, dict[str, float]] = {}
        self._shadow_skipped_seen = 0
        self.speculation_enabled.labels(*self._base).set(0)
        self.memory_fallback.labels(*self._base)      # 0 from the start, not a gap
        self.prefix_cache_queries.labels(*self._base)
        self.prefix_cache_hits.labels(*self._base)
        self.control_denied.labels(*self._base, "SetSpeculation")     # 0 from the start, not a gap
        self.speculation_k.labels(*self._base).set(0)

    def category(self, name: str) -> str:
        """The label value for a client's category (bounded cardinality)."""
        with self._lock:
            if name in self._categories:
                return name
            if len(self._categories) < self.max_categories:
                self._categories.add(name)
                return name
        return OTHER_CATEGORY

    def _l(self, category: str) -> tuple[str, str, str, str]:
        return (*self._base, category)

    def _child(self, metric: Any, *labels: str) -> Any:
        """metric.labels(*labels), kept (categories are bounded: `category`)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def record_step(self, category: str, delta: AcceptanceStats) -> None:
        labels, child = self._l(category), self._child
        if delta.num_drafts:
            child(self.num_drafts, *labels).inc(delta.num_drafts)
            child(self.num_draft_tokens, *labels).inc(delta.num_draft_tokens)
            child(self.num_accepted_tokens, *labels).inc(delta.num_accepted_tokens)
            for pos, n in enumerate(delta.num_accepted_tokens_per_pos):
                # Touch every drafted position so a dashboard sees zeros, not gaps.
                if pos < len(delta.num_draft_tokens_per_pos) and delta.num_draft_tokens_per_pos[pos]:
                    child(self.num_accepted_tokens_per_pos, *labels, str(pos)).inc(n)
        if delta.num_emitted_tokens:
            child(self.num_emitted_tokens, *labels).inc(delta.num_emitted_tokens)
        if delta.fallback_events:
            self.fallback_events.labels(*self._base).inc(delta.fallback_events)

    def record_finished(self, category: str, status: str, *, protocol: str = "grpc",
                        queue: float | None = None, ttft: float | None = None, e2e: float | None = None,
                        tpot: float | None = None) -> None:
        labels, child = (*self._l(category), protocol), self._child
        child(self.requests, *labels, status).inc()
        if queue is not None:
            child(self.request_queue_time, *labels).observe(queue)
        if ttft is not None:
            child(self.time_to_first_token, *labels).observe(ttft)
        if e2e is not None:
            child(self.e2e_request_latency, *labels).observe(e2e)
        if tpot is not None:
            child(self.time_per_output_token, *labels).observe(tpot)

    def serving_counts(self) -> dict[str, dict]:
        """Per category, cumulative: the time-to-first-token and time-per-output-token histograms
        summed over protocols ({"upper_bounds", "counts" (cumulative), "count", "sum"}) and the
        requests by status. What GetStats reports for the operator's serving-health watch, read
        from the very series /metrics exports."""
        out: dict[str, dict] = {}

        def entry(category: str) -> dict:
            return out.setdefault(category, {"ttft": _histogram(LATENCY_BUCKETS), "tpot": _histogram(TOKEN_BUCKETS),
                                             "requests": {}})
        for key, histogram in (("ttft", self.time_to_first_token), ("tpot", self.time_per_output_token)):
            for family in histogram.collect():
                for s in family.samples:
                    h = entry(s.labels["category"])[key]
                    if s.name.endswith("_bucket") and s.labels["le"] != "+Inf":
                        h["counts"][h["upper_bounds"].index(float(s.labels["le"]))] += int(s.value)
                    elif s.name.endswith("_count"):
                        h["count"] += int(s.value)
                    elif s.name.endswith("_sum"):
                        h["sum"] += s.value
        for family in self.requests.collect():
            for s in family.samples:
                if s.name.endswith("_total"):
                    statuses = entry(s.labels["category"])["requests"]
                    statuses[s.labels["status"]] = statuses.get(s.labels["status"], 0) + int(s.value)
        return out

    def record_memory_fallbacks(self, total: int) -> None:
        """Catch the counter up with the engine's running total (engine.memory_fallbacks)."""
        with self._lock:
            delta, self._memory_fallbacks_seen = total - self._memory_fallbacks_seen, total
        if delta > 0:
            self.memory_fallback.labels(*self._base).inc(delta)

    def record_preemptions(self, total: int) -> None:
        """Catch the counter up with the engine's running total (PagedSpace.preemptions)."""
        with self._lock:
            delta, self._preemptions_seen = total - self._preemptions_seen, total
        if delta > 0:
            self.kv_preemptions.labels(*self._base).inc(delta)

    def record_prefix_cache(self, looked_up: int, served: int) -> None:
        """Catch the prefix counters up with the engine's running totals (engine.prefix_stats)."""
        with self._lock:
            (seen_up, seen_served), self._prefix_seen = self._prefix_seen, (looked_up, served)
        base = self._base
        if looked_up > seen_up:
            self.prefix_cache_queries.labels(*base).inc(looked_up - seen_up)
        if served > seen_served:
            self.prefix_cache_hits.labels(*base).inc(served - seen_served)

    def record_shadow(self, version: str, content_hash: str, categories: dict, skipped_steps: int) -> None:
        """Catch the shadow counters up with the scorer's totals per category (shadow.CategoryShadow)."""
        bounded = {name: self.category(name) for name in categories}   # before the lock: it takes it
        with self._lock:
            for name, c in categories.items():
                now = {key: read(c) for key, _, _, read in SHADOW_COUNTERS}
                seen = self._shadow_seen.setdefault(name, dict.fromkeys(now, 0))
                labels = (*self._l(bounded[name]), version, content_hash)
                for key, value in now.items():
                    if value > seen[key]:
                        self.shadow_counters[key].labels(*labels).inc(value - seen[key])
                    else:    # a zero from the start, not a gap
                        self.shadow_counters[key].labels(*labels)
                    seen[key] = value
            delta, self._shadow_skipped_seen = skipped_steps - self._shadow_skipped_seen, skipped_steps
            counter = self.shadow_skipped_steps.labels(*self._base, version, content_hash)
            if delta > 0:
                counter.inc(delta)

    def set_k_by_rows(self, decisions) -> None:
        """The start-up decisions (costs.RowsDecision): per measured batch size, its k (0 where
        drafting did not pay). Batch 1's is the k each request starts at."""
        for d in decisions:
            self.speculation_k_by_rows.labels(*self._base, str(d.rows)).set(d.k if d.pays else 0)

    def set_decode_rows(self, rows: int) -> None:
        self.decode_rows.labels(*self._base).set(rows)

    def record_capture(self, category: str, outcome: str, n: int = 1) -> None:
        self.capture_records.labels(*self._base, category, outcome).inc(n)

    def record_control_denied(self, method: str) -> None:
        self.control_denied.labels(*self._base, method).inc()

    def set_state(self, *, running: int, waiting: int, k: int, speculating: bool,
                  window_rate: float | None, category_rates: dict[str, float | None],
                  kv_usage: float | None = None) -> None:
        base = self._base
        self.num_requests_running.labels(*base).set(running)
        self.num_requests_waiting.labels(*base).set(waiting)
        if kv_usage is not None:
            self.kv_cache_usage.labels(*base).set(kv_usage)
        self.speculation_k.labels(*base).set(k)
        self.speculation_enabled.labels(*base).set(1 if speculating else 0)
        if window_rate is not None:
            self.acceptance_rate.labels(*base).set(window_rate)
        for category, rate in category_rates.items():
            if rate is not None:
                self.category_acceptance_rate.labels(*self._l(category)).set(rate)


def _histogram(bounds: tuple[float, ...]) -> dict:
    return {"upper_bounds": list(bounds), "counts": [0] * len(bounds), "count": 0, "sum": 0.0}
