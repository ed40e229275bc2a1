"""A container's processes, found without cgroups: what a devcluster node kills when a container stops.

A container runtime kills a container's cgroup: every process the container made goes, whichever
session it moved to and whoever its parent is now. A devcluster container is a process in a
session of its own, and signalling that session's group missed what left it: vLLM runs in a
session of its own under its pod's supervisor (specpair.vllm_serve), and when the supervisor was
killed vLLM died with it (PR_SET_PDEATHSIG) while its `VLLM::EngineCore` child, now a child of
init, polled at 0.1-0.2 CPU-s a second beside the later tests of a CI run.

Two things stand in for the cgroup here:
- a mark in the environment (`MARK`), which every process inherits across fork and exec (as a
  build server's process-tree killer marks a build's processes): /proc/<pid>/environ shows it for
  every process started by exec from the container, wherever it went afterwards;
- the container's descendants by parent links, read while the container's first process lives: a
  process forked without exec from a container the node forked from its warm python shows that
  interpreter's environment, not the container's.

Processes are signalled through a pidfd opened before the process is checked again, so a pid that
was reused between the look and the signal is never signalled.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Iterable

MARK = "SPECPAIR_DEVCLUSTER_CONTAINER"
PROC = "/proc"

# (pid, start time in clock ticks since boot): a process, not only a number that may be reused.
Process = tuple[int, int]


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a process, or None when it is gone."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields follow its last ')'.
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return fields[0].decode(), int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir(PROC) if name.isdigit()]
    except OSError:
        return []


def _marked_with(pid: int, value: str, prefix: bool) -> bool:
    try:
        with open(f"{PROC}/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:            # gone, or another user's
        return False
    needle = f"{MARK}={value}".encode()
    for entry in environ.split(b"\0"):
        if entry == needle or (prefix and entry.startswith(needle)):
            return True
    return False


def alive(process: Process) -> bool:
    """Whether the process still runs (a zombie has ended: it only waits for its parent to read it)."""
    stat = _stat(process[0])
    return stat is not None and stat[2] == process[1] and stat[0] != "Z"


def marked(value: str, prefix: bool = False) -> list[Process]:
    """Live processes whose environment holds MARK=`value` (or a value starting with it)."""
    found = []
    own = os.getpid()
    for pid in _pids():
        if pid == own or not _marked_with(pid, value, prefix):
            continue
        stat = _stat(pid)
        if stat is not None and stat[0] != "Z":
            found.append((pid, stat[2]))
    return found


def descendants(pid: int) -> list[Process]:
    """The live processes below `pid` by parent links, now."""
    return descendants_of([pid])


def descendants_of(pids: Iterable[int]) -> list[Process]:
    """The live processes below any of `pids` by parent links, now: one read of /proc for all."""
    todo = list(pids)
    if not todo:
        return []
    children: dict[int, list[Process]] = {}
    for other in _pids():
        stat = _stat(other)
        if stat is not None and stat[0] != "Z":
            children.setdefault(stat[1], []).append((other, stat[2]))
    found = []
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def kill(processes: Iterable[Process], sig: int = signal.SIGKILL) -> int:
    """Signal each process that is still the one seen (same pid and start time); returns how many
    were signalled."""
    sent = 0
    for pid, started in processes:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue           # gone
        except (OSError, AttributeError):
            # No pidfds here (Linux before 5.3): the look and the signal a moment apart, as kill(1).
            stat = _stat(pid)
            if stat is not None and stat[2] == started:
                try:
                    os.kill(pid, sig)
                    sent += 1
                except OSError:
                    pass
            continue
        try:
            stat = _stat(pid)   # the pidfd holds whichever process has this pid now: is it ours?
            if stat is None or stat[2] != started:
                continue
            signal.pidfd_send_signal(fd, sig)
            sent += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return sent


def kill_all(value: str, also: Iterable[Process] = (), prefix: bool = False, seconds: float = 30.0) -> list[Process]:
    """SIGKILL every process marked with `value` and each of `also`, again until none is left (a
    process may fork while it is being killed) or `seconds` pass; returns those still alive then."""
    deadline = time.monotonic() + seconds
    also = list(also)
    while True:
        left = [p for p in also if alive(p)] + [p for p in marked(value, prefix) if p not in also]
        if not left or time.monotonic() >= deadline:
            return left
        kill(left)
        time.sleep(0.05)
