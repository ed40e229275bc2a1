"""What the operator and Prometheus read: GetModelInfo, GetStats, SetSpeculation, /metrics."""

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.stats import RequestMoments

from serving_helpers import client_for, failing_engine, make_engine, reference, rpc_error, wait_for


def scrape(server) -> dict:
    """/metrics over HTTP, parsed: {(name, frozenset(labels)): value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples, name, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_model_info_reports_pair_models_tokenizers_and_settings(tiny_pair, start_server):
    target, draft = tiny_pair
    server = start_server(engine=make_engine(tiny_pair), pair="chat-pair", version="7", max_batch_size=6,
                          max_queue=3)
    with client_for(server) as c:
        info = c.model_info()
    assert (info.pair, info.version) == ("chat-pair", "7")
    assert info.target.kind == "model" and info.target.parameters == target.num_parameters
    assert info.draft.kind == "model" and info.draft.parameters == draft.num_parameters
    assert info.target.dtype == "float32" and info.target.device == "cpu"
    engine = server.engine
    assert info.tokenizer.target_fingerprint == engine.target_fingerprint["sha256"]
    assert info.tokenizer.draft_fingerprint == info.tokenizer.target_fingerprint
    assert info.tokenizer.compatible and not info.tokenizer.differences
    assert info.speculation.enabled and info.speculation.k == 4 and info.speculation.max_batch_size == 6
    assert info.context_length == 512 and info.max_queue == 3


def test_mismatched_draft_served_target_only_says_so(tiny_pair, start_server):
    from tiny_models import make_model, make_tokenizer
    target, _ = tiny_pair
    other_tok = make_tokenizer(vocab_size=380)
    other_draft = make_model(other_tok, seed=5)
    engine = SpeculativeEngine(target, draft=other_draft, on_mismatch="target-only")
    server = start_server(engine=engine)
    with client_for(server) as c:
        info = c.model_info()
        reply = c.generate("def foo(x):", max_new_tokens=8)
    assert not info.tokenizer.compatible and info.tokenizer.differences
    assert info.tokenizer.draft_fingerprint and info.tokenizer.draft_fingerprint != info.tokenizer.target_fingerprint
    assert info.warnings and "target-only" in info.warnings[0]
    assert not info.speculation.enabled
    assert reply.last.stats.num_draft_tokens == 0
    assert reply.token_ids == reference(tiny_pair, "def foo(x):", 8).token_ids


def test_stats_and_metrics_move_as_requests_complete(tiny_pair, start_server):
    server = start_server(engine=make_engine(tiny_pair))
    labels = dict(pair="tiny", version="1", engine="specpair")
    before = scrape(server)
    with client_for(server) as c:
        code = c.generate("def foo(x):", max_new_tokens=20, category="code")
        chat = c.generate("hello world", max_new_tokens=12, category="chat")
        err = rpc_error(lambda: c.generate("", max_new_tokens=3, category="code"))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        stats = c.stats()
    # The worker publishes its gauges after the step that sent the last reply: wait for them.
    wait_for(lambda: value(scrape(server), "specpair_num_requests_running", **labels) == 0)
    after = scrape(server)

    # Counters moved by exactly what the replies report.
    for reply, category in ((code, "code"), (chat, "chat")):
        s = reply.last.stats
        cat = dict(labels, category=category)
        assert value(after, "specpair_num_drafts_total", **cat) == s.num_drafts
        assert value(after, "specpair_num_draft_tokens_total", **cat) == s.num_draft_tokens
        assert value(after, "specpair_num_accepted_tokens_total", **cat) == s.num_accepted_tokens
        for pos, accepted in enumerate(s.num_accepted_tokens_per_pos):
            assert value(after, "specpair_num_accepted_tokens_per_pos_total", position=str(pos), **cat) == accepted
        req = dict(cat, protocol="grpc")    # per-request series are labelled by protocol
        assert value(after, "specpair_requests_total", status="ok", **req) == 1
        assert value(after, "specpair_e2e_request_latency_seconds_count", **req) == 1
        assert value(after, "specpair_time_to_first_token_seconds_count", **req) == 1
        assert value(after, "specpair_request_queue_time_seconds_count", **req) == 1
        assert value(after, "specpair_time_per_output_token_seconds_count", **req) == 1
        assert value(after, "specpair_e2e_request_latency_seconds_sum", **req) == \
            pytest.approx(reply.last.timings.total_seconds, rel=1e-6)
    assert value(before, "specpair_requests_total", status="ok", pair="tiny", version="1", engine="specpair",
                 category="code", protocol="grpc") == 0
    assert value(after, "specpair_requests_total", status="invalid", pair="tiny", version="1",
                 engine="specpair", category="general", protocol="grpc") == 1
    assert value(after, "specpair_num_requests_running", **labels) == 0
    assert value(after, "specpair_num_requests_waiting", **labels) == 0
    assert value(after, "specpair_speculation_enabled", **labels) == 1

    # GetStats agrees with the replies, overall and per category.
    drafted = code.last.stats.num_draft_tokens + chat.last.stats.num_draft_tokens
    accepted = code.last.stats.num_accepted_tokens + chat.last.stats.num_accepted_tokens
    assert stats.overall.cumulative.num_draft_tokens == drafted
    assert stats.overall.cumulative.num_accepted_tokens == accepted
    assert stats.overall.requests == 2
    assert stats.overall.window_acceptance_rate == pytest.approx(accepted / drafted)
    assert value(after, "specpair_acceptance_rate", **labels) == pytest.approx(accepted / drafted)
    assert stats.categories["code"].cumulative.num_draft_tokens == code.last.stats.num_draft_tokens
    assert stats.categories["chat"].window_acceptance_rate == pytest.approx(chat.last.stats.acceptance_rate)
    assert value(after, "specpair_category_acceptance_rate", category="chat", **labels) == \
        pytest.approx(chat.last.stats.acceptance_rate)
    assert stats.speculating and not stats.falling_back and (stats.pair, stats.version) == ("tiny", "1")


def test_category_labels_are_capped(tiny_pair, start_server):
    server = start_server(engine=make_engine(tiny_pair))
    server.metrics.max_categories = 2
    with client_for(server) as c:
        for name in ("a", "b", "c", "d"):
            c.generate("hi", max_new_tokens=2, category=name)
    after = scrape(server)
    seen = {dict(k[1]).get("category") for k in after if k[0] == "specpair_requests_total"}
    assert seen == {"a", "b", "other"}


def test_set_speculation_off_on_and_k_override(tiny_pair, start_server):
    server = start_server(engine=make_engine(tiny_pair, speculation=SpeculationConfig(k=4, dynamic_k=False)))
    with client_for(server) as c:
        baseline = c.generate("def foo(x):", max_new_tokens=16)
        assert baseline.last.stats.num_draft_tokens > 0

        settings = c.set_speculation(enabled=False, reason="acceptance drift")
        assert not settings.enabled
        off = c.generate("def foo(x):", max_new_tokens=16)
        assert off.last.stats.num_draft_tokens == 0
        assert off.token_ids == baseline.token_ids
        stats = c.stats()
        assert not stats.speculating and not stats.speculation.enabled
        assert value(scrape(server), "specpair_speculation_enabled", pair="tiny", version="1", engine="specpair") == 0

        settings = c.set_speculation(enabled=True, k=2)
        assert settings.enabled and settings.k_override == 2
        two = c.generate("def foo(x):", max_new_tokens=16)
        assert 0 < len(two.last.stats.num_draft_tokens_per_pos) <= 2
        assert two.token_ids == baseline.token_ids
        assert c.stats().current_k in (0, 1, 2)

        settings = c.set_speculation(k=0)                     # clear the override
        assert not settings.HasField("k_override") and c.model_info().speculation.enabled
        err = rpc_error(lambda: c.set_speculation(k=99))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("k: ")


def test_set_speculation_on_without_a_draft_is_refused(tiny_pair, start_server):
    server = start_server(engine=make_engine(tiny_pair, draft=False))
    with client_for(server) as c:
        err = rpc_error(lambda: c.set_speculation(enabled=True))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_request_moments_keep_each_sum_in_its_own_field():
    """Every field a distinct value, read back by name from the wire message and the probe's report:
    two sums swapped anywhere on the way would show."""
    m = RequestMoments.of_request(7, 3) + RequestMoments.of_request(5, 2) + RequestMoments.of_request(0, 4)
    assert m == RequestMoments(drafted=12, accepted=5, requests=2, drafted_sq=74.0, accepted_sq=13.0,
                               drafted_accepted=31.0)
    msg = m.to_message()
    assert (msg.requests, msg.draft_tokens, msg.accepted_tokens, msg.draft_tokens_sq, msg.accepted_tokens_sq,
            msg.draft_accepted_tokens) == (2, 12, 5, 74.0, 13.0, 31.0)
    assert RequestMoments.from_message(type(msg).FromString(msg.SerializeToString())) == m
    assert m.as_stats() == {"drafted": 12, "accepted": 5, "requests": 2, "draftedSq": 74.0, "acceptedSq": 13.0,
                            "draftedAccepted": 31.0}
    assert RequestMoments.from_stats(m.as_stats()) == m
    assert m - RequestMoments.of_request(5, 2) == RequestMoments.of_request(7, 3)
    tokens_only = RequestMoments(drafted=12, accepted=5)   # what vLLM reports: no sums, no request count
    assert RequestMoments.from_stats(tokens_only.as_stats()) == tokens_only and not (m + tokens_only).has_moments
    with pytest.raises(ValueError):
        tokens_only.to_message()   # the wire has no "unknown"


def test_per_request_sums_reach_the_operator_probe(tiny_pair, start_server):
    """Drift treats the request as the unit (docs/drift.md): the engine exports Σd, Σa, Σd², Σa²,
    Σd·a over finished requests that drafted, and the operator's gRPC probe reads them as such."""
    import asyncio

    from specpair_operator.clients.engine_probe import GrpcEngineProbe

    from specpair.costs import RequestAudit

    engine = make_engine(tiny_pair)
    engine.audit = RequestAudit(1.0)    # every request a unit (which ones are: test_server_audit.py)
    server = start_server(engine=engine)
    with client_for(server) as c:
        replies = [c.generate(p, max_new_tokens=n, category="code")
                   for p, n in (("def foo(x):", 24), ("for i in range(", 9), ("class A:", 16))]
        c.set_speculation(False)
        plain = c.generate("hello world", max_new_tokens=8, category="code")
    per_request = [(r.last.stats.num_draft_tokens, r.last.stats.num_accepted_tokens) for r in replies]
    assert all(d > 0 for d, _ in per_request) and plain.last.stats.num_draft_tokens == 0
    assert len({d for d, _ in per_request}) > 1  # unequal requests, so the sums are not trivial

    stats = asyncio.run(GrpcEngineProbe().stats(f"127.0.0.1:{server.port}"))
    code = stats["categories"]["code"]
    assert code["requests"] == 3  # the request that drafted nothing is no unit of acceptance
    assert code["drafted"] == sum(d for d, _ in per_request)
    assert code["accepted"] == sum(a for _, a in per_request)
    assert code["draftedSq"] == pytest.approx(sum(d * d for d, _ in per_request))
    assert code["acceptedSq"] == pytest.approx(sum(a * a for _, a in per_request))
    assert code["draftedAccepted"] == pytest.approx(sum(d * a for d, a in per_request))


def test_a_request_past_the_kv_budget_is_served_target_only_and_counted(tiny_pair, start_server,
                                                                         monkeypatch):
    """The server's counter follows the engine's memory fallbacks: a budget that holds the row's own
    keys and values but not its drafts' serves it target-only, same text, counted once (the
    contiguous cache's byte budget; the paged pool's blocks: test_engine_paged_draft.py)."""
    monkeypatch.setenv("SPECPAIR_PAGED", "off")
    target, draft = tiny_pair
    prompt, new_tokens = "def foo(x):", 12
    speculation = SpeculationConfig(k=3, dynamic_k=False, fallback_threshold=0)
    probe = SpeculativeEngine(target, draft=draft, speculation=speculation)
    own, drafts = probe.row_memory(len(probe.encode(prompt)), GenerationParams(max_new_tokens=new_tokens))
    assert drafts > 0
    engine = SpeculativeEngine(target, draft=draft, speculation=speculation, kv_budget=f"{own + drafts - 1}B")
    server = start_server(engine=engine)
    labels = {"pair": "tiny", "version": "1", "engine": "specpair"}
    assert value(scrape(server), "specpair_memory_fallback_total", **labels) == 0
    with client_for(server) as c:
        reply = c.generate(prompt, max_new_tokens=new_tokens)
    assert reply.token_ids == reference(tiny_pair, prompt, new_tokens).token_ids
    assert reply.last.stats.num_drafts == 0
    assert wait_for(lambda: value(scrape(server), "specpair_memory_fallback_total", **labels) == 1)


def test_latency_histograms_and_request_outcomes_reach_the_operator_probe(tiny_pair, start_server):
    """The serving-health watch (docs/drift.md#latency-and-errors) reads, per category, the TTFT and
    TPOT histograms /metrics exports (summed over protocols, with their bounds) and the requests
    by status, over real gRPC, through the operator's probe."""
    import asyncio

    from specpair.server.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS
    from specpair_operator.clients.engine_probe import GrpcEngineProbe

    engine = failing_engine(tiny_pair)
    server = start_server(engine=engine)
    with client_for(server) as c:
        replies = [c.generate(p, max_new_tokens=n, category="code")
                   for p, n in (("def foo(x):", 12), ("for i in range(", 6), ("class A:", 1))]
        chat = c.generate("hello world", max_new_tokens=5, category="chat")
        engine.fail_next = True
        assert rpc_error(lambda: c.generate("import os", max_new_tokens=8, category="code")).code() == \
            grpc.StatusCode.INTERNAL
        assert rpc_error(lambda: c.generate("", max_new_tokens=3, category="chat")).code() == \
            grpc.StatusCode.INVALID_ARGUMENT
    wait_for(lambda: value(scrape(server), "specpair_requests_total", pair="tiny", version="1", engine="specpair", category="code",
                           protocol="grpc", status="error") == 1)
    stats = asyncio.run(GrpcEngineProbe().stats(f"127.0.0.1:{server.port}"))
    samples = scrape(server)

    code, chat_serving = stats["serving"]["code"], stats["serving"]["chat"]
    assert code["requests"] == {"ok": 3, "error": 1}
    assert chat_serving["requests"]["ok"] == 1
    assert code["ttft"]["upperBounds"] == list(LATENCY_BUCKETS)
    assert code["tpot"]["upperBounds"] == list(TOKEN_BUCKETS)
    assert code["ttft"]["count"] == 3            # every reply has a first token; the failed one none
    assert code["tpot"]["count"] == 2            # a one-token reply has no time between tokens
    ttfts = [r.last.timings.time_to_first_token_seconds for r in replies]
    assert code["ttft"]["sum"] == pytest.approx(sum(ttfts), rel=1e-6)
    for bound, count in zip(LATENCY_BUCKETS, code["ttft"]["counts"]):
        assert count == sum(t <= bound for t in ttfts)
        assert count == value(samples, "specpair_time_to_first_token_seconds_bucket", pair="tiny", version="1",
                              engine="specpair", category="code", protocol="grpc", le=str(bound))
    counts = code["tpot"]["counts"]
    assert counts == sorted(counts) and counts[-1] <= code["tpot"]["count"]
    # The overall message is the categories' sum (read straight from the reply).
    with client_for(server) as c:
        overall = c.stats().overall.serving
    assert overall.time_to_first_token.count == 4
    assert overall.requests["ok"] == 4 and overall.requests["error"] == 1
    invalid = sum(s["requests"].get("invalid", 0) for s in stats["serving"].values())
    assert invalid == overall.requests["invalid"] == 1

    # The operator's serving-health watch reads the report as counters of requests.
    from specpair_operator.policy import serving_health
    pod = serving_health.serving_pod("engine-0/uid", stats, None)
    code_counts = pod.categories["code"]
    assert (code_counts.finished, code_counts.failed) == (4, 1)
    p95 = code_counts.ttft.quantile(0.95)
    above = min(b for b in LATENCY_BUCKETS if b >= max(ttfts))
    assert p95 is not None and p95 <= above


def test_kv_cache_usage_is_the_share_of_the_budget_the_rows_hold(tiny_pair, start_server):
    """The autoscaling signal kvCacheUsage: while a request runs, the running rows' KV bytes over
    the engine's budget; back to 0 once it finishes; absent for an engine without a budget."""
    import threading

    engine = make_engine(tiny_pair, delay=0.02)
    engine.kv_budget = 64 * 1024 * 1024
    server = start_server(engine=engine)
    labels = dict(pair="tiny", version="1", engine="specpair")
    seen = []

    def usage() -> float:
        return value(scrape(server), "specpair_kv_cache_usage_ratio", **labels)

    with client_for(server) as c:
        reply = threading.Thread(target=lambda: c.generate("def foo(x):", max_new_tokens=60))
        reply.start()
        wait_for(lambda: seen.append(usage()) or seen[-1] > 0, timeout=60)
        reply.join(timeout=30)
    assert 0 < seen[-1] <= 1
    wait_for(lambda: usage() == 0 and server.worker.running == 0)

    unbudgeted = start_server(engine=make_engine(tiny_pair))
    with client_for(unbudgeted) as c:
        c.generate("def foo(x):", max_new_tokens=4)
    assert not any(name == "specpair_kv_cache_usage_ratio" for name, _ in scrape(unbudgeted))


def test_the_operator_probe_keeps_one_connection_per_pod_and_redials_after_a_drop(tiny_pair, start_server):
    """The operator asks every ready pod who it is on every pass: one kept channel per pod, not a
    new connection (and, in a cluster, a mutual-TLS handshake) per call; when the connection
    drops (a pod restarted), the next calls dial again instead of waiting out gRPC's backoff.
    Connections are counted by a TCP relay between the probe and the real server."""
    import asyncio

    from specpair_operator.clients.engine_probe import EngineUnreachable, GrpcEngineProbe

    server = start_server(engine=make_engine(tiny_pair))

    async def scenario() -> tuple[int, int]:
        accepted, open_pairs = [], []

        async def relay(reader, writer):
            accepted.append(writer)
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", server.port)
            open_pairs.append((writer, up_writer))

            async def pump(src, dst):
                try:
                    while data := await src.read(65536):
                        dst.write(data)
                        await dst.drain()
                except (ConnectionError, OSError):
                    pass
                finally:
                    dst.close()
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

        front = await asyncio.start_server(relay, "127.0.0.1", 0)
        address = f"127.0.0.1:{front.sockets[0].getsockname()[1]}"
        probe = GrpcEngineProbe(timeout_s=5)
        for _ in range(3):
            assert (await probe.model_info(address))["pair"] == "tiny"
        await probe.stats(address)
        kept = len(accepted)
        for a, b in open_pairs:         # the connection drops, as when a pod restarts
            a.transport.abort()
            b.transport.abort()
        answered = None
        for attempt in range(3):
            try:
                answered = (await probe.model_info(address))["pair"]
                break
            except EngineUnreachable:
                continue
        assert answered == "tiny", "no answer within 3 calls after the connection dropped"
        await probe.close()
        front.close()
        return kept, len(accepted)

    kept, total = asyncio.run(scenario())
    assert kept == 1                    # four calls, one connection
    assert total == 2                   # and one more after the drop
