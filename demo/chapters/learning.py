"""The domain shift chapter's end (issue 58): no rollback helps, and the operator learns a drafter
from the shifted traffic. The demo only sends that traffic (the same requests as the drift
ladder's) and follows the pair's status (demo/learning.py's Loop): the operator's training Job
on the captured traffic, the registered draft-side release, its gate, its shadow on the live
shifted traffic, its promotion with the draft swapped into the pods, speculation on again. Then
the demo measures the category on the new release and prints acceptance before the shift,
during it and after."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from specpair_devcluster import engine_drafts

from ..learning import STAGES, Loop, acceptance
from ..ladder import domain_shift_prompts
from ..session import Session
from ..settings import ENGINE_PORT, NS, DemoFailed, say

# The loop's whole road: the training Job's activeDeadlineSeconds (1,100 s; learning.TRAINING),
# the learned release's gate (v1's and v2's took 90-355 s here) and its shadow (at most 900 s).
LOOP_SECONDS = 3000
# Requests measured on the new release: the six shifted prompts once each.
AFTER_REQUESTS = 6
LOOP_EVENTS = ("TrainingStarted", "TrainingSucceeded", "TrainingFailed", "TrainingTimedOut", "GateStarted",
               "GatePassed", "GateFailed", "ShadowStarted", "ShadowScored", "LearnedDraftPromoted",
               "LearnedDraftRejected", "DraftSwapped", "SpeculationOn")


def loop_events(demo: Session) -> dict[str, int]:
    """The pair's Events of the loop's steps, counted by reason."""
    try:
        events = demo.cluster.kube.list("v1", "Event", NS) if demo.cluster else []
    except Exception:  # noqa: BLE001 - the figures are a courtesy; the history has the steps
        return {}
    return dict(Counter(e.get("reason") for e in events
                        if (e.get("involvedObject") or {}).get("name") == demo.name and e.get("reason") in LOOP_EVENTS))


def drafts_served(demo: Session) -> set[str]:
    """The release versions whose draft the ready engine pods report (GetModelInfo.draft_version):
    servingVersion follows the aliases, which move before the draft is swapped into the pods."""
    return engine_drafts.drafts_served(demo.cluster.engine_pods(demo.name), ENGINE_PORT) if demo.cluster else set()


def run(demo: Session, version: str, category: str) -> None:
    """Follow the operator's loop for (v`version`, `category`) while the shifted traffic goes on;
    then measure the new release on it. DemoFailed where the loop ends short (the operator says why)."""
    a = demo.args
    before = acceptance([x for label, x in demo.answers if label in ("v2", "traffic shift")], category)
    during = acceptance([x for label, x in demo.answers if label == "drift"], category)
    loop = Loop(version, category)
    demo.timeline.mark("loop: training wanted")
    prompts = domain_shift_prompts(category)
    stop, sent = threading.Event(), [0]
    sender = demo.flood("learning loop", prompts, stop, sent)
    marked: set[str] = set()
    said = {"waiting": "", "at": 0.0}

    def progress(obj: dict[str, Any] | None) -> int:
        n = loop.update(obj)
        # The training waits for enough captured requests of the category (the pair's
        # spec.learning.training.minCapturedRequests): the counts as the operator says them,
        # every 30 s at most.
        if loop.waiting and loop.waiting != said["waiting"] and time.monotonic() - said["at"] >= 30:
            say(f"  the operator: {loop.waiting}")
            said.update(waiting=loop.waiting, at=time.monotonic())
        for _, stage in loop.rows():
            if stage not in marked:
                marked.add(stage)
                demo.timeline.mark("loop: " + stage.split(" (")[0].split(":")[0])
        if loop.failed:
            raise DemoFailed(f"the learning loop ended short: {loop.failed}")
        return n

    try:
        obj = demo.wait("learning loop", STAGES, progress, max(a.step_timeout, LOOP_SECONDS))
    finally:
        stop.set()
        sender.join(130)
    candidate = loop.candidate
    st = obj.get("status") or {}
    for h in st.get("history") or []:
        if h.get("action") in ("TrainingStarted", "TrainingSucceeded", "LearnedDraftPromoted") or \
                (str(h.get("toVersion")) == candidate and h.get("action") in ("GatePassed", "ShadowStarted")):
            say(f"  {h.get('time')}  {h.get('action')}: v{h.get('fromVersion')} -> v{h.get('toVersion')}: "
                f"{str(h.get('reason'))[:240]}")
    run_ = loop.run(st)
    learned = st.get("learnedRelease") or {}

    # The new release on the shifted traffic: fresh requests, sent once every ready pod runs its draft.
    deadline = time.monotonic() + 600
    while (served := drafts_served(demo)) != {candidate}:
        demo.check_cluster()
        demo.deadline_check()
        if time.monotonic() > deadline:
            raise DemoFailed(f"v{candidate} promoted, but the engine pods report drafts {sorted(served)} after 600 s")
        time.sleep(2)
    say(f"  every ready engine pod reports v{candidate}'s draft (GetModelInfo)")
    stop, measured = threading.Event(), [0]
    sender = demo.flood("after learning", prompts, stop, measured)
    deadline = time.monotonic() + 600
    try:
        while measured[0] < AFTER_REQUESTS:
            demo.check_cluster()
            demo.deadline_check()
            if time.monotonic() > deadline:
                raise DemoFailed(f"only {measured[0]} of {AFTER_REQUESTS} requests answered by v{candidate} in 600 s")
            time.sleep(1)
    finally:
        stop.set()
        sender.join(130)
    after = acceptance([x for label, x in demo.answers if label == "after learning"], category)
    obj = demo.pair() or obj
    st = obj.get("status") or {}
    live = ((st.get("live") or {}).get("acceptance") or {}).get(category) \
        if str((st.get("drift") or {}).get("version")) == candidate else None
    events = loop_events(demo)
    say(f"  {sent[0]} shifted requests answered during the loop; the loop's steps: "
        + "; ".join(f"{stage.split(' (')[0]} after {t:.0f} s" for t, stage in loop.rows()))
    say(f"  training: {run_.get('message', '')[:300]}")
    say(f"  v{candidate} on the road: stage {learned.get('stage')}, judged on '{category}' against "
        f"{learned.get('reference')} (max of the floor {learned.get('floor')} and v{version}'s drifted live "
        f"acceptance {learned.get('driftedAcceptance')} + {learned.get('gain')})")
    say(f"  Events: {', '.join(f'{k} x{v}' for k, v in sorted(events.items())) or 'none read'}")
    say(f"  acceptance on '{category}' (per request's figures from the engine):")
    say(f"    before the shift (v{version}, document work): {before.words()}")
    say(f"    during the shift (v{version}, free-form writing): {during.words()}")
    say(f"    after the new release (v{candidate}, free-form writing): {after.words()}"
        + (f"; the operator's live figure {float(live):.2f}" if live is not None else ""))
    demo.timeline.mark(f"loop: v{candidate} measured")
    demo.facts["drift"]["learning"] = {
        "version": version, "category": category, "candidate": candidate, "requests": sent[0],
        "timeline": loop.rows(), "training": run_, "learnedRelease": learned, "events": events,
        "before": before.as_dict(), "during": during.as_dict(), "after": after.as_dict(),
        "liveAfter": live}
