"""Capture of served traffic (issue 58): a sample of finished requests, token ids only, on disk.

A pair that opts in (spec.learning) keeps, per category, the prompt's token ids and the target's
own reply token ids of a sample of the requests it served, so a drifted category can get a draft
trained on what it is really asked (`specpair distill --from-capture`). The format, the layout and
the rules are docs/learning.md's; this module is their one home: the engine writes with
CaptureWriter, the training reads with read_records, the operator reads the defaults and bounds.
Torch-free: the operator imports it.

The worker hands a finished request to CaptureWriter.offer, which draws the sample and puts it
on a bounded queue without waiting; a thread of its own writes, rotates shards and prunes them
(the cap and the retention), so capture never slows a step. A request that finds the queue full
is dropped and counted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import random
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from specpair.errors import SpecpairError

log = logging.getLogger("specpair.capture")

FORMAT_VERSION = 1

# Defaults and bounds of the settings (the CRD's spec.learning holds the same bounds: a test
# compares them; the operator fills an absent field from here).
DEFAULT_SAMPLE_RATE = 0.1
DEFAULT_PER_CATEGORY_CAP = 20_000
DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600
MAX_PER_CATEGORY_CAP = 10_000_000
MIN_RETENTION_SECONDS = 60
MAX_RETENTION_SECONDS = 366 * 24 * 3600

# A shard is closed (renamed to its complete name) at this many records or this age.
SHARD_RECORDS = 256
SHARD_SECONDS = 60.0
# Retention is also checked this often when no shard closes.
PRUNE_EVERY_SECONDS = 60.0
# Finished requests waiting for the writer; past it a request is dropped, never waited for.
QUEUE_SIZE = 1024

COMPLETE_SUFFIX = ".jsonl"
OPEN_SUFFIX = ".jsonl.open"
_STAMP = "%Y%m%dT%H%M%SZ"
_COMPLETE = re.compile(r"(?P<end>\d{8}T\d{6}Z)-(?P<pod>.+)-(?P<seq>\d+)-n(?P<records>\d+)\.jsonl")
_OPEN = re.compile(r"(?P<start>\d{8}T\d{6}Z)-(?P<pod>.+)-(?P<seq>\d+)\.jsonl\.open")


@dataclass(frozen=True)
class CaptureSettings:
    directory: str
    sample_rate: float = DEFAULT_SAMPLE_RATE
    per_category_cap: int = DEFAULT_PER_CATEGORY_CAP
    retention_seconds: float = DEFAULT_RETENTION_SECONDS
    shard_records: int = SHARD_RECORDS
    shard_seconds: float = SHARD_SECONDS
    queue_size: int = QUEUE_SIZE

    def check(self) -> "CaptureSettings":
        if not self.directory:
            raise SpecpairError("--capture-dir must name a directory")
        if not 0 < self.sample_rate <= 1:
            raise SpecpairError(f"--capture-rate must be in (0, 1], got {self.sample_rate}")
        if not 1 <= self.per_category_cap <= MAX_PER_CATEGORY_CAP:
            raise SpecpairError(f"--capture-cap must be in [1, {MAX_PER_CATEGORY_CAP}], got {self.per_category_cap}")
        if not MIN_RETENTION_SECONDS <= self.retention_seconds <= MAX_RETENTION_SECONDS:
            raise SpecpairError(f"--capture-retention must be in [{MIN_RETENTION_SECONDS}, {MAX_RETENTION_SECONDS}] "
                                f"seconds, got {self.retention_seconds:g}")
        return self


def add_capture_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("capture of served traffic (docs/learning.md; off unless --capture-dir)")
    group.add_argument("--capture-dir", metavar="DIR", default=None,
                       help="keep a sample of finished requests' prompt and reply token ids here")
    group.add_argument("--capture-rate", type=float, default=DEFAULT_SAMPLE_RATE, metavar="R",
                       help=f"share of finished requests kept, in (0, 1] (default {DEFAULT_SAMPLE_RATE})")
    group.add_argument("--capture-cap", type=int, default=DEFAULT_PER_CATEGORY_CAP, metavar="N",
                       help=f"records kept per category, the oldest shards deleted past it "
                            f"(default {DEFAULT_PER_CATEGORY_CAP})")
    group.add_argument("--capture-retention", type=float, default=DEFAULT_RETENTION_SECONDS, metavar="SECONDS",
                       help=f"shards older than this are deleted (default {DEFAULT_RETENTION_SECONDS})")


def capture_settings(args) -> CaptureSettings | None:
    """The settings the serve flags ask for; None (capture off) without --capture-dir."""
    if not args.capture_dir:
        return None
    return CaptureSettings(directory=args.capture_dir, sample_rate=args.capture_rate,
                           per_category_cap=args.capture_cap, retention_seconds=args.capture_retention).check()


# -- names --------------------------------------------------------------------------------------

def category_dirname(category: str) -> str:
    """A category's folder. Categories are [A-Za-z0-9._-]{1,64} (server/requests.py), folder-safe
    but for '.' and '..', written with their dots escaped."""
    return category.replace(".", "%2E") if category in (".", "..") else category


def category_from_dirname(name: str) -> str:
    return name.replace("%2E", ".") if name in ("%2E", "%2E%2E") else name


def _stamp(t: float) -> str:
    return time.strftime(_STAMP, time.gmtime(t))


def _unstamp(s: str) -> float:
    import calendar
    return float(calendar.timegm(time.strptime(s, _STAMP)))


def complete_name(end: float, pod: str, seq: int, records: int) -> str:
    return f"{_stamp(end)}-{pod}-{seq}-n{records}{COMPLETE_SUFFIX}"


def open_name(start: float, pod: str, seq: int) -> str:
    return f"{_stamp(start)}-{pod}-{seq}{OPEN_SUFFIX}"


@dataclass(frozen=True)
class Shard:
    name: str
    time: float           # end (complete) or start (open), Unix seconds, to the second
    records: int          # complete shards only (open: 0, not counted towards the cap)
    complete: bool


def parse_shard(name: str) -> Shard | None:
    """A shard's facts from its name alone; None for a file that is not a shard."""
    m = _COMPLETE.fullmatch(name)
    if m:
        return Shard(name, _unstamp(m["end"]), int(m["records"]), True)
    m = _OPEN.fullmatch(name)
    if m:
        return Shard(name, _unstamp(m["start"]), 0, False)
    return None


def shards_to_delete(shards: list[Shard], *, now: float, cap: int, retention_seconds: float,
                     keep: frozenset[str] = frozenset()) -> list[str]:
    """Which shards of one category to delete (a pure decision): every shard that ended more than
    the retention ago, then the oldest complete shards until the rest hold at most `cap`
    records. `keep`: the shards this pod is writing (never deleted here)."""
    doomed = [s.name for s in shards if s.name not in keep and now - s.time > retention_seconds]
    kept = sorted((s for s in shards if s.complete and s.name not in doomed and s.name not in keep),
                  key=lambda s: (s.time, s.name))
    total = sum(s.records for s in kept)
    for s in kept:
        if total <= cap:
            break
        doomed.append(s.name)
        total -= s.records
    return doomed


# -- reading ------------------------------------------------------------------------------------

@dataclass
class ReadCounts:
    records: int = 0
    skipped: int = 0      # lines that did not parse (a cut write) or were not records


def read_records(directory: str | os.PathLike, category: str,
                 counts: ReadCounts | None = None) -> Iterator[dict]:
    """The records of one category in complete shards, oldest shard first. A line that does not
    parse is skipped (counted in `counts`); a record of another format version is refused."""
    folder = Path(directory) / category_dirname(category)
    counts = counts if counts is not None else ReadCounts()
    if not folder.is_dir():
        return
    shards = sorted((s for s in (parse_shard(p.name) for p in folder.iterdir()) if s and s.complete),
                    key=lambda s: (s.time, s.name))
    for shard in shards:
        try:
            lines = (folder / shard.name).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:     # pruned meanwhile
            continue
        for line in lines:
            try:
                record = json.loads(line)
                ok = isinstance(record, dict) and isinstance(record.get("prompt_ids"), list) \
                    and isinstance(record.get("reply_ids"), list)
            except ValueError:
                ok = False
            if not ok:
                counts.skipped += 1
                continue
            if record.get("v") != FORMAT_VERSION:
                raise SpecpairError(f"{folder / shard.name}: capture format version {record.get('v')!r}, "
                                    f"this reader knows {FORMAT_VERSION}")
            counts.records += 1
            yield record


def categories(directory: str | os.PathLike) -> list[str]:
    """The categories a capture directory holds records of."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(category_from_dirname(p.name) for p in root.iterdir() if p.is_dir())


def complete_records(directory: str | os.PathLike) -> dict[str, int]:
    """Records per category in the complete shards of a capture directory, every pod's (what a
    training Job reads: read_records), from the shards' names alone. GetStats reports it
    (Stats.captured): the operator waits for enough before it starts a training."""
    out: dict[str, int] = {}
    for category in categories(directory):
        folder = Path(directory) / category_dirname(category)
        out[category] = sum(s.records for s in (parse_shard(p.name) for p in folder.iterdir()) if s and s.complete)
    return out


# -- writing ------------------------------------------------------------------------------------

class _OpenShard:
    def __init__(self, folder: Path, start: float, pod: str, seq: int):
        self.folder, self.start, self.pod, self.seq = folder, start, pod, seq
        self.name = open_name(start, pod, seq)
        self.file = open(folder / self.name, "a", encoding="utf-8")
        self.records = 0


class CaptureWriter:
    """Samples finished requests and writes them in a thread of its own (module docstring).

    counted(category, outcome, n): called from the writer thread for each record "written" and
    from offer for each "dropped" (queue full) one; the server counts them in its metric.
    """

    def __init__(self, settings: CaptureSettings, *, release: str, tokenizer: str = "", pod: str | None = None,
                 counted: Callable[[str, str, int], None] | None = None, clock: Callable[[], float] = time.time,
                 rng: random.Random | None = None):
        self.settings = settings
        self.root = Path(settings.directory)
        self.release, self.tokenizer = str(release), tokenizer
        # The pod's name: pods sharing a volume never write one file. '-' is the name's separator
        # only before the sequence number, which the pattern takes from the right.
        self.pod = re.sub(r"[^A-Za-z0-9.-]", "_", pod or os.environ.get("HOSTNAME") or socket.gethostname()) or "engine"
        self.counted = counted or (lambda category, outcome, n: None)
        self.clock = clock
        self.rng = rng or random.Random()
        self._queue: queue.Queue = queue.Queue(maxsize=settings.queue_size)
        self._open: dict[str, _OpenShard] = {}
        self._seq = 0
        self._last_prune = 0.0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.written = 0
        self.dropped = 0

    # Called by the worker thread for every request that finished ok: never blocks.
    def offer(self, category: str, prompt_ids, reply_ids) -> None:
        if self.rng.random() >= self.settings.sample_rate:
            return
        try:
            self._queue.put_nowait((category, list(prompt_ids), list(reply_ids), self.clock()))
        except queue.Full:
            self.counted(category, "dropped", 1)
            self.dropped += 1

    def start(self) -> "CaptureWriter":
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.prune_all()
        except OSError as exc:   # serving never waits on the capture: each write tries again, counted
            log.warning("capture: %s", exc)
        self._thread = threading.Thread(target=self._run, name="specpair-capture", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Write what is queued, close every shard, return."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until what was offered so far is written (tests, stop)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    # -- the writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                item = None
            try:
                if item is not None:
                    self._write(*item)
                self._rotate_due()
                if self.clock() - self._last_prune >= PRUNE_EVERY_SECONDS:
                    self.prune_all()
            except OSError as exc:    # a full or gone volume: serving goes on, the record is lost
                log.warning("capture: %s", exc)
                if item is not None:
                    self.counted(item[0], "dropped", 1)
                    self.dropped += 1
            finally:
                if item is not None:
                    self._queue.task_done()
        for category in list(self._open):
            try:
                self._close(category)
            except OSError as exc:
                log.warning("capture: closing a shard: %s", exc)

    def _write(self, category: str, prompt_ids: list[int], reply_ids: list[int], finished: float) -> None:
        shard = self._open.get(category)
        if shard is None:
            folder = self.root / category_dirname(category)
            folder.mkdir(parents=True, exist_ok=True)
            self._seq += 1
            shard = self._open[category] = _OpenShard(folder, self.clock(), self.pod, self._seq)
        record = {"v": FORMAT_VERSION, "category": category, "prompt_ids": prompt_ids, "reply_ids": reply_ids,
                  "release": self.release, "tokenizer": self.tokenizer, "time": round(finished, 3)}
        shard.file.write(json.dumps(record, separators=(",", ":")) + "\n")
        shard.file.flush()
        shard.records += 1
        self.counted(category, "written", 1)
        self.written += 1       # after the metric: who waits on this finds the metric counted
        if shard.records >= self.settings.shard_records:
            try:
                self._close(category)
            except OSError as exc:   # left as an open shard: readers skip it, the retention removes it
                log.warning("capture: closing a shard: %s", exc)

    def _rotate_due(self) -> None:
        now = self.clock()
        for category, shard in list(self._open.items()):
            if now - shard.start >= self.settings.shard_seconds:
                self._close(category)

    def _close(self, category: str) -> None:
        shard = self._open.pop(category)
        shard.file.close()
        os.replace(shard.folder / shard.name,
                   shard.folder / complete_name(self.clock(), shard.pod, shard.seq, shard.records))
        self.prune(category)

    def prune(self, category: str) -> list[str]:
        """Apply the retention and the cap to one category's folder; returns what it deleted."""
        folder = self.root / category_dirname(category)
        try:
            shards = [s for s in (parse_shard(p.name) for p in folder.iterdir()) if s]
        except FileNotFoundError:
            return []
        keep = frozenset(s.name for s in self._open.values() if s.folder == folder)
        doomed = shards_to_delete(shards, now=self.clock(), cap=self.settings.per_category_cap,
                                  retention_seconds=self.settings.retention_seconds, keep=keep)
        for name in doomed:
            try:
                (folder / name).unlink()
            except FileNotFoundError:    # another pod on the same volume pruned it first
                pass
        return doomed

    def prune_all(self) -> None:
        self._last_prune = self.clock()
        for category in categories(self.root):
            self.prune(category)


# -- deleting a pair's capture ------------------------------------------------------------------

def remove(directory: str | os.PathLike) -> int:
    """Delete a capture directory (a pair's folder) with everything in it; returns the records its
    complete shards held (0 when it was not there). The pair's clean-up Job runs this."""
    import shutil

    root = Path(directory)
    if not root.exists():
        return 0
    held = sum(s.records for c in categories(root) for s in map(parse_shard, (p.name for p in
                                                                              (root / category_dirname(c)).iterdir()))
               if s and s.complete)
    shutil.rmtree(root)
    return held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specpair.capture",
                                     description="Captured traffic (docs/learning.md).")
    commands = parser.add_subparsers(dest="command", required=True)
    rm = commands.add_parser("remove", help="delete a pair's capture folder and everything in it")
    rm.add_argument("directory")
    args = parser.parse_args(argv)
    held = remove(args.directory)
    print(f"removed {args.directory}: {held} records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
