"""How the CPU kernels' OpenMP threads wait between parallel regions, for a serving process.

A step of the CPU's C layer is ~150 parallel regions (five a layer); between two of them, and
between steps while Python runs, the team's other thread waits. GNU OpenMP's default wait (no
OMP_WAIT_POLICY) spins 300,000 rounds first, about a millisecond or more here, holding its core.
Where other work shares the cores (the HTTP front, a client, other pods on a node, CI's
workers), the spinning thread burns the share that the thread it waits for needed, so each region
waits longer still. The same work (a 513-token prefill, 15 rows joining, 10 steps of 16 rows,
SmolLM2, 2 cores, load 13-18, alternated) took 15.4-18.9 CPU s and 63-76 s wall with the
default, 2.8 CPU s and 8.4-14.5 s with OMP_WAIT_POLICY=passive, 3.0-3.1 CPU s and 9.1-9.9 s
with GOMP_SPINCOUNT=2000 (docs/measurements/2026-12-07c-startup-rows-and-openmp-wait-cpu.md).
2,000 rounds (tens of microseconds) still cover the gaps inside a layer call, where the next
region follows at once, and a thread sleeps through the gaps Python makes between steps.

libgomp reads these variables once, when it loads (with torch): `serving_wait_default` must
run before torch is imported, and leaves any wait the process was given alone.
"""

from __future__ import annotations

import os
import sys
from typing import MutableMapping

SPIN_COUNT_ENV = "GOMP_SPINCOUNT"
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
SERVING_SPIN_COUNT = "2000"


def serving_wait_default(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Give this process SERVING_SPIN_COUNT where neither variable is set (one set by the user,
    the pod spec or a benchmark wins). -> what was set ({} where nothing was)."""
    if SPIN_COUNT_ENV in environ or WAIT_POLICY_ENV in environ:
        return {}
    environ[SPIN_COUNT_ENV] = SERVING_SPIN_COUNT
    return {SPIN_COUNT_ENV: SERVING_SPIN_COUNT}


def torch_loaded() -> bool:
    """Whether torch (and its OpenMP runtime) is loaded already: then a wait set now is not read."""
    return "torch" in sys.modules
