"""Chapter 6: drift in a gated category, up the operator's drift ladder (demo/ladder.py). With the
n-gram drafter a domain shift (requests labelled as document work whose content is free-form
writing); with a draft model a bad draft (its files overwritten with noise, its pod deleted). The
operator switches speculation off, probes, and rolls back when its rule says that helps."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from .. import traffic
from ..ladder import PROBE, Ladder, actions, domain_shift_prompts, rollback_prediction
from ..session import Session
from ..settings import DemoFailed, learning_on, say
from .releases import check_speculating, gated_categories


def bad_draft(demo: Session) -> None:
    check_speculating(demo, "there is no acceptance to drift")
    degrade_draft(demo.models / "draft-v2")
    deleted = demo.cluster.delete_engine_pods(demo.name)
    say(f"  draft files overwritten; deleted pod {', '.join(deleted)} (its Deployment makes a new one)")
    documents = [(c, p) for c, p in traffic.COPYING if c in gated_categories(demo.pair()["spec"])] \
        or traffic.COPYING[:1]
    # v1 drafts with the good draft: the rollback is expected, so a Drifted=RollbackWouldNotHelp
    # read while the probe still runs is not the decision (a serving-latency verdict set a
    # moment before SpeculationOff stayed on the condition through the probe in CI, 2026-12-07).
    drift_ladder(demo, "bad draft", "bad draft: files overwritten, pod deleted", documents,
                 rollback_expected=True)


def shift_category(demo: Session) -> str:
    """The category the domain shift is labelled with: one both releases were gated on (so
    the rollback rule has both gated numbers to weigh), where the answer copies the document."""
    verdicts = demo.facts.get("verdicts") or {}
    now = set((verdicts.get("2") or {}).get("categories") or {})
    both = [c for c, _ in traffic.COPYING if c in now and c in ((verdicts.get("1") or {}).get("categories") or {})]
    if not both:
        raise DemoFailed(f"no category was gated by both releases (v2: {sorted(now)})")
    return both[0]


def domain_shift(demo: Session, category: str) -> Ladder:
    """Live traffic in a gated category that comes from another domain: the n-gram drafter
    finds nothing to copy, live acceptance falls below what the gate measured, and the
    operator climbs its drift ladder. Whether it may roll back is the rule's call on the two
    gates' numbers; the demo says which before it starts and shows what happened."""
    verdicts = demo.facts.get("verdicts") or {}
    possible, why = rollback_prediction(demo.facts["drift"]["policy"], verdicts.get("2"), verdicts.get("1"), category)
    v2 = ((verdicts.get("2") or {}).get("categories") or {}).get(category, {}).get("acceptanceRate")
    best = (verdicts.get("2") or {}).get("bestSpeculation") or {}
    say(f"  v2 was gated at {v2:.0%} on '{category}' and serves at k {best.get('k')} (dynamic k off); "
        "the same label now carries poems and stories")
    say(f"  the operator's rule, from the two gates: {why}")
    demo.facts["drift"]["domainShift"] = {"category": category, "gatedV2": v2,
                                          "gatedV1": ((verdicts.get("1") or {}).get("categories") or {})
                                          .get(category, {}).get("acceptanceRate"),
                                          "rollbackPossible": possible, "prediction": why}
    check_speculating(demo, "there is no acceptance to drift")
    ladder = drift_ladder(demo, "domain shift", f"domain shift: '{category}' carries free-form writing",
                          domain_shift_prompts(category))
    if ladder.rolled_back:
        say("  v1 serves again: its gate measured this category higher, and live acceptance fell below its "
            "floor as well, so the rule judged that rolling back helps. v1 drafts with the same n-gram "
            "drafter, so on these requests it still has little to copy (its k adapts to acceptance, so it "
            "wastes fewer drafts than v2's fixed k): acceptance alone cannot tell a change of content inside a gated category from a "
            "broken release (docs/drift.md, Limits). Label such traffic with its own category (counted, not "
            "judged, as in step 5) or gate on it.")
    elif learning_on(demo.args):
        say("  no rollback: v1 drafts with the same lookup and has nothing to copy here either. v2 serves "
            "target-only; with spec.learning the operator goes on by itself: it trains a drafter on the "
            "traffic its pods captured (next step)")
    else:
        say("  no rollback: the operator keeps v2 serving target-only and goes on probing; its reason is in "
            "the Drifted condition above. Label such traffic with its own category (counted, not judged, as "
            "in step 5) or gate on it.")
    return ladder


def drift_ladder(demo: Session, chapter: str, mark: str, prompts: list[tuple[str, str]],
                 rollback_expected: bool = False) -> Ladder:
    """Send `prompts` to whichever pod serves until the operator has made its rollback
    decision, following the ladder on the pair's status (demo/ladder.py); every stage goes
    into the timeline and the report."""
    a = demo.args
    obj = demo.pair() or {}
    ladder = Ladder(len(actions(obj)), str((obj.get("status") or {}).get("previousVersion") or "1"),
                    rollback_expected=rollback_expected)
    demo.timeline.mark(f"drift: {mark}")
    stop, sent = threading.Event(), [0]
    sender = demo.flood("drift", prompts, stop, sent)

    def progress(o: dict[str, Any] | None) -> int:
        n = ladder.update(o)
        if PROBE in ladder.at and not any(label.startswith("probe:") for _, label in demo.timeline.marks):
            demo.timeline.mark("probe: the operator turns speculation on to measure")
        if ladder.rolled_back is not None:
            # Decided: after a rollback the previous release serves, without one nothing more
            # happens but further probes; the requests can stop.
            stop.set()
        return n

    try:
        demo.wait(chapter, ladder.stages, progress, a.step_timeout)
    finally:
        stop.set()
        sender.join(130)
    obj = demo.pair() or {}
    st = obj.get("status") or {}
    for h in (st.get("history") or [])[ladder.before:]:
        if h.get("action") in ("SpeculationOff", "RolledBack"):
            say(f"  {h['time']}  {h['action']}: v{h.get('fromVersion')} -> v{h.get('toVersion')}: {h.get('reason')}")
    if ladder.rolled_back is False:
        say(f"  Drifted=RollbackWouldNotHelp: {ladder.decision}")
    drift = [x for label, x in demo.answers if label == "drift"]
    drafted = sum(x.drafted for x in drift)
    acceptance = sum(x.accepted for x in drift) / drafted if drafted else None
    say(f"  {sent[0]} requests; acceptance over their drafted tokens "
        f"{acceptance if acceptance is not None else 0:.0%} ({drafted} drafted); "
        + "; ".join(f"{stage} after {t} s" for t, stage in ladder.rows()))
    say(f"  status: phase {st.get('phase')}, serving v{st.get('servingVersion')}: {st.get('message')}")
    demo.facts["drift"]["ladder"] = {"chapter": chapter, "requests": sent[0], "drafted": drafted,
                                     "acceptance": acceptance, "rolledBack": ladder.rolled_back,
                                     "decision": ladder.decision, "timeline": ladder.rows()}
    demo.timeline.mark("rolled back" if ladder.rolled_back else "no rollback")
    return ladder


def degrade_draft(path: Path) -> None:
    """Overwrite a draft model's weights in place with noise: what a bad copy or a botched
    re-training leaves behind. Same tokenizer, so only live acceptance can tell."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.std().clamp(min=1e-3))
    model.save_pretrained(str(path))
