"""Where a command's CPU went, by process, however briefly each lived: runs the command with the
kernel's process accounting on (acct(2): one record per process at its exit, its CPU included),
names each record from the command lines seen under /proc while it ran, and prints the CPU by
program. A sampler of /proc alone misses what lives less than its period (compilers, kubectl,
helm) and what was already gone; the kernel's records miss nothing that exits.

    sudo python bench/cpu_by_process.py [--out DIR] [--top N] -- bash .ci/run

Needs root (CAP_SYS_PACCT) and one command at a time per machine: the kernel keeps one
accounting file. Records are acct_v3 (Linux); CPU is in the kernel's AHZ ticks (100 a second).

Figures: docs/testing.md, "Where the CPU goes, by process" (2026-11-27; a run's output is
the table it prints).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RECORD = struct.Struct("<BBHIIIIIIfHHHHHHHH16s")    # struct acct_v3, 64 bytes
AHZ = 100
# How often the command lines are read. Each look reads every process's; at 0.25 s the watcher
# itself took 46 CPU-s of a 30-minute `.ci/run` (1.5%). A process that lives less than this is
# named by its command name alone, which the kernel's record holds anyway.
SAMPLE_S = 1.0


def comp_t(value: int) -> int:
    """The kernel's 16-bit float: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


def read_records(path: Path) -> list[dict]:
    data = path.read_bytes()
    out = []
    for offset in range(0, len(data) - RECORD.size + 1, RECORD.size):
        f = RECORD.unpack_from(data, offset)
        if f[1] != 3:
            raise ValueError(f"{path}: record {offset // RECORD.size} is acct version {f[1]}, not 3")
        out.append({"pid": f[6], "ppid": f[7], "comm": f[18].split(b"\0")[0].decode(errors="replace"),
                    "seconds": f[9] / AHZ, "cpu": (comp_t(f[10]) + comp_t(f[11])) / AHZ})
    return out


def program(record: dict, argv: str) -> str:
    """A name to sum by: the command name, and for an interpreter the words that say what it
    ran (`python -m mlflow server`), paths of a run's temporary folders left out."""
    comm = record["comm"]
    words = argv.split()
    if comm.startswith("python") and words:
        kept = [w for w in words[1:5] if not w.startswith("/tmp")]
        return " ".join([comm, *kept])[:80]
    return comm


def report(records: list[dict], argvs: dict[str, str], top: int) -> str:
    by: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for r in records:
        row = by[program(r, argvs.get(str(r["pid"]), ""))]
        row[0] += 1
        row[1] += r["cpu"]
    total = sum(r["cpu"] for r in records)
    short = [r for r in records if r["seconds"] < 1.0]
    lines = [f"{len(records)} processes, {total:.1f} CPU-s; {len(short)} lived under 1 s "
             f"({sum(r['cpu'] for r in short):.1f} CPU-s)", f"{'CPU-s':>8} {'procs':>6}  program"]
    for name, (count, cpu) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"{cpu:8.1f} {count:6d}  {name}")
    return "\n".join(lines)


def _watch_argvs(argvs: dict[str, str], stop: threading.Event) -> None:
    """pid -> its last non-empty command line (an exec changes it; a zombie's is empty)."""
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            if argv:
                argvs[pid] = argv[:400]
        stop.wait(SAMPLE_S)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--" not in args:
        print("usage: cpu_by_process.py [--out DIR] [--top N] -- COMMAND...", file=sys.stderr)
        return 2
    split = args.index("--")
    ap = argparse.ArgumentParser(prog="cpu_by_process.py")
    ap.add_argument("--out", help="keep the records here (pacct, argvs.json); default a temporary folder")
    ap.add_argument("--top", type=int, default=40)
    opts = ap.parse_args(args[:split])
    command = args[split + 1:]
    if not command:
        print("no command after --", file=sys.stderr)
        return 2
    out = Path(opts.out or tempfile.mkdtemp(prefix="cpu-by-process-"))
    out.mkdir(parents=True, exist_ok=True)
    pacct = out / "pacct"
    pacct.write_bytes(b"")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(str(pacct).encode()) != 0:
        print(f"acct({pacct}) failed: {os.strerror(ctypes.get_errno())} (root is needed)", file=sys.stderr)
        return 2
    argvs: dict[str, str] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_argvs, args=(argvs, stop), daemon=True)
    watcher.start()
    try:
        code = subprocess.call(command)
    finally:
        time.sleep(2 * SAMPLE_S)        # the command's last exits reach the file
        libc.acct(None)
        stop.set()
        watcher.join()
        (out / "argvs.json").write_text(json.dumps(argvs))
    print(report(read_records(pacct), argvs, opts.top), file=sys.stderr)
    print(f"records: {out}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
