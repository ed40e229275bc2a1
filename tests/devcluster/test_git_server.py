"""The loopback git server Flux clones from (specpair_devcluster.git_server), with the real git
client: a clone over smart HTTP (protocol v0 and v2) gets the pushed commit; a push is refused
(the server is read-only)."""

from __future__ import annotations

import subprocess

import pytest

from specpair_devcluster.git_server import LoopbackGitServer

GIT = ("git", "-c", "user.name=specpair-test", "-c", "user.email=test@specpair.invalid")


def git(cwd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*GIT, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("protocol", ["0", "2"])
def test_a_clone_over_smart_http_gets_the_commit_and_a_push_is_refused(tmp_path, protocol):
    work, served = tmp_path / "work", tmp_path / "served"
    assert git(tmp_path, "init", "--quiet", "--initial-branch=main", str(work)).returncode == 0
    (work / "pair.yaml").write_text("kind: SpecModelPair\n")
    assert git(work, "add", "pair.yaml").returncode == 0
    assert git(work, "commit", "--quiet", "-m", "a pair").returncode == 0
    commit = git(work, "rev-parse", "HEAD").stdout.strip()
    assert git(tmp_path, "clone", "--quiet", "--bare", str(work), str(served / "pairs.git")).returncode == 0

    with LoopbackGitServer(served) as server:
        url = server.url("pairs.git")
        clone = git(tmp_path, "-c", f"protocol.version={protocol}", "clone", "--quiet", url, str(tmp_path / "clone"))
        assert clone.returncode == 0, clone.stderr
        assert (tmp_path / "clone" / "pair.yaml").read_text() == "kind: SpecModelPair\n"
        assert git(tmp_path / "clone", "rev-parse", "HEAD").stdout.strip() == commit
        assert "POST /pairs.git/git-upload-pack" in server.requests

        (tmp_path / "clone" / "more.yaml").write_text("x: 1\n")
        git(tmp_path / "clone", "add", "more.yaml")
        git(tmp_path / "clone", "commit", "--quiet", "-m", "more")
        push = git(tmp_path / "clone", "push", "--quiet", url, "main")
        assert push.returncode != 0
        missing = git(tmp_path, "clone", "--quiet", url, str(tmp_path / "again"))
        assert missing.returncode == 0 and not (tmp_path / "again" / "more.yaml").exists()
