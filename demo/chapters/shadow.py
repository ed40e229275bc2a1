"""Chapter 7: shadow scoring. A candidate that changes only the draft side is applied; the operator
chooses Shadow by itself, gates it, and scores it on the champion's pods while they serve; the
demo sends document work and shows the verdict the operator reached with its numbers. The pieces
without a cluster are in demo/shadow_chapter.py."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from .. import shadow_chapter
from ..ladder import actions, condition
from ..session import Session
from ..settings import DemoFailed, say


def run(demo: Session) -> None:
    """Apply a candidate that differs from the champion only on its draft side (the operator
    then chooses Shadow), send document work to whichever pod serves once the champion's pods
    carry the candidate, and show the verdict the operator reaches with its numbers
    (demo/shadow_chapter.py)."""
    a = demo.args
    obj = demo.pair() or {}
    st = obj.get("status") or {}
    champion = str(st.get("servingVersion"))
    gated = set((((demo.facts.get("verdicts") or {}).get(champion) or {}).get("categories")) or {})
    prompts = shadow_chapter.shadow_traffic(gated)
    progress = shadow_chapter.Progress(len(actions(obj)), str(st.get("candidateVersion") or ""))
    draft_source = None
    if not a.draft:
        # The n-gram pair's candidate: a layer-skip draft of the target, where the pods read models.
        from specpair.models import resolve_source

        target = resolve_source(str((obj["spec"].get("target") or {}).get("source") or "default"), progress=say)
        t0 = time.monotonic()
        draft_source = str(shadow_chapter.make_layer_skip_draft(target, demo.models / "layer-skip-draft"))
        say(f"  wrote a draft model of the target's first {shadow_chapter.LAYER_SKIP_LAYERS} layers (untrained) "
            f"to {draft_source} ({time.monotonic() - t0:.0f} s)")
    spec = shadow_chapter.candidate_spec(obj["spec"], a.gate_tokens, draft_source)
    say(f"  v{champion} serves; the candidate: k {shadow_chapter.CANDIDATE_K}, draft "
        f"{(spec.get('draft') or {}).get('drafter') or (spec.get('draft') or {}).get('source')}, "
        f"rollout.shadow {json.dumps(shadow_chapter.SHADOW)}; gated on one '{prompts[0][0]}' prompt")
    demo.cluster.patch_pair_spec(demo.name, spec)
    demo.timeline.mark("shadow: candidate applied")
    stop, sent, failed = threading.Event(), [0], [0]
    sender: list[threading.Thread] = []

    def reached(o: dict[str, Any] | None) -> int:
        try:
            n = progress.update(o)
        except ValueError as exc:
            raise DemoFailed(str(exc)) from None
        if n >= 3 and not sender and progress.result is None:
            demo.timeline.mark(f"shadow: v{progress.version} scored on live traffic")
            # Twice the answers' length: more scored positions per request, whose own costs
            # (the HTTP call, the prefill) dominate on small models.
            sender.append(demo.flood("shadow", prompts, stop, sent, failed, 2 * a.max_new_tokens))
        return n

    t0 = time.monotonic()
    try:
        demo.wait("shadow", shadow_chapter.STAGES, reached, a.step_timeout)
    finally:
        stop.set()
        for thread in sender:
            thread.join(130)
    obj = demo.pair() or {}
    st = obj.get("status") or {}
    version = progress.version or "?"
    scored = condition(obj, "ShadowScored")
    shadow = st.get("shadow") or {}
    demo.show_release(obj, version)
    say(f"  ShadowScored={scored.get('status', '-')} {scored.get('reason', '')}: {scored.get('message', '')}")
    for row in shadow_chapter.numbers_rows(shadow):
        say("    {}: candidate alpha {}, champion alpha {}, difference {}, {} requests: {}".format(*row))
    meaning = shadow_chapter.explain(progress.result, shadow)
    say(f"  v{version} {meaning}")
    say(f"  {sent[0]} requests answered during the shadow, {failed[0]} failed; v{st.get('servingVersion')} "
        f"serving, phase {st.get('phase')}")
    steps = [(t, stage) for what, stage, t in demo.facts["steps"] if what == "shadow"]
    demo.facts["shadow"] = {"version": version, "champion": champion, "result": progress.result,
                            "meaning": meaning, "condition": scored, "status": shadow, "requests": sent[0],
                            "failed": failed[0], "seconds": round(time.monotonic() - t0, 1), "timeline": steps,
                            "servingAfter": st.get("servingVersion")}
    demo.timeline.mark(f"shadow: {progress.result}")
