"""A stopping engine pod loses no request (issue 57): told to stop, the server fails its readiness at
once (gRPC health NOT_SERVING, /health 503) but still serves new requests for the stop delay, while
Kubernetes endpoints and gateways stop sending to it; only then does it refuse new ones and drain
those in flight (server/app.py). On a real server over 127.0.0.1, gRPC and the OpenAI client."""

import argparse
import threading

import grpc
import pytest
import requests as http_client
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specpair.errors import SpecpairError
from specpair.server.cli import add_engine_parser, server_options

from serving_helpers import client_for, make_engine, openai_client, rpc_error, wait_for

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING
# Long enough that the requests below, sent as the delay begins, are admitted inside it on a
# loaded 2-core machine; the test waits for the phases, it never sleeps for them.
STOP_DELAY = 4.0


def health(server) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def http_health(server) -> tuple[int, dict]:
    reply = http_client.get(f"http://127.0.0.1:{server.http_port}/health", timeout=5)
    return reply.status_code, reply.json()


def test_a_stopping_server_is_unready_but_serves_through_the_stop_delay_then_drains(tiny_pair, start_server):
    server = start_server(engine=make_engine(tiny_pair), http_port=0, stop_delay=STOP_DELAY)
    assert health(server) == SERVING and http_health(server)[0] == 200
    http = openai_client(server)
    with client_for(server) as c:
        stopped: list[dict] = []
        stopper = threading.Thread(target=lambda: stopped.append(server.stop(drain_timeout=10)))
        stopper.start()
        assert wait_for(lambda: server.leaving)
        # Readiness fails first: the kubelet's probe and a gateway's health check see it at once...
        assert health(server) == NOT_SERVING
        code, body = http_health(server)
        assert code == 503 and body["status"] == "leaving" and "still serves" in body["message"]
        # ... while a request still routed here (the endpoints not yet updated) is served.
        assert server.phase == "serving"
        assert c.generate("def foo(x):", max_new_tokens=2, timeout=30).last.usage.completion_tokens == 2
        assert http.completions.create(model="tiny", prompt="import os", max_tokens=2,
                                       temperature=0).usage.completion_tokens == 2
        assert server.phase == "serving", "the stop delay ended before its requests were answered"
        # Then new requests are refused (the drain), with a status clients retry elsewhere on.
        assert wait_for(lambda: server.phase in ("draining", "stopped"), timeout=STOP_DELAY + 10)
        if server.phase == "draining":
            err = rpc_error(lambda: c.generate("import os", max_new_tokens=2, timeout=5))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
        stopper.join(30)
    assert server.phase == "stopped" and stopped == [{"drained": 0, "aborted": 0}]


def test_without_a_stop_delay_the_drain_begins_at_once(tiny_pair, start_server):
    """Outside Kubernetes (the CLI's default, the library's): nothing routes by endpoints."""
    server = start_server(engine=make_engine(tiny_pair))
    assert server.options.stop_delay == 0
    assert server.stop(drain_timeout=5) == {"drained": 0, "aborted": 0}
    assert server.phase == "stopped"


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["engine", "serve", "--insecure", *flags])


def test_the_cli_takes_the_stop_delay_the_operator_writes():
    from specpair_operator.desired.pod_shutdown import shutdown_of

    flags = shutdown_of({"shutdown": {"stopDelaySeconds": 7, "drainSeconds": 40}}).engine_flags()
    options = server_options(serve_args(*flags))
    assert (options.stop_delay, options.drain_timeout) == (7, 40)
    assert server_options(serve_args()).stop_delay == 0
    with pytest.raises(SpecpairError, match="--stop-delay"):
        server_options(serve_args("--stop-delay", "-1"))
