"""The demo's settings and the few helpers every chapter uses: where it runs (namespace, ports),
the operator's and the drift policy's settings sized for minutes on 2 CPU cores, and how it
speaks (say, step) and fails (DemoFailed)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from specpair_operator.desired import manifests

from .cluster import REPO

NS = "specpair-demo"
GROUP_VERSION = "specpair.io/v1alpha1"
EXAMPLE = REPO / "examples" / "default-pair.yaml"
ENGINE_PORT = 50051


def http_address(grpc_address: str) -> str:
    """The same pod's OpenAI-compatible HTTP API, where the demo's answers are streamed from."""
    return f"{grpc_address.rsplit(':', 1)[0]}:{manifests.HTTP_PORT}"


# The operator's settings for a demo: reconcile every second, short watches.
OPERATOR_ENV = {"SPECPAIR_RECONCILE_INTERVAL": "1", "SPECPAIR_WATCH_TIMEOUT": "60"}
# The drift policy sized for minutes on 2 CPU cores instead of the defaults' hours in production
# (docs/drift.md): read every 2 s; disjoint 10 s windows, each judged only with at least 4
# effective requests (the engine reports per-request sums, so each finished request that drafted
# counts once) and 40 drafted tokens; two breaching windows per ladder step; a probe
# after one quiet window while speculation is off. Tolerance, noise allowance and the 99% bound
# are the defaults.
DRIFT = {"intervalSeconds": 2, "windowSeconds": 10, "minRequests": 4, "minDraftedTokens": 40,
         "consecutiveBreaches": 2, "probeAfterWindows": 1, "tolerance": 0.2, "noiseAllowance": 0.02,
         "confidenceZ": 2.33}


def at_least_one(text: str) -> int:
    """--drift-breaches: a whole number the CRD admits (its minimum is 1)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is below 1, the least drift.consecutiveBreaches admits")
    return n


def learning_on(args: argparse.Namespace) -> bool:
    """Whether the domain shift chapter ends with the operator's learning loop (demo/learning.py):
    with the n-gram drafter (no --draft: the bad-draft chapter has a rollback that helps) unless
    --no-learning."""
    return not getattr(args, "draft", None) and not getattr(args, "no_learning", False)


def drift_policy(args: argparse.Namespace) -> dict[str, Any]:
    """DRIFT with the breaching windows per ladder step of --drift-breaches, and with the learning
    loop its tolerance (learning.TOLERANCE: no rollback helps on the domain shift)."""
    from .learning import TOLERANCE

    return {**DRIFT, "consecutiveBreaches": args.drift_breaches,
            **({"tolerance": TOLERANCE} if learning_on(args) else {})}


# Paths a pod mounts volumes at: a model directory under one of them is hidden from the pod
# (in any cluster; devcluster rewrites such paths to the pod's volume folder).
POD_MOUNTS = ("/tmp", manifests.RELEASE_DIR, manifests.CACHE_DIR)


class DemoFailed(Exception):
    pass


def pod_visible(path: Path) -> bool:
    text = str(path.resolve())
    return not any(text == m or text.startswith(m + "/") for m in POD_MOUNTS)


def say(text: str = "") -> None:
    print(text, flush=True)


def step(n: int, total: int, title: str) -> None:
    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
    say(f"\n{bold}[{n}/{total}] {title}{plain}")

