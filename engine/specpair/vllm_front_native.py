"""The vLLM companion's compiled front (vllm_front.c): built on first use with the system's C
compiler, loaded with ctypes, run in a thread of its own; the Python front where it cannot be.

The C front relays the common request (a plain streamed or whole completion) itself and hands
every other connection, with the bytes read from it, to the Python front
(specpair.vllm_front.FrontConnection), so every rule of the Python front holds. Python gets one
record a relayed request, taken in batches (`take_records`, a few times a second and before
anything reads the counts), and counts it exactly as the Python relay does
(vllm_companion.Companion._count_record).

`SPECPAIR_COMPANION_FRONT`: `python` (the default) or `c` (the compiled front where it builds).
The default stays the Python front until the compiled one has passed a whole CI run: the last
one (2026-12-08, under a demo's load) failed the real-vLLM peer test's drain, whose stream the
companion never counted in flight within 60 s with the compiled front serving; it passed quiet
and the cause is not found yet.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator, NamedTuple

SOURCE = Path(__file__).with_name("vllm_front.c")
FLAGS = ["-O2", "-shared", "-fPIC", "-pthread"]
FRONT_ENV = "SPECPAIR_COMPANION_FRONT"
# The record's fixed part (vllm_front.c's record()): total length, status, flags, category length,
# first event and end (seconds after arrival, -1: none), finals' length.
_RECORD = struct.Struct("<IBBHddI")
# vllm_front.c's statuses, in its order: the companion's Reply.status names.
STATUSES = ("ok", "error", "invalid", "cancelled", "unavailable")
FLAG_FIRST, FLAG_WHOLE, FLAG_DONE = 1, 2, 4

_built: tuple[ctypes.CDLL | None, str | None] | None = None


def wanted() -> bool:
    return os.environ.get(FRONT_ENV, "python").strip().lower() in ("c", "compiled", "1", "on")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specpair" / "front"


def build(source: Path = SOURCE, also: Path | None = None) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None) or (None, why not): compiled once into the first writable of the user's
    cache, the temporary folder and `also` (in a pod, whose root filesystem is read-only: the
    emptyDir of vLLM's socket, where the companion writes its drained marker too), keyed by the
    source's text and the flags. The compiler's own temporary files go there as well."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None, "no C compiler (cc/gcc) on PATH"
    try:
        text = source.read_bytes()
    except OSError as exc:
        return None, f"{source.name}: {exc}"
    key = hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:16]
    last: str | None = None
    folders = [_cache_dir(), Path(tempfile.gettempdir()) / f"specpair-front-{os.getuid()}"]
    if also is not None:
        folders.append(also / "specpair-front")
    for folder in folders:
        out = folder / f"{source.stem}-{key}.so"
        try:
            if not out.exists():
                folder.mkdir(parents=True, exist_ok=True)
                tmp = out.with_suffix(f".{os.getpid()}.tmp")
                proc = subprocess.run([compiler, *FLAGS, str(source), "-o", str(tmp)], capture_output=True,
                                      text=True, timeout=120, env={**os.environ, "TMPDIR": str(folder)})
                if proc.returncode != 0:
                    tmp.unlink(missing_ok=True)
                    return None, f"{compiler} failed: {proc.stderr.strip()[-500:]}"
                os.replace(tmp, out)        # atomic: concurrent first uses never load half a file
            lib = ctypes.CDLL(str(out))
        except (OSError, subprocess.SubprocessError) as exc:
            last = f"{type(exc).__name__}: {exc}"
            continue
        _declare(lib)
        return lib, None
    return None, last


def _declare(lib: ctypes.CDLL) -> None:
    size_p = ctypes.POINTER(ctypes.c_size_t)
    lib.spf_start.restype = ctypes.c_void_p
    lib.spf_start.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
    for name in ("spf_take_records", "spf_take_handovers"):
        getattr(lib, name).restype = ctypes.c_void_p
        getattr(lib, name).argtypes = [ctypes.c_void_p, size_p]
    lib.spf_free.argtypes = [ctypes.c_void_p]
    lib.spf_in_flight.argtypes = [ctypes.c_void_p]
    lib.spf_handover_all.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.spf_stop.argtypes = [ctypes.c_void_p]
    lib.spf_destroy.argtypes = [ctypes.c_void_p]


def library(also: Path | None = None) -> tuple[ctypes.CDLL | None, str | None]:
    """The front's library, built once a process (or why it is not there); `also`: build()'s."""
    global _built
    if _built is None:
        _built = build(also=also)
    return _built


class Record(NamedTuple):
    """One request the C front relayed: as vllm_companion.Reply is filled from it."""
    category: str
    status: str
    first: float | None         # seconds from arrival to the first streamed event
    end: float                  # seconds from arrival to the reply's end
    finals: list[bytes]         # the events naming "usage" or "error" (payloads), or the whole body
    whole: bool                 # `finals` is a whole reply's body
    done: bool                  # the stream's [DONE] passed


def parse_records(data: bytes) -> Iterator[Record]:
    pos, n = 0, len(data)
    while pos < n:
        total, status, flags, cat_len, first, end, finals_len = _RECORD.unpack_from(data, pos)
        at = pos + _RECORD.size
        category = data[at:at + cat_len].decode("ascii")
        raw = data[at + cat_len:at + cat_len + finals_len]
        pos += total
        if flags & FLAG_WHOLE:
            finals = [raw] if raw else []
        else:
            finals, i = [], 0
            while i < len(raw):
                (size,) = struct.unpack_from("<I", raw, i)
                finals.append(raw[i + 4:i + 4 + size])
                i += 4 + size
        yield Record(category, STATUSES[status], first if flags & FLAG_FIRST else None, end, finals,
                     bool(flags & FLAG_WHOLE), bool(flags & FLAG_DONE))


class NativeFront:
    """One compiled front serving `sock` (listening) in its own thread."""

    def __init__(self, lib: ctypes.CDLL, sock, upstream: str, host: bytes, token: str | None):
        self._lib = lib
        self._sock = sock
        # A byte here: connections were handed over (the companion's loop reads it).
        self.notify_r, self._notify_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._handle = lib.spf_start(sock.fileno(), upstream.encode(), host, (token or "").encode(), self._notify_w)
        if not self._handle:
            os.close(self.notify_r)
            os.close(self._notify_w)
            # spf_start's bounds (vllm_front.c's front_t): name the inputs, not only the upstream
            raise OSError(f"the compiled front did not start (vLLM at {upstream}, Host {len(host)} bytes, token "
                          f"{len(token or '')} bytes: it takes a socket path under 108, a Host under 160, a token "
                          "under 512, an IPv4 address)")

    def _take(self, fn) -> bytes:
        n = ctypes.c_size_t(0)
        ptr = fn(self._handle, ctypes.byref(n))
        if not ptr:
            return b""
        try:
            return ctypes.string_at(ptr, n.value)
        finally:
            self._lib.spf_free(ptr)

    def take_records(self) -> list[Record]:
        if not self._handle:
            return []
        return list(parse_records(self._take(self._lib.spf_take_records)))

    def take_handovers(self) -> list[tuple[int, bytes]]:
        """(fd, bytes read from it) of each connection handed to the Python front: it owns them now."""
        handed = []
        try:
            os.read(self.notify_r, 4096)
        except BlockingIOError:
            pass
        data = self._take(self._lib.spf_take_handovers) if self._handle else b""
        pos = 0
        while pos < len(data):
            fd, size = struct.unpack_from("<II", data, pos)
            handed.append((fd, data[pos + 8:pos + 8 + size]))
            pos += 8 + size
        return handed

    def in_flight(self) -> int:
        return self._lib.spf_in_flight(self._handle) if self._handle else 0

    def handover_all(self, on: bool) -> None:
        if self._handle:
            self._lib.spf_handover_all(self._handle, int(on))

    def stop(self) -> list[Record]:
        """Stops the thread (its connections closed) and returns the records not yet taken."""
        if not self._handle:
            return []
        self._lib.spf_stop(self._handle)
        records = self.take_records()
        for fd, _ in self.take_handovers():
            os.close(fd)
        self._lib.spf_destroy(self._handle)
        self._handle = None
        os.close(self.notify_r)
        os.close(self._notify_w)
        self._sock.close()
        return records
