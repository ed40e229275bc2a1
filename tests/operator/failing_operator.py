"""The operator as a child process with failpoints on its writes (failpoints.py), for the tests
that kill it after its writes (test_operator_convergence.py, and the shadow and canary end to
end tests, whose decisions are made under kills).

Each life is `kopf run -m failpoints` in a process of its own, forked from a multiprocessing
fork server that imported Kopf, MLflow and the operator once: a kill ends a real process
(os._exit), and the next life starts in milliseconds instead of the seconds those imports take
(eight to thirteen at a load of ten, tens of lives a test).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from cluster_env import HERE, OPERATOR

KILLS_AT_MOST = 60
# How often a life's `done()` is asked (each look reads the pair and its children from the API
# server); the next life still starts the moment one dies.
LOOK_SECONDS = 0.25
_SERVER = multiprocessing.get_context("forkserver")
_SERVER.set_forkserver_preload(["failpoints", "failing_operator"])


def _ensure_server() -> None:
    """The fork server, started with this folder and tests/ on its path: Python 3.11's fork server
    does not take this process's sys.path, and skips a module it cannot import in silence."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), before or ""])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def _live(env: dict[str, str], log: str) -> None:
    """One operator's life, in the forked process: its environment, its output to `log`, then
    `kopf run` until it is stopped or a failpoint ends it."""
    os.environ.clear()
    os.environ.update(env)
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    import failpoints
    from kopf.cli import main

    failpoints.configure()
    main.main(args=[*OPERATOR[:-2], "-m", "failpoints"], prog_name="kopf", standalone_mode=False)


class _Life:
    """A forked operator, with the Popen methods the tests use."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self.process = process

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return None if self.process.is_alive() else self.process.exitcode

    def terminate(self) -> None:
        self.process.terminate()

    def ended_within(self, seconds: float) -> bool:
        """Waits up to `seconds` for the life to end (at once when it does)."""
        self.process.join(seconds)
        return not self.process.is_alive()

    def wait(self, timeout: float | None = None) -> int | None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        return self.process.exitcode


class FailingOperator:
    """`kopf run -m failpoints` in a child process, its writes logged to one file."""

    def __init__(self, log: Path, spare: tuple[str, ...] = ()):
        self.log = log
        self.spare = spare    # writes never followed by a kill (failpoints.py: SPECPAIR_FAILPOINT_SPARE)

    def start(self, mode: str) -> _Life:
        env = {**os.environ, "SPECPAIR_FAILPOINT": mode, "SPECPAIR_FAILPOINT_LOG": str(self.log),
               "SPECPAIR_FAILPOINT_SPARE": ",".join(self.spare),
               "SPECPAIR_RECONCILE_INTERVAL": "1",
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               "SPECPAIR_METRICS_PORT": "0"}  # the test process's own operator may hold that port
        _ensure_server()
        # Every life's log in one file, one after another.
        life = _SERVER.Process(target=_live, args=(env, str(self.log.with_suffix(".log"))), daemon=True)
        life.start()
        return _Life(life)

    def writes(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]

    def life(self, mode: str, done: Callable[[], Any], deadline: float,
             during: Callable[[], Any] | None = None) -> int:
        """One operator in `mode` until it exits, `done()` holds or the deadline passes (then it
        is stopped); its exit status. `done()` and `during` (a request of traffic) run every
        LOOK_SECONDS; a death is seen at once (the wait between looks ends with the process)."""
        proc = self.start(mode)
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if during is not None:
                    during()
                if proc.poll() is not None or done():
                    break
                proc.ended_within(LOOK_SECONDS)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        return proc.returncode

    def killed_after(self, write: str, timeout: float = 300.0) -> None:
        """One undisturbed operator until it makes `write` (a failpoints.py description's prefix),
        which kills it."""
        code = self.life(f"crash-after:{write}", lambda: False, time.monotonic() + timeout)
        assert code == 137, f"no {write} within {timeout:.0f}s (exit {code}); writes: {self.writes()[-10:]}"

    def crash_until(self, done: Callable[[], Any], timeout: float = 480.0,
                    during: Callable[[], Any] | None = None) -> int:
        """Start, let it make one write and die, again and again, until `done()` holds (`during`
        runs between looks). Returns how many times it was killed."""
        deadline = time.monotonic() + timeout
        kills = 0
        while time.monotonic() < deadline:
            if self.life("crash-after-first-write", done, deadline, during) == 137:
                kills += 1
                assert kills <= KILLS_AT_MOST, "the operator redoes a write every life: it never converges"
            elif done():
                return kills
        raise AssertionError(f"did not converge within {timeout:.0f}s after {kills} kills; writes: {self.writes()[-10:]}")

    def crashed_writes(self, since: int = 0) -> list[str]:
        """The writes a kill followed, in order (from the `since`-th write logged)."""
        return [w["write"] for w in self.writes()[since:] if w["failed"] == "crash"]


def history(obj: dict[str, Any]) -> Counter:
    """(action, toVersion) -> how many times the pair's status.history holds it."""
    return Counter((h["action"], str(h["toVersion"])) for h in (obj.get("status") or {}).get("history") or [])
