"""Act matches every step: the steps are one closed union (plan/steps.py) that act/carry_out.py
matches once, ending in `assert_never`, so a step without its case is a type error. mypy runs
on it as pyproject.toml's [tool.mypy] says; a copy of the operator with one step added to the
union and no case for it fails the same check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def mypy(*args: str, cwd: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MYPY_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_act_type_checks_with_every_step_matched(tmp_path):
    out = mypy("--config-file", str(REPO / "pyproject.toml"), cwd=REPO, cache=tmp_path / "cache")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success: no issues found in 2 source files" in out.stdout


def test_a_step_without_its_case_in_act_fails_the_type_check(tmp_path):
    root = tmp_path / "operator"
    shutil.copytree(REPO / "operator" / "specpair_operator", root / "specpair_operator",
                    ignore=shutil.ignore_patterns("__pycache__"))
    plan = root / "specpair_operator" / "plan"
    (plan / "unhandled_step.py").write_text(
        "from dataclasses import dataclass\n\n\n@dataclass(frozen=True)\nclass PaintItBlue:\n    shade: str\n")
    steps = plan / "steps.py"
    text = steps.read_text()
    union = "Step = Union[ReleaseStep, ServingStep, StatusStep]"
    assert union in text
    steps.write_text(text.replace(union, "from specpair_operator.plan.unhandled_step import PaintItBlue\n\n"
                                         "Step = Union[ReleaseStep, ServingStep, StatusStep, PaintItBlue]"))
    config = tmp_path / "mypy.ini"   # pyproject's [tool.mypy], for the copy
    config.write_text("[mypy]\nfollow_imports = skip\nignore_missing_imports = True\npython_version = 3.11\n"
                      f"mypy_path = {root}\n[mypy-specpair_operator.*]\nfollow_imports = silent\n")
    files = [str(root / "specpair_operator" / "act" / "carry_out.py"), str(steps)]
    common = ["--config-file", str(config)]
    out = mypy(*common, *files, cwd=tmp_path, cache=tmp_path / "cache")
    assert out.returncode == 1, out.stdout + out.stderr
    assert 'Argument 1 to "assert_never" has incompatible type "PaintItBlue"' in out.stdout, out.stdout

    # The copy itself, without the new step, passes: the failure is the step's, not the copy's.
    steps.write_text(text)
    out = mypy(*common, *files, cwd=tmp_path, cache=tmp_path / "cache")
    assert out.returncode == 0, out.stdout + out.stderr
