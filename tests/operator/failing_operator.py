"""The operator as a child process with failpoints on its writes (failpoints.py), for the tests
that kill it after its writes (test_operator_convergence.py, and the shadow and canary end to
end tests, whose decisions are made under kills)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from cluster_env import HERE, OPERATOR

KILLS_AT_MOST = 60


class FailingOperator:
    """`kopf run -m failpoints` in a child process, its writes logged to one file."""

    def __init__(self, log: Path, spare: tuple[str, ...] = ()):
        self.log = log
        self.spare = spare    # writes never followed by a kill (failpoints.py: SPECPAIR_FAILPOINT_SPARE)

    def start(self, mode: str) -> subprocess.Popen:
        env = {**os.environ, "SPECPAIR_FAILPOINT": mode, "SPECPAIR_FAILPOINT_LOG": str(self.log),
               "SPECPAIR_FAILPOINT_SPARE": ",".join(self.spare),
               "SPECPAIR_RECONCILE_INTERVAL": "1",
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               "SPECPAIR_METRICS_PORT": "0"}  # the test process's own operator may hold that port
        with open(self.log.with_suffix(".log"), "ab") as out:  # every life's log, one after another
            return subprocess.Popen([sys.executable, "-m", "kopf", *OPERATOR[:-2], "-m", "failpoints"], env=env,
                                    stdout=out, stderr=subprocess.STDOUT)

    def writes(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]

    def life(self, mode: str, done: Callable[[], Any], deadline: float) -> int:
        """One operator in `mode` until it exits, `done()` holds or the deadline passes (then it
        is stopped); its exit status."""
        proc = self.start(mode)
        try:
            while proc.poll() is None and not done() and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        return proc.returncode

    def killed_after(self, write: str, timeout: float = 300.0, during: Callable[[], Any] = lambda: None) -> None:
        """One undisturbed operator until it makes `write` (a failpoints.py description's prefix),
        which kills it; `during` (traffic) runs between looks."""
        def never() -> bool:
            during()
            return False
        code = self.life(f"crash-after:{write}", never, time.monotonic() + timeout)
        assert code == 137, f"no {write} within {timeout:.0f}s (exit {code}); writes: {self.writes()[-10:]}"

    def crash_until(self, done: Callable[[], Any], timeout: float = 480.0) -> int:
        """Start, let it make one write and die, again and again, until `done()` holds.
        Returns how many times it was killed."""
        deadline = time.monotonic() + timeout
        kills = 0
        while time.monotonic() < deadline:
            if self.life("crash-after-first-write", done, deadline) == 137:
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
