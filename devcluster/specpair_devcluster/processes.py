"""Child processes the cluster owns: started in their own process group, logged to a file,
stopped with SIGTERM then SIGKILL, so nothing outlives the cluster."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterable

REPO = Path(__file__).resolve().parents[2]


def built_binaries(script: str, env_var: str, programs: tuple[str, ...]) -> Path:
    """The folder holding `programs` built by scripts/`script`: $`env_var` when set, else what the
    script prints on its last line (it builds on first use and only checks its stamp afterwards)."""
    given = os.environ.get(env_var)
    if given:
        folder = Path(given)
    else:
        path = REPO / "scripts" / script
        done = subprocess.run(["bash", str(path)], stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{path} failed (exit {done.returncode}); its messages are above")
        folder = Path(done.stdout.strip().splitlines()[-1])
    missing = [p for p in programs if not os.access(folder / p, os.X_OK)]
    if missing:
        raise RuntimeError(f"{folder} lacks {', '.join(missing)}; run scripts/{script}")
    return folder


def repo_tool(name: str) -> str:
    """A Kubernetes tool (helm, kubectl) as scripts/install-k8s-tools.sh installs it in the
    repository's .tools/bin, else from PATH."""
    tools = REPO / ".tools" / "bin" / name
    found = str(tools) if tools.exists() else shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} is not installed: run scripts/install-k8s-tools.sh (scripts/demo.sh does)")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tail(path: Path, chars: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class Child:
    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None):
        self.name, self.argv, self.log, self.env, self.cwd = name, argv, log, env, cwd
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=cwd, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the whole process group, SIGKILL after `grace` seconds; returns the exit code."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        # Grandchildren left in the group (a shell's children) go too.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            return self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> int | None:
        """SIGKILL the whole process group at once (a crash, an OOM kill): no draining, no goodbye."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            return None

    def again(self) -> "Child":
        """The same program started anew: its arguments, environment, folder and log (appended)."""
        return Child(self.name, self.argv, self.log, env=self.env, cwd=self.cwd)

    def describe_exit(self) -> str:
        return f"{self.name} exited with {self.proc.returncode}: {tail(self.log, 1500)}"


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether a GET of `url` answers 200: a built binary's readiness or health endpoint, False
    while nothing listens yet (wait_until's predicate)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def first_exit(children: Iterable["Child | None"]) -> str | None:
    """How the first of `children` that has exited ended (None while all run): wait_until's
    abort, so that a start fails with the binary's own words instead of timing out."""
    for child in children:
        if child is not None and not child.alive():
            return child.describe_exit()
    return None


def wait_until(predicate, timeout: float, interval: float = 0.2, what: str = "condition",
               abort=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if abort is not None:
            reason = abort()
            if reason:
                raise RuntimeError(reason)
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
