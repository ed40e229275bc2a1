"""Many stand-in engine pods served by one process, so a devcluster holds hundreds of pairs.

A stand-in engine of its own (engine_standin.py) is a Python process of ~35 MB per pod: 1,000
pairs would need 35 GB. In the hosted stand-in image, `specpair` is engine_standin_stub.sh: the
pod's process is a shell that writes its command line into a spool folder and waits. This host
process reads the spool, and for each pod serves what engine_standin.py would serve (the same
StandInEngine, the same gRPC API and health service, the control port with mutual TLS) on the
pod's own address; it stops serving when the stub takes its line back (SIGTERM) or its pid is
gone (SIGKILL). The node agent, its probes and the operator see pods that behave as stand-in
engine pods do; only the memory differs. A world's `_crash_versions` are not honoured here (a
crashing pod needs a process of its own): the host says so in its log.

    host = StandinHost(work / "standin-spool", world_file).start()
    register_hosted_standin_image(cluster, world_file, host.spool)
    ...
    host.stop()
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

HERE = Path(__file__).resolve().parent
STUB = HERE / "engine_standin_stub.sh"
SPOOL_ENV = "SPECPAIR_STANDIN_SPOOL"
# How often the spool is read: a pod is served this long at most after its stub starts, well
# inside the node's first readiness look (one second).
POLL_S = 0.2


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def calls_file(spool: Path) -> Path:
    """Where the host keeps the calls its pods were asked, by method: {"GetStats": n, ...}."""
    return spool.parent / "standin-host-calls.json"


def read_calls(spool: Path) -> collections.Counter:
    try:
        return collections.Counter(json.loads(calls_file(spool).read_text()))
    except (OSError, ValueError):
        return collections.Counter()


class CallCounter(grpc.ServerInterceptor):
    """Counts every call by method name (what the operator's probes cost the engines)."""

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()
        self.lock = threading.Lock()

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        with self.lock:
            self.calls[details.method.rsplit("/", 1)[-1]] += 1
        return continuation(details)


class Host:
    """The spool's pods, each a started gRPC server, all on one thread pool."""

    def __init__(self, spool: Path, workers: int = 16):
        import engine_standin   # noqa: F401  (imported here: the host runs it with tests/operator on its path)
        self.spool = spool
        self.executor = futures.ThreadPoolExecutor(max_workers=workers)
        self.served: dict[int, Any] = {}      # stub pid -> its gRPC server
        self.counter = CallCounter()
        self.written: dict[str, int] = {}

    def _start(self, pid: int, argv: list[str]) -> None:
        import engine_standin
        if argv[:2] != ["engine", "serve"]:
            print(f"stub {pid}: only `specpair engine serve` is here, not {argv[:2]}", flush=True)
            self._end(pid)
            return
        args = engine_standin.parse_args(argv)
        if engine_standin.crashes(args):
            print(f"stub {pid}: v{args.version} would crash, which a hosted stand-in cannot show; served",
                  flush=True)
        server = engine_standin.build_server(args, self.executor, (self.counter,))
        server.start()
        self.served[pid] = server
        print(f"stub {pid}: {args.pair} v{args.version} on {args.host}:{args.port}", flush=True)

    def _end(self, pid: int) -> None:
        """The pod's line gone: the stub is asked to exit (a no-op when it is gone already)."""
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass

    def sweep(self) -> None:
        """One read of the spool: new lines served, lines taken back or dead stubs stopped."""
        lines = {}
        for path in self.spool.glob("*.args"):
            try:
                lines[int(path.stem)] = path
            except ValueError:
                continue
        for pid in list(self.served):
            if pid not in lines or not _alive(pid):
                self.served.pop(pid).stop(0)
                if lines.pop(pid, None) is not None:      # killed outright: its line is left behind
                    (self.spool / f"{pid}.args").unlink(missing_ok=True)
                print(f"stub {pid}: stopped serving", flush=True)
        for pid, path in lines.items():
            if pid in self.served:
                continue
            if not _alive(pid):
                path.unlink(missing_ok=True)
                continue
            try:
                argv = [a.decode() for a in path.read_bytes().split(b"\0") if a]
                self._start(pid, argv)
            except Exception as exc:  # noqa: BLE001  (a pod that cannot be served fails, as its process would)
                print(f"stub {pid}: cannot serve {path.read_bytes()!r}: {exc}", flush=True)
                path.unlink(missing_ok=True)
                self._end(pid)

    def write_calls(self) -> None:
        with self.counter.lock:
            calls = dict(self.counter.calls)
        if calls != self.written:
            tmp = calls_file(self.spool).with_suffix(".tmp")
            tmp.write_text(json.dumps(calls))
            tmp.replace(calls_file(self.spool))
            self.written = calls

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.sweep()
            self.write_calls()
            stop.wait(POLL_S)
        for server in self.served.values():
            server.stop(0)


class StandinHost:
    """The host as a process of its own (as a test or benchmark starts it), logging beside its spool."""

    def __init__(self, spool: Path, world_file: Path):
        self.spool, self.world_file = spool, world_file
        self.process: subprocess.Popen | None = None

    def start(self) -> "StandinHost":
        self.spool.mkdir(parents=True, exist_ok=True)
        log = open(self.spool.parent / "standin-host.log", "ab")
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__)), "--spool", str(self.spool)],
            env={**os.environ, "SPECPAIR_STANDIN_WORLD": str(self.world_file)},
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def register_hosted_standin_image(cluster: Any, world_file: Path, spool: Path) -> None:
    """The stand-in engine image (cluster_env.STANDIN_IMAGE) with the stub as its `specpair`:
    engine pods are served by the host reading `spool`; gate Jobs run as in the plain image."""
    from cluster_env import register_standin_image
    register_standin_image(cluster, world_file)
    image = cluster.images.images["specpair/engine-standin"]
    image.programs = {**image.programs, "specpair": ["/bin/sh", str(STUB)]}
    image.env = {**image.env, SPOOL_ENV: str(spool)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spool", type=Path, required=True)
    ap.add_argument("--workers", type=int, default=16)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    host = Host(args.spool, args.workers)
    print(f"stand-in host {os.getpid()} serving the pods of {args.spool}", flush=True)
    host.run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
