"""A warm Python for a node's pods: one process that has imported torch once, forked for each
container whose command is `python -m <module>` from the project's virtualenv.

Why: an engine pod on tiny models is ready in ~6 s, nearly all of it imports (torch ~1.8 s,
torch._dynamo ~1.5 s, scipy.optimize ~0.6 s on a 2-core machine), and the test suite starts
some 70 of them; forked, they were ready in 8.6 s where fresh ones took 24.0 s on a loaded
machine (docs/testing.md). A container runtime starting the same image again keeps its layers
in the page cache; this keeps the imported interpreter. Everything the pod's own program does
(argument parsing, transformers, loading the model, serving) still runs in the pod's process
with the pod's environment, working directory and log, in a session of its own, so the node
signals its process group as before.

What must not differ: an imported module may have read the environment while importing. The
fork serves only containers whose environment agrees with the warm interpreter's on every
variable those modules read at import (ENV_READ_AT_IMPORT); any other container is started
with a fresh interpreter, as is every command that is not `python -m`. The modules imported
here (WARM_MODULES) do not read $HOME at import (tests/devcluster/test_warm_python.py scans
them for it); transformers and huggingface_hub do (their cache folders), so each pod imports
those itself.

A fork is safe only from a process with one thread: the warm interpreter checks that it has
one after its imports (torch starts its pools at the first parallel operation, not at import)
and refuses to serve otherwise; the node then starts every container fresh.

`SPECPAIR_DEVCLUSTER_WARM_PYTHON=0` turns it off (every container a fresh interpreter).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import re
import runpy
import selectors
import shutil
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import types
from pathlib import Path

# Not grpc: its core keeps fork handlers of its own; it imports in ~0.1 s anyway.
WARM_MODULES = ("torch", "torch._dynamo", "scipy.optimize", "numpy")
# Variables the warm modules may read while importing (library settings, thread counts, paths
# searched for shared objects, the locale): a container whose values differ starts fresh.
ENV_READ_AT_IMPORT = re.compile(
    r"^(PYTHON\w*|TORCH\w*|PYTORCH\w*|OMP_\w+|MKL_\w+|KMP_\w+|OPENBLAS\w*|GOTO\w*|CUDA\w*|NVIDIA\w*|"
    r"TRITON\w*|LD_\w+|MALLOC\w*|GLIBC\w*|NUMPY\w*|NPY_\w+|SCIPY\w*|SYMPY\w*|GRPC\w*|"
    r"PROTOCOL_BUFFERS\w*|TMPDIR|TEMP|TMP|LANG|LC_\w+|PATH)$")
ENABLE_ENV = "SPECPAIR_DEVCLUSTER_WARM_PYTHON"
START_SECONDS = 180          # its imports on a loaded 2-core machine take ~5-15 s


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1").lower() not in ("0", "false", "no", "off")


def import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if ENV_READ_AT_IMPORT.match(k)}


# -- the node's side ------------------------------------------------------------------------------


class WarmProcess:
    """A forked container, with the part of subprocess.Popen the node uses (pid, poll, wait).
    Its exit status comes from the warm interpreter, its parent, over the connection that
    asked for it."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket):
        self.args, self.pid, self.returncode = args, pid, None
        self._conn, self._buffer, self._lock = conn, b"", threading.Lock()

    def poll(self) -> int | None:
        return self._read(0)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            code = self._read(left if left is None else min(left, 1.0))
            if code is not None:
                return code
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)

    def _read(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            sel = selectors.DefaultSelector()
            try:
                sel.register(self._conn, selectors.EVENT_READ)
                if not sel.select(timeout):
                    return None
            finally:
                sel.close()
            chunk = self._conn.recv(4096)
            if chunk:
                self._buffer += chunk
                if b"\n" in self._buffer:
                    self.returncode = int(json.loads(self._buffer.split(b"\n", 1)[0])["exit"])
                    self._conn.close()
                return self.returncode
            # The warm interpreter is gone (the node stopped it, or it died): the container
            # lives on, orphaned; its status can only be seen from outside now.
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = -signal.SIGKILL
                self._conn.close()
            else:
                # The closed connection reads at once from now on: without a pause, a wait()
                # with no timeout would spin a core until the orphan exits.
                time.sleep(0.2 if timeout is None else min(timeout, 0.2))
            return self.returncode


class WarmPython:
    """The node's warm interpreter, started at its first use; `spawn` forks a container from
    it, or answers None where the container must start fresh."""

    def __init__(self, python: str, env: dict[str, str], log: Path):
        self.python, self.env, self.log = python, dict(env), log
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._folder: str | None = None
        self.unusable: str | None = None if enabled() else f"{ENABLE_ENV}=0"

    @property
    def _socket(self) -> str:
        return os.path.join(self._folder, "fork.sock")

    def eligible(self, argv: list[str], env: dict[str, str]) -> bool:
        return (len(argv) >= 3 and argv[0] == self.python and argv[1] == "-m"
                and import_env(env) == import_env(self.env))

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, log: Path) -> WarmProcess | None:
        if not self.eligible(argv, env) or not self._started():
            return None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(30)
            conn.connect(self._socket)
            conn.sendall(json.dumps({"argv": argv, "env": env, "cwd": cwd, "log": str(log)}).encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    raise OSError("the warm interpreter closed the connection before forking")
                reply += chunk
            conn.settimeout(None)
            return WarmProcess(argv, int(json.loads(reply)["pid"]), conn)
        except (OSError, ValueError, KeyError) as exc:
            conn.close()
            with self._lock:
                self.unusable = f"fork failed: {exc}"
            return None

    def _started(self) -> bool:
        with self._lock:
            if self.unusable:
                return False
            if self._proc is not None and self._proc.poll() is None:
                return True
            if self._proc is not None:
                self.unusable = f"it exited ({self._proc.returncode}); see {self.log}"
                return False
            # A short folder of its own (0700): a socket's path must fit 108 bytes.
            self._folder = tempfile.mkdtemp(prefix="specpair-warm-")
            with open(self.log, "ab") as out:
                self._proc = subprocess.Popen(
                    [self.python, "-c", "from specpair_devcluster.warm_python import serve; serve()",
                     self._socket, str(os.getpid())],
                    stdout=subprocess.PIPE, stderr=out, stdin=subprocess.DEVNULL, env=self.env,
                    cwd=self._folder, start_new_session=True)
            ready = _read_line(self._proc.stdout, START_SECONDS)
            if ready != "ready":
                self.unusable = ready or f"not ready in {START_SECONDS} s; see {self.log}"
                self._proc.kill()
                return False
            return True

    def stop(self) -> None:
        """After the node's containers are stopped: a fork still running is orphaned, as a
        container outlives a kubelet that dies."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
            if self._proc is not None and self._proc.stdout:
                self._proc.stdout.close()
            if self._folder:
                shutil.rmtree(self._folder, ignore_errors=True)


def _read_line(stream, timeout: float) -> str | None:
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            return None
        return stream.readline().decode(errors="replace").strip() or None
    finally:
        sel.close()


# -- the warm interpreter -------------------------------------------------------------------------


def serve() -> None:
    """argv: the socket's path and the node's pid. Imports WARM_MODULES, says `ready` on stdout,
    then forks a container for each request until the node goes."""
    path, node = sys.argv[1], int(sys.argv[2])
    for name in WARM_MODULES:
        __import__(name)
    # What is imported now lives as long as this process: the collector of a fork never looks
    # at it (each look would copy the pages it touches).
    gc.freeze()
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    if threads != 1:
        print(f"refused: {threads} threads after the imports; a fork would copy only one", flush=True)
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.setblocking(False)
    print("ready", flush=True)
    # stdout was the node's pipe for that one line; a container gets its own log.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    request = _fork_loop(listener, node)
    if request is not None:
        _become(request)


def _fork_loop(listener: socket.socket, node: int) -> dict | None:
    """Returns in a forked child only (its request); the warm interpreter itself loops until the
    node is gone. One thread throughout: child exits are polled, not signalled."""
    children: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    while os.getppid() == node:
        for _key, _events in sel.select(timeout=0.05):
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                continue
            if conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)[4:8] != os.getuid().to_bytes(4, sys.byteorder):
                conn.close()        # only the node's user forks containers
                continue
            request = _read_request(conn)
            if request is None:
                conn.close()
                continue
            # The pid is answered once the child leads its own session, as Popen returns once
            # its child has (start_new_session): the node may signal the group at once.
            session_r, session_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(session_r)
                sel.close()
                listener.close()
                conn.close()
                for other in children.values():
                    other.close()
                os.setsid()
                os.write(session_w, b"s")
                os.close(session_w)
                return request
            os.close(session_w)
            os.read(session_r, 1)
            os.close(session_r)
            try:
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            except OSError:
                pass
            children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
    return None


def _read_request(conn: socket.socket) -> dict | None:
    conn.setblocking(True)
    conn.settimeout(10)
    data = b""
    try:
        while not data.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        return json.loads(data)
    except (OSError, ValueError):
        return None


def _become(request: dict) -> None:
    """In the forked child: the container's session, stdio, directory and environment, then its
    module as `python -m` runs it (runpy's own entry for -m), in a fresh __main__. It already
    leads its session (_fork_loop)."""
    stdin = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(stdin, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(stdin)
    os.close(out)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # An interpreter's start reads $HOME into site's and sysconfig's user folders: read the
    # container's (the warm modules read none, tests/devcluster/test_warm_python.py).
    site.USER_BASE = site.USER_SITE = None
    site.getusersitepackages()
    sysconfig._CONFIG_VARS = None
    if hasattr(sysconfig, "_CONFIG_VARS_INITIALIZED"):
        sysconfig._CONFIG_VARS_INITIALIZED = False
    argv = request["argv"]
    sys.argv = ["-m", *argv[3:]]
    sys.path[0] = os.getcwd()       # where `python -m` puts the working directory
    if "numpy" in sys.modules:      # a fresh interpreter seeds numpy's global generator itself
        sys.modules["numpy"].random.seed()
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        runpy._run_module_as_main(argv[2])
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException:       # as the interpreter reports an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    _leave(code)


def _exit_status(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _leave(code: int) -> None:
    """A normal exit's steps but the last: wait for the threads that are not daemons, run the
    atexit functions, flush stdio; then go without tearing every module down. A fresh
    interpreter's teardown after torch takes ~4 s on a loaded 2-core machine; a fork's would
    also copy every page of the warm interpreter whose objects it touches (5-9 s measured)."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
