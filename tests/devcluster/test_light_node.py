"""A node holding hundreds of idle pods (bench/operator_scale.py's 1,000 pairs): its pods' threads
sleep until a probe is due (NodeSpec.exit_poll_seconds) and its gRPC probes keep their
connection (NodeSpec.probe_connections_kept). At the defaults nothing changes: every sleep is
0.2 s and every probe dials afresh. No cluster here: the sleep is a pure function of the probes'
schedules, and the probes run against a real gRPC health server over loopback."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specpair_devcluster.node_agent import SETTLED_AFTER, NodeSpec, Probe, run_probe, supervise_wait

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def probes(now: float, startup: dict | None = None, readiness: dict | None = None, liveness: dict | None = None):
    made = [Probe(startup, "startup"), Probe(readiness, "readiness"), Probe(liveness, "liveness")]
    for p in made:
        p.next_at = p.look_at = now + p.initial
    return made


def test_at_the_defaults_every_sleep_is_the_old_fifth_of_a_second():
    default = NodeSpec().exit_poll_seconds
    assert default == 0.2
    now = 1000.0
    for started in (False, True):
        for due_in in (-5.0, 0.0, 0.05, 3.0, 60.0):
            s, r, lv = probes(now + due_in, {"periodSeconds": 10}, {"periodSeconds": 5}, {"periodSeconds": 20})
            assert supervise_wait(now, started, s, r, lv, 1.0, default) == pytest.approx(0.2)


def test_a_light_node_sleeps_until_the_next_probe_and_no_longer_than_its_exit_poll():
    now = 1000.0
    # Started, readiness has answered (no first-success looks): asleep until it is due.
    s, r, lv = probes(now, None, {"periodSeconds": 5}, {"periodSeconds": 20})
    assert r.due(now, 1.0) is True
    r.succeeded = True
    assert lv.due(now, None) is True
    assert supervise_wait(now, True, s, r, lv, 1.0, 30.0) == pytest.approx(5.0)
    # Liveness due before readiness: until liveness.
    lv.next_at = now + 2.5
    assert supervise_wait(now, True, s, r, lv, 1.0, 30.0) == pytest.approx(2.5)
    # Never longer than the exit poll, never shorter than 0.2 s.
    assert supervise_wait(now, True, s, r, lv, 1.0, 2.0) == pytest.approx(2.0)
    lv.next_at = now + 0.01
    assert supervise_wait(now, True, s, r, lv, 1.0, 30.0) == pytest.approx(0.2)
    # Readiness not yet answered: its first-success look (every second) comes first.
    s, r, lv = probes(now, None, {"periodSeconds": 5}, None)
    assert r.due(now, 1.0) is True
    assert supervise_wait(now, True, s, r, lv, 1.0, 30.0) == pytest.approx(1.0)
    # Not started: only the startup probe's schedule counts (readiness and liveness wait for it).
    s, r, lv = probes(now, {"periodSeconds": 10}, {"periodSeconds": 5}, {"periodSeconds": 1})
    assert s.due(now, None) is True
    assert supervise_wait(now, False, s, r, lv, None, 30.0) == pytest.approx(10.0)
    s, r, lv = probes(now, {"periodSeconds": 10}, {"periodSeconds": 5}, {"periodSeconds": 1})
    assert s.due(now, 1.0) is True
    assert supervise_wait(now, False, s, r, lv, 1.0, 30.0) == pytest.approx(1.0)


@pytest.fixture
def health_server():
    """A real gRPC health service on a loopback port; (servicer, port, restart)."""
    made = []

    def start(port: int = 0):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        servicer.set("", SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        made.append(server)
        return server, servicer, bound

    yield start
    for server in made:
        server.stop(0)


def look(port: int, channels: dict | None) -> bool:
    return run_probe({"grpc": {"port": port}}, "127.0.0.1", {}, 5.0, {}, channels)


def test_a_kept_probe_connection_is_reused_while_healthy_and_dropped_on_any_failure(health_server):
    server, servicer, port = health_server()
    channels: dict = {}
    assert look(port, channels)
    kept = channels[("127.0.0.1", port)]
    assert look(port, channels) and look(port, channels)
    assert channels[("127.0.0.1", port)] is kept                     # one connection, not a dial a look
    # Not serving: a failed look, and the connection is let go.
    servicer.set("", NOT_SERVING)
    assert not look(port, channels)
    assert channels == {}
    servicer.set("", SERVING)
    assert look(port, channels)
    kept = channels[("127.0.0.1", port)]
    # The server gone: a failed look drops it; the server back on the same port answers the very
    # next look (a fresh dial, not a kept channel waiting out gRPC's reconnect back-off).
    server.stop(0).wait()
    assert not look(port, channels)
    assert channels == {}
    health_server(port)
    assert look(port, channels)
    assert channels[("127.0.0.1", port)] is not kept


def test_without_kept_connections_nothing_is_kept(health_server):
    _server, servicer, port = health_server()
    assert look(port, None)
    servicer.set("", NOT_SERVING)
    assert not look(port, None)


def test_a_settled_probe_is_looked_at_less_often_until_it_fails_once():
    # NodeSpec.settled_probe_period_seconds: after SETTLED_AFTER successes in a row a readiness
    # probe of period 5 is next due 60 s later; one failure brings its period back, so the
    # failures that follow count at the spec's period towards its threshold.
    now = 1000.0
    r = Probe({"periodSeconds": 5, "failureThreshold": 3}, "readiness", 60.0)
    r.next_at = r.look_at = now
    gaps = []
    for outcome in [True] * (SETTLED_AFTER + 2) + [False] * 3 + [True]:
        assert r.due(now, None) is True
        gaps.append(r.next_at - now)
        r.record(outcome)
        now = r.next_at
    assert gaps == [5.0] * SETTLED_AFTER + [60.0, 60.0, 60.0] + [5.0] * 3
    assert r.failures == 0 and r.successes == 1
    # The same schedule with the setting off (the default), as a kubelet keeps it.
    assert NodeSpec().settled_probe_period_seconds is None
    plain = Probe({"periodSeconds": 5}, "readiness")
    plain.next_at = now
    for _ in range(SETTLED_AFTER + 3):
        plain.record(True)
        assert plain.due(now, None) is True and plain.next_at - now == 5.0
        now = plain.next_at
