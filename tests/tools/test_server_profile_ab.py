"""bench/server_profile_ab.py: py-spy's raw stacks read into the samples each function appears
in (the script's own comparison of two servers needs py-spy and a GPU-sized run; its reading of
the stacks is what can be wrong here)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import server_profile_ab  # noqa: E402


def test_raw_stacks_count_each_function_once_a_stack(tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "_bootstrap (threading.py:1);run (/srv/worker.py:10);step (/srv/decoding.py:20);"
        "step (/srv/decoding.py:25) 7\n"
        # A frame name holding \x1c, which str.splitlines() would split a line at.
        "_bootstrap (threading.py:1);<lambda \x1c> (/srv/admission.py:3) 2\n"
        "process 42:\"python\" 3\n"
        "a line py-spy ends without a count, such as a note about a fallback.\n")
    total, inclusive = server_profile_ab.frames_by_samples(raw)
    assert total == 12
    assert inclusive["_bootstrap (threading.py)"] == 9
    assert inclusive["step (decoding.py)"] == 7           # twice in one stack: counted once
    assert inclusive["run (worker.py)"] == 7
    assert inclusive["<lambda \x1c> (admission.py)"] == 2
    assert inclusive['process 42:"python"'] == 3          # not a frame: kept as written
