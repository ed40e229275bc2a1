"""Whether the API server serves KEDA's ScaledObject: the one fact about the installation the
autoscaler's plan needs (desired/autoscaling.plan_autoscaler(keda=...)), read here so that
desired/ only describes objects and never asks the API server."""

from __future__ import annotations

import time
from typing import Any

from specpair_operator.desired.autoscaling import KEDA_API_VERSION

# How long the answer to "is KEDA installed?" stands: KEDA installed (or removed) after the
# operator started is seen within this long, and the pair's autoscaler switches kind.
KEDA_RECHECK_S = 60.0


async def keda_installed(state: Any) -> bool:
    """Whether the API server serves KEDA's ScaledObject (API discovery), asked again every
    KEDA_RECHECK_S so that installing or removing KEDA needs no operator restart."""
    seen, now = state.keda_seen, time.monotonic()
    if seen is None or now - seen[1] >= KEDA_RECHECK_S:
        seen = state.keda_seen = ("scaledobjects" in await state.kube.served_resources(KEDA_API_VERSION), now)
    return seen[0]
