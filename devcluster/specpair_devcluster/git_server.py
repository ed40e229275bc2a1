"""A git server on loopback for GitOps controllers (Flux's source-controller) to clone from:
git's own smart HTTP server, `git http-backend` (a CGI program), behind a small HTTP server in a
thread of this process, serving the repositories under one folder read-only.

Flux's GitRepository accepts only http(s) and ssh URLs, and its git client (go-git) speaks the
smart protocol only, so neither a file:// URL nor a folder served as static files would do.

    server = LoopbackGitServer(root).start()     # root/<name>.git are bare repositories
    url = server.url("pairs.git")                # http://127.0.0.1:<port>/pairs.git
    server.stop()
"""

from __future__ import annotations

import http.server
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any


class LoopbackGitServer:
    """`git http-backend` over HTTP on 127.0.0.1 for the bare repositories under `root`."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.requests: list[str] = []   # "<method> <path>" of each request served, for tests

    def start(self) -> "LoopbackGitServer":
        git = shutil.which("git")
        if git is None:
            raise RuntimeError("git is not on PATH (the loopback git server runs `git http-backend`)")
        self.root.mkdir(parents=True, exist_ok=True)
        handler = type("Handler", (_Backend,), {"git": git, "root": self.root, "served": self.requests})
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="loopback-git", daemon=True)
        self._thread.start()
        return self

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.server_address[1]

    def url(self, repository: str) -> str:
        return f"http://127.0.0.1:{self.port}/{repository}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "LoopbackGitServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class _Backend(http.server.BaseHTTPRequestHandler):
    """One request: the CGI environment git http-backend reads, its output turned into a response."""

    git: str
    root: Path
    served: list[str]
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._cgi()

    def do_POST(self) -> None:
        self._cgi()

    def _cgi(self) -> None:
        path, _, query = self.path.partition("?")
        body = self._body()
        env = {"GIT_PROJECT_ROOT": str(self.root), "GIT_HTTP_EXPORT_ALL": "1", "PATH_INFO": path,
               "QUERY_STRING": query, "REQUEST_METHOD": self.command, "REMOTE_ADDR": self.client_address[0],
               "CONTENT_TYPE": self.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
               "PATH": "/usr/bin:/bin:/usr/local/bin"}
        for header, variable in (("Content-Encoding", "HTTP_CONTENT_ENCODING"), ("Git-Protocol", "GIT_PROTOCOL")):
            if self.headers.get(header):
                env[variable] = self.headers[header]
        # Read-only: git http-backend refuses pushes from unauthenticated clients unless
        # http.receivepack is set, and nothing here sets it.
        done = subprocess.run([self.git, "http-backend"], input=body, capture_output=True, env=env, timeout=120)
        self.served.append(f"{self.command} {path}")
        head, sep, payload = done.stdout.partition(b"\r\n\r\n")
        if not sep:
            head, sep, payload = done.stdout.partition(b"\n\n")
        if done.returncode != 0 or not sep:
            message = done.stderr.decode(errors="replace").strip() or "git http-backend gave no response"
            self._reply(500, [("Content-Type", "text/plain")], message.encode())
            return
        status, headers = 200, []
        for line in head.decode("latin-1").splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.split()[0])
            else:
                headers.append((name, value.strip()))
        self._reply(status, headers, payload)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _reply(self, status: int, headers: list[tuple[str, str]], payload: bytes) -> None:
        self.send_response(status)
        for name, value in headers:
            if name.lower() != "content-length":
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:   # noqa: A002  (the base class's name)
        pass
