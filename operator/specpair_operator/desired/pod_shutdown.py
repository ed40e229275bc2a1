"""How an engine pod stops without failing a request: rollout.shutdown (the CRD holds the defaults). Pure.

Why: Kubernetes takes a stopping pod (a scale-down, a rollout's old pod, a canary's pods going) out
of its Services' endpoints as it sends SIGTERM, and kube-proxy, gateways and load balancers follow
some seconds later. A server that refused new requests on SIGTERM failed those still sent to it
meanwhile (2 and 14 requests through Traefik in two operator-driven canaries). So the pod is told:
  - `stop_delay`: seconds after SIGTERM it still serves, its readiness failing, while the
    endpoints and whatever routes by them stop sending to it (our engine: --stop-delay, in the
    process, so no `sleep` binary or preStop hook is needed in the image);
  - `drain`: then it refuses new requests and lets those in flight (streams) run up to this long
    (our engine: --drain-timeout);
  - the pod's terminationGracePeriodSeconds covers both and the process's exit after them
    (EXIT_MARGIN_SECONDS), so the kubelet's SIGKILL never cuts a drain short.
Both engines' pods (ours and vLLM's with its companion) read the one `Shutdown` of their rollout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from specpair_operator.crd.schema import spec_schema

# After the drain: the gRPC server's own stop grace (5 s, server/app.py), the worker's and the
# process's exit. The kubelet SIGKILLs at the grace period's end.
EXIT_MARGIN_SECONDS = 10


def shutdown_defaults() -> dict[str, Any]:
    """rollout.shutdown's defaults as the CRD declares them (their one home)."""
    props = spec_schema()["properties"]["rollout"]["properties"]["shutdown"]["properties"]
    return {k: sub["default"] for k, sub in props.items() if "default" in sub}


@dataclass(frozen=True)
class Shutdown:
    stop_delay: int      # seconds still serving, unready, after SIGTERM
    drain: int           # then seconds in-flight requests may run on

    @property
    def grace_period(self) -> int:
        """The pod's terminationGracePeriodSeconds."""
        return self.stop_delay + self.drain + EXIT_MARGIN_SECONDS

    def engine_flags(self) -> list[str]:
        """Our engine's command-line flags for it (`specpair engine serve`)."""
        return ["--stop-delay", str(self.stop_delay), "--drain-timeout", str(self.drain)]


def shutdown_of(rollout: Mapping[str, Any]) -> Shutdown:
    """The rollout's shutdown, the CRD's defaults where it sets none."""
    given = {**shutdown_defaults(), **(rollout.get("shutdown") or {})}
    return Shutdown(stop_delay=int(given["stopDelaySeconds"]), drain=int(given["drainSeconds"]))
