"""What a real server exports of live acceptance under the per-row back-off, and of k per batch
size: GetStats' per-request sums (drift's unit, read by the operator's probe) count audited
requests only (costs.RequestAudit), while the Prometheus counters count every draft served; the
k measured per batch size at start-up is a gauge."""

from __future__ import annotations

import asyncio

from specpair.config import SpeculationConfig
from specpair.costs import RequestAudit, RowsDecision

from serving_helpers import client_for, make_engine, wait_for
from test_server_stats import scrape, value


def test_drift_sums_read_audited_requests_and_k_by_rows_is_exported(tiny_pair, start_server, monkeypatch):
    from specpair_operator.clients.engine_probe import GrpcEngineProbe

    monkeypatch.delenv("SPECPAIR_ROW_BACK_OFF", raising=False)
    engine = make_engine(tiny_pair, speculation=SpeculationConfig(k=3, dynamic_k=False, fallback_threshold=0.05))
    engine.speculation_by_rows = [RowsDecision(1, 3, 1.4, True), RowsDecision(2, 1, 1.1, True),
                                  RowsDecision(4, 1, 0.95, False)]
    engine.audit = RequestAudit(0.0)         # none audited: every row may back off
    server = start_server(engine=engine)
    labels = {"pair": "tiny", "version": "1", "engine": "specpair"}
    probe = GrpcEngineProbe()
    with client_for(server) as c:
        unaudited = [c.generate(p, max_new_tokens=16, category="code") for p in ("def foo(x):", "class A:")]
        before = asyncio.run(probe.stats(f"127.0.0.1:{server.port}"))["categories"]["code"]
        engine.audit = RequestAudit(1.0)     # read when a request joins a batch
        audited = [c.generate(p, max_new_tokens=16, category="code") for p in ("for i in range(", "import os")]
    after = asyncio.run(probe.stats(f"127.0.0.1:{server.port}"))["categories"]["code"]
    drafts = [r.last.stats.num_draft_tokens for r in unaudited + audited]
    assert all(d > 0 for d in drafts), drafts
    # The unaudited requests drafted, and are no unit of live acceptance.
    assert (before["requests"], before["drafted"], before["accepted"]) == (0, 0, 0)
    assert after["requests"] == 2
    assert after["drafted"] == sum(r.last.stats.num_draft_tokens for r in audited)
    assert after["accepted"] == sum(r.last.stats.num_accepted_tokens for r in audited)
    # Prometheus counts every draft served.
    cat = dict(labels, category="code")
    assert wait_for(lambda: value(scrape(server), "specpair_num_draft_tokens_total", **cat) == sum(drafts))
    samples = scrape(server)
    assert {rows: value(samples, "specpair_speculation_k_by_rows", rows=rows, **labels)
            for rows in ("1", "2", "4")} == {"1": 3, "2": 1, "4": 0}
