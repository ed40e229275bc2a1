"""The hosted stand-in (engine_standin_host.py): stubs of a megabyte hand their command lines to
one host process, which serves each pod's address as a stand-in engine of its own would, and
stops when the stub is stopped (SIGTERM) or killed (SIGKILL). Real processes, real gRPC."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_standin_host import SPOOL_ENV, STUB, StandinHost, read_calls
from specpair._proto import engine_pb2, engine_pb2_grpc


def _health(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _wait(what: str, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_one_host_serves_many_pods_and_stops_with_their_stubs(tmp_path):
    world = tmp_path / "world.json"
    world.write_text(json.dumps({"good-draft": {"acceptanceRate": 0.7}}))
    host = StandinHost(tmp_path / "spool", world).start()
    # Loopback addresses no devcluster node claims (they take 127.20-249.x.y).
    prefix = f"127.253.{random.randrange(256)}"
    addresses = [f"{prefix}.{i + 1}:50051" for i in range(3)]
    stubs = [subprocess.Popen(["/bin/sh", str(STUB), "engine", "serve", "--host", a.split(":")[0], "--port", "50051",
                               "--pair", f"pair-{i}", "--draft", "good-draft", "--version", "7"],
                              env={**os.environ, SPOOL_ENV: str(host.spool)}, start_new_session=True)
             for i, a in enumerate(addresses)]
    try:
        _wait("every pod served", lambda: all(_health(a) for a in addresses))
        for i, address in enumerate(addresses):
            with grpc.insecure_channel(address) as channel:
                info = engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=5)
            assert (info.pair, info.version) == (f"pair-{i}", "7")
        assert _wait("the calls counted", lambda: read_calls(host.spool)["GetModelInfo"] == 3)
        assert host.process.poll() is None

        stubs[0].send_signal(signal.SIGTERM)
        assert stubs[0].wait(10) == 0
        _wait("the stopped pod no longer served", lambda: not _health(addresses[0]))
        os.killpg(stubs[1].pid, signal.SIGKILL)       # the stub and its sleep, as a node kills a pod
        stubs[1].wait(10)
        _wait("the killed pod no longer served", lambda: not _health(addresses[1]))
        assert _health(addresses[2])
        _wait("the spool holds the running pod's line only", lambda: [p.name for p in host.spool.iterdir()]
              == [f"{stubs[2].pid}.args"])
    finally:
        for stub in stubs:
            if stub.poll() is None:
                os.killpg(stub.pid, signal.SIGKILL)
                stub.wait(10)
        host.stop()
    assert host.process.returncode == 0, (tmp_path / "standin-host.log").read_text()
