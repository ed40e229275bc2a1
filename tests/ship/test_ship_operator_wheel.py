"""The operator image's install, reproduced without Docker: build the repository's wheel, install
the image's hash-locked dependencies (deploy/requirements/operator.txt) and the wheel with the
`operator` extra into a fresh venv that has no torch, and run what the chart runs.

Slowest ship test (downloads the locked wheels; pip's own cache is reused).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from ship_helpers import NON_DEFAULT_VALUES, REPO_ROOT, run

# What the wheel is built from, exactly as deploy/operator.Dockerfile copies it.
BUILD_INPUTS = ["pyproject.toml", "README.md", "engine", "operator"]


@pytest.fixture(scope="module")
def operator_venv(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("operator-wheel")
    source = work / "src"
    source.mkdir()
    for name in BUILD_INPUTS:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif path.exists():
            shutil.copy2(path, source / name)
    # No build isolation: the test venv's setuptools builds it, so no index round trip for it.
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
         "--wheel-dir", work / "dist", source], timeout=120)
    (wheel,) = (work / "dist").glob("specpair-*.whl")
    venv = work / "venv"
    run([sys.executable, "-m", "venv", venv])
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip = [venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-compile"]
    # As deploy/operator.Dockerfile does: the hash-locked dependencies, nothing resolved, then the
    # wheel with --no-index (it installs only if the lock satisfies its `operator` extra).
    run(pip + ["--require-hashes", "--no-deps", "--requirement", REPO_ROOT / "deploy" / "requirements" / "operator.txt"],
        timeout=300, env=env)
    run(pip + ["--no-index", f"{wheel}[operator]"], timeout=120, env=env)
    run([venv / "bin" / "python", "-m", "pip", "check"], env=env)
    return venv


def _python(venv: Path, code: str) -> str:
    # -I: isolated, so neither the repo checkout nor PYTHONPATH can leak modules in.
    return run([venv / "bin" / "python", "-I", "-c", code], cwd=venv).stdout


def test_torch_is_not_installed(operator_venv):
    assert _python(operator_venv, "import importlib.util; print(importlib.util.find_spec('torch'))").strip() == "None"


def test_the_mlflow_client_is_mlflow_skinny(operator_venv):
    """The operator imports MlflowClient, mlflow.entities and mlflow.exceptions: mlflow-skinny
    has them all, and the full mlflow (server, pandas, pyarrow, scipy) is not installed."""
    code = ("import importlib.metadata as m, importlib.util as u\n"
            "import specpair_operator.handlers, specpair_operator.clients.registry\n"
            "from mlflow import MlflowClient; from mlflow.entities import Metric\n"
            "from mlflow.exceptions import MlflowException, RestException\n"
            "def has(d):\n"
            "    try: m.version(d); return True\n"
            "    except m.PackageNotFoundError: return False\n"
            "print(has('mlflow-skinny'), [d for d in ('mlflow', 'pandas', 'pyarrow', 'scipy') if has(d)])")
    assert _python(operator_venv, code).strip() == "True []"


def test_entry_point_help_runs(operator_venv):
    result = run([operator_venv / "bin" / "python", "-I", "-m", "specpair_operator", "--help"], cwd=operator_venv)
    assert "usage:" in result.stdout


def test_every_flag_the_chart_passes_is_accepted(operator_venv, render):
    """The chart's args (all options switched on) are flags the installed entry point knows."""
    help_text = run([operator_venv / "bin" / "python", "-I", "-m", "specpair_operator", "--help"],
                    cwd=operator_venv).stdout
    for values in (None, NON_DEFAULT_VALUES):
        (deployment,) = [m for m in render(values) if m["kind"] == "Deployment"]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["python", "-m", "specpair_operator"]
        for arg in container["args"]:
            flag = re.match(r"--?[A-Za-z][-\w]*", arg)
            assert flag and flag.group(0) in help_text, f"chart passes {arg!r}; --help lists no such flag"


def test_handlers_import_and_register_for_the_crd_without_torch(operator_venv):
    """Importing the handlers (what `python -m specpair_operator` does) registers handlers for the
    resource the shipped CRD defines, and pulls in no torch."""
    crd = yaml.safe_load((REPO_ROOT / "crds" / "specmodelpair.yaml").read_text())["spec"]
    version = next(v["name"] for v in crd["versions"] if v.get("storage"))
    out = _python(operator_venv, f"""
import sys
import kopf
import specpair_operator.handlers
assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))
resource = kopf.Resource({crd['group']!r}, {version!r}, {crd['names']['plural']!r},
                         kind={crd['names']['kind']!r}, namespaced=True)
registry = kopf.get_default_registry()
print(sum(1 for h in registry._changing.get_all_handlers() if h.selector and h.selector.check(resource)))
""")
    assert int(out.strip()) >= 1, "no Kopf change handler matches the CRD's resource"


def _dockerfile(name: str) -> str:
    return (REPO_ROOT / "deploy" / name).read_text()


@pytest.mark.parametrize("image,extra", [("operator", "operator"), ("engine", "engine")])
def test_dockerfiles_install_what_this_test_installs(image, extra):
    """No Docker engine here: check the Dockerfiles copy the same inputs, let them through their
    .dockerignore, install the wheel with the right extra, and run as the non-root UID."""
    text = _dockerfile(f"{image}.Dockerfile")
    copied = [part for line in re.findall(r"^COPY (?!--from)(.+)$", text, flags=re.M)
              for part in line.split()[:-1]]
    lock = {"operator": "deploy/requirements/operator.txt", "engine": "deploy/requirements/"}[image]
    assert sorted(copied) == sorted(BUILD_INPUTS + [lock])
    ignore = _dockerfile(f"{image}.Dockerfile.dockerignore").splitlines()
    assert ignore[ignore.index("*")] == "*"
    for name in BUILD_INPUTS + ["deploy/requirements"]:
        assert f"!{name}" in ignore or f"!{name}/" in ignore, name
    assert "--require-hashes --no-deps --requirement" in text
    assert re.search(rf'pip install --no-cache-dir --no-index "\$\(ls /wheels/specpair-\*\.whl\)\[{extra}\]"', text)
    assert "USER 10001:10001" in text
    if image == "operator":
        instructions = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        assert "torch" not in instructions
        assert 'ENTRYPOINT ["python", "-m", "specpair_operator"]' in text
