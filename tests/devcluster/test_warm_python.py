"""The node's warm python (specpair_devcluster/warm_python.py): a `python -m` container forked
from an interpreter that imported torch once runs as a fresh one would (its argv, environment,
folder, log, session, exit status, atexit functions, its own random numbers), and a container
it cannot serve exactly is left to a fresh interpreter."""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest
from waiting import wait_until

from devcluster_images import TEST_PYTHON_IMAGE
from specpair_devcluster.warm_python import ENABLE_ENV, WarmProcess, WarmPython

PROBE = '''
import atexit, json, os, sys, warnings
from pathlib import Path
import numpy
warnings.simplefilter("ignore")     # reading deprecated module attributes
warm_home = sys.argv[2]
leaks = []
for module in [m for m in list(sys.modules.values()) if m.__name__ not in ("sys", "__main__")]:
    for name, value in list(getattr(module, "__dict__", {}).items()):
        values = value if isinstance(value, (list, tuple, set, frozenset)) else \\
            list(value.values()) if isinstance(value, dict) else [value]
        leaks += [f"{module.__name__}.{name}" for v in values if isinstance(v, str) and warm_home in v]
atexit.register(lambda: Path("atexit-ran").write_text(sys.argv[1]))
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "home": os.environ["HOME"],
                  "own": os.environ.get("OWN"), "session_leader": os.getsid(0) == os.getpid(),
                  "warm": "torch._dynamo" in sys.modules, "draw": numpy.random.randint(2**31),
                  "leaks": leaks}), flush=True)
what = sys.argv[1]
if what == "raise":
    raise RuntimeError("the probe raised")
if what == "wait":
    import time
    time.sleep(120)
sys.exit(int(what) if what.isdigit() else what)
'''


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("warm")
    (folder / "warm_probe.py").write_text(PROBE)
    base = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
    home = folder / f"warm-home-{uuid.uuid4().hex[:8]}"
    home.mkdir()
    interpreter = WarmPython(sys.executable, {**base, "HOME": str(home)}, folder / "warm.log")
    yield interpreter, folder, base, home
    interpreter.stop()


def run_probe(warm, what: str, **env: str) -> tuple[WarmProcess, dict, str]:
    interpreter, folder, base, home = warm
    cwd = folder / f"pod-{uuid.uuid4().hex[:6]}"
    cwd.mkdir()
    (cwd / "warm_probe.py").write_text(PROBE)
    log = cwd / "main.log"
    proc = interpreter.spawn([sys.executable, "-m", "warm_probe", what, str(home)],
                             {**base, "HOME": str(cwd / "home"), **env}, str(cwd), log)
    assert isinstance(proc, WarmProcess), interpreter.unusable
    if what == "wait":
        wait_until("the probe to print", lambda: log.exists() and log.read_text().startswith("{"))
    else:
        proc.wait(60)
    return proc, json.loads(log.read_text().splitlines()[0]), str(cwd)


def test_a_forked_container_runs_as_a_fresh_interpreter_would(warm):
    proc, seen, cwd = run_probe(warm, "3", OWN="pod-value")
    assert proc.returncode == 3
    assert seen["argv"][0] == "3" and seen["cwd"] == cwd and seen["home"] == f"{cwd}/home"
    assert seen["own"] == "pod-value" and seen["session_leader"] and seen["warm"]
    assert Path(cwd, "atexit-ran").read_text() == "3"
    # Nothing the warm modules keep names the warm interpreter's $HOME: they did not read it.
    assert seen["leaks"] == [], seen["leaks"]
    other, again, _ = run_probe(warm, "0")
    assert other.returncode == 0 and again["draw"] != seen["draw"]    # numpy reseeded per container


def test_exit_statuses_are_the_interpreters(warm):
    proc, _seen, cwd = run_probe(warm, "raise")
    assert proc.returncode == 1 and "RuntimeError: the probe raised" in Path(cwd, "main.log").read_text()
    proc, _seen, cwd = run_probe(warm, "bye")
    assert proc.returncode == 1 and Path(cwd, "main.log").read_text().rstrip().endswith("bye")
    proc, _seen, _cwd = run_probe(warm, "wait")
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGTERM)      # the node stops a container's process group
    assert proc.wait(10) == -signal.SIGTERM


def test_what_it_cannot_serve_exactly_starts_fresh(warm, monkeypatch, tmp_path):
    interpreter, folder, base, _home = warm
    log = tmp_path / "log"
    # A variable the warm modules read at import, set otherwise: torch would not see it.
    assert interpreter.spawn([sys.executable, "-m", "warm_probe", "0"], {**base, "OMP_NUM_THREADS": "2"},
                             str(folder), log) is None
    assert interpreter.spawn([sys.executable, "-c", "pass"], base, str(folder), log) is None
    assert interpreter.spawn(["/usr/bin/env", "-m", "warm_probe"], base, str(folder), log) is None
    monkeypatch.setenv(ENABLE_ENV, "0")
    off = WarmPython(sys.executable, base, tmp_path / "off.log")
    assert off.spawn([sys.executable, "-m", "warm_probe", "0"], base, str(folder), log) is None
    assert off.unusable == f"{ENABLE_ENV}=0"


def test_a_pods_python_module_is_forked_on_a_node(devcluster):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    devcluster.ensure_namespace(ns)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "calendar", "namespace": ns},
           "spec": {"restartPolicy": "Never", "containers": [
               {"name": "main", "image": TEST_PYTHON_IMAGE, "command": ["python", "-m", "calendar", "2026", "11"]}]}}
    devcluster.kube.create(pod)
    done = wait_until("the pod to succeed", lambda: (p := devcluster.kube.get("v1", "Pod", ns, "calendar"))
                      and p["status"].get("phase") == "Succeeded" and p, timeout=120)
    assert done["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    assert "November 2026" in devcluster.pod_log(ns, "calendar")
    started = [e["message"] for e in devcluster.kube.list("v1", "Event", ns)
               if e.get("reason") == "Started" and e["involvedObject"]["name"] == "calendar"]
    assert started and "forked from the node's warm python" in started[0], started
    devcluster.kube.delete("v1", "Namespace", None, ns)
