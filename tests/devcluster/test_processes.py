"""The helpers every built binary's start shares (devcluster/processes.py): a readiness GET,
and the first child that exited, which fails a start with the binary's own words. Against real
child processes: a Python HTTP server and a command that exits at once."""

from __future__ import annotations

import sys

import pytest
from specpair_devcluster.processes import Child, first_exit, free_port, http_ok, wait_until


def test_http_ok_is_false_until_a_server_answers_200_and_false_for_another_status(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    assert not http_ok(url + "/")                      # nothing listens yet
    (tmp_path / "ready").write_text("yes")
    server = Child("http", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                            "--directory", str(tmp_path)], tmp_path / "http.log")
    try:
        wait_until(lambda: http_ok(url + "/ready"), 30, what="the HTTP server", abort=lambda: first_exit([server]))
        assert not http_ok(url + "/missing")           # a 404 is not ready
        assert first_exit([server, None]) is None      # it runs; an absent child is passed over
    finally:
        server.stop()


def test_first_exit_names_the_child_that_ended_with_its_code_and_log(tmp_path):
    runs = Child("runs", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "runs.log")
    ends = Child("ends", [sys.executable, "-c", "print('cannot bind'); raise SystemExit(3)"], tmp_path / "ends.log")
    try:
        wait_until(lambda: not ends.alive(), 30, what="the child to exit")
        why = first_exit([runs, ends])
        assert why is not None and why.startswith("ends exited with 3") and "cannot bind" in why, why
        with pytest.raises(RuntimeError, match="ends exited with 3"):
            wait_until(lambda: False, 30, abort=lambda: first_exit([runs, ends]))
    finally:
        runs.stop()
