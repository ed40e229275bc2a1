"""Chapter 5: a traffic shift. Requests in a category the serving release was never gated on,
mixed with its gated document work: the operator counts them in status.live.trafficShift, judges
only the gated categories, and takes no action."""

from __future__ import annotations

import threading
import time
from typing import Any

from .. import traffic
from ..ladder import actions, condition
from ..session import Session
from ..settings import DemoFailed, say
from .releases import check_speculating, gated_categories


def shift_prompts(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """Traffic in a category the release's gate never measured."""
    gated = gated_categories(spec)
    for pool in (traffic.CREATIVE, traffic.COPYING):
        found = [(c, p) for c, p in pool if c not in gated]
        if found:
            return found
    raise DemoFailed("every category of the demo's traffic is gated")


def run(demo: Session, v2_spec: dict[str, Any], shifted: list[tuple[str, str]]) -> None:
    """Requests in a category v2 was never gated on, mixed with its gated document work. The
    operator counts them in status.live.trafficShift and judges only the gated categories."""
    a = demo.args
    check_speculating(demo, "no drafted tokens in the shifted category would be counted")
    gated = sorted(gated_categories(v2_spec))
    documents = [(c, p) for c, p in traffic.COPYING if c in gated] or traffic.COPYING[:1]
    mix = [x for pair in zip(shifted, documents * len(shifted)) for x in pair]
    before = len(actions(demo.pair()))
    demo.timeline.mark(f"traffic shift: {shifted[0][0]}")
    t0 = time.monotonic()
    stop, sent = threading.Event(), [0]
    sender = demo.flood("traffic shift", mix, stop, sent)
    stages = [f"'{shifted[0][0]}' counted as a traffic shift", "a gated window judged (or the chapter's time is up)"]
    shift_cat = shifted[0][0]

    def progress(obj: dict[str, Any] | None) -> int:
        st = (obj or {}).get("status") or {}
        new = actions(obj)[before:]
        if any(x in ("SpeculationOff", "RolledBack") for x in new):
            raise DemoFailed(f"the operator acted on a traffic shift: {new}: {st.get('message')}")
        live = st.get("live") or {}
        n = 0
        if (live.get("trafficShift") or {}).get(shift_cat) and sent[0] >= a.shift_requests:
            n = 1
            judged = any(c in gated for c in live.get("acceptance") or {})
            if judged or time.monotonic() - t0 > a.shift_seconds:
                n = 2
        return n

    try:
        obj = demo.wait("traffic shift", stages, progress, a.step_timeout)
    finally:
        stop.set()
        sender.join(130)
    st = obj.get("status") or {}
    live = st.get("live") or {}
    drifted = condition(obj, "Drifted")
    new = actions(obj)[before:]
    say(f"  {sent[0]} requests in {time.monotonic() - t0:.0f} s ({', '.join(sorted({c for c, _ in mix}))})")
    say(f"  status.live.trafficShift (drafted tokens, not judged): {live.get('trafficShift')}")
    say(f"  status.live.acceptance (gated categories, last judged window): {live.get('acceptance') or '-'}"
        f" vs gated {((demo.facts.get('verdicts') or {}).get('2') or {}).get('categories') and {c: round(v.get('acceptanceRate', 0), 3) for c, v in demo.facts['verdicts']['2']['categories'].items()}}")
    # Whether the operator judged a gated window beside the shift: without one, "no action" shows
    # only that nothing was judged, and the report says so rather than claim the shift was ignored.
    window_judged = any(c in gated for c in live.get("acceptance") or {})
    say(f"  a gated window judged beside the shift: {'yes' if window_judged else 'NO (the chapter time ran out first)'}")
    say(f"  Drifted={drifted.get('status', '-')} {drifted.get('reason', '')}: {drifted.get('message', '')}")
    say(f"  operator actions: {', '.join(new) or 'none'}; phase {st.get('phase')}, serving v{st.get('servingVersion')}, "
        f"speculation {'on' if st.get('speculationEnabled', True) else 'off'}")
    demo.facts["drift"]["trafficShift"] = {
        "category": shift_cat, "requests": sent[0], "seconds": round(time.monotonic() - t0, 1),
        "trafficShift": live.get("trafficShift"), "liveAcceptance": live.get("acceptance"),
        "drifted": drifted, "actions": new, "speculationEnabled": st.get("speculationEnabled", True),
        "windowJudged": window_judged}
