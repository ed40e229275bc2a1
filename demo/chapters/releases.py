"""Chapters 2-4: the default SpecModelPair applied (v1), followed from MLflow registration through
its gate Job to serving; answers streamed from its pod; a second release (v2) shipped the same
way. Also the specs themselves (demo_pair, second_release) and how far a release got
(rollout_stage), read from the pair's status alone."""

from __future__ import annotations

import argparse
import copy
import shutil
from pathlib import Path
from typing import Any

import yaml
from specpair_devcluster import volumes

from .. import learning, traffic
from ..ladder import condition
from ..session import Session
from ..settings import EXAMPLE, NS, DemoFailed, drift_policy, learning_on, say, step
from ..timeline import Sampler


# The demo's gates name a speedup floor of 0 (gating.thresholds.minSpeedup): its chapters need
# drafted tokens (a traffic shift counted, a bad draft's acceptance falling), and on a busy machine
# the gate can time a tiny pair's speculation slower than target-only (the official CI at 2f32033:
# 0.73x for v2, 1.48x alone on a quiet machine). Under the default floor such a release ships with
# speculation off (contract.speculation_off_reason, tests/engine/test_engine_gate_default_floor.py)
# and the chapters would wait for drafts that never come. A named floor keeps speculation on at
# batch 1 and judges the release by itself (0: any speedup passes); the demo says so as it applies v1.
THRESHOLDS = {"requireGreedyIdentity": True, "minSpeedup": 0}


def demo_pair(args: argparse.Namespace) -> dict[str, Any]:
    """examples/default-pair.yaml, with gate and drift settings sized for a laptop-length demo."""
    pair = yaml.safe_load(EXAMPLE.read_text())
    pair["metadata"]["namespace"] = NS
    spec = pair["spec"]
    if args.target:
        spec["target"] = {"source": args.target}
    if args.draft:
        spec["draft"] = {"source": args.draft}
    # Golden prompts: one that copies from the prompt (where n-gram drafts pay) and one that
    # does not, so the release's baseline says what acceptance to expect on both kinds. Two
    # prompts keep the gate (with its k and batch sweeps) to a minute or so on 2 CPU cores.
    prompts = traffic.COPYING[:1] + traffic.CREATIVE[:1]
    spec["gating"] = {"prompts": [{"prompt": p, "category": c} for c, p in prompts],
                      "maxNewTokens": args.gate_tokens, "thresholds": dict(THRESHOLDS)}
    # The engine's own fallback (target-only below 0.5 running acceptance) is off, so what the
    # drift chapter shows is the operator's decision alone, made on the counters it reads.
    spec["speculation"] = {"fallbackThreshold": 0.0}
    spec["rollout"] = {"progressDeadlineSeconds": 1200}
    spec["drift"] = drift_policy(args)
    if learning_on(args):
        # The domain shift chapter's loop (demo/learning.py): the pods capture what they serve
        # from the start, and a learned draft's shadow is sized for minutes.
        spec["learning"] = learning.learning_spec(getattr(args, "training_steps", learning.TRAINING["steps"]))
        spec["rollout"]["shadow"] = dict(learning.SHADOW)
    return pair


def second_release(pair: dict[str, Any], args: argparse.Namespace, models: Path) -> tuple[dict[str, Any], str]:
    """The spec change that makes v2, and a sentence saying what it is.

    v2 changes only the draft side, which the operator would score in shadow before promoting
    (demo/shadow_chapter.py); the drift chapter needs v2 serving, so it asks for Replace (promote
    and roll every pod once the gate passes), and the shadow chapter lets the operator choose."""
    spec = copy.deepcopy(pair["spec"])
    spec["rollout"] = {**(spec.get("rollout") or {}), "strategy": {"type": "Replace"}}
    if args.draft:
        # A re-trained draft at a new path (here: a copy, until something overwrites it).
        new_draft = models / "draft-v2"
        shutil.copytree(args.draft, new_draft, dirs_exist_ok=True)
        spec["draft"] = {"source": str(new_draft)}
        return spec, f"the draft moves to {new_draft} (a re-trained draft), rolled out by Replace"
    # The team's traffic is document work: they re-gate on it alone (their own extraction and
    # summarisation prompts), with a floor per category, and let the n-gram drafter propose 8
    # tokens every round to copy longer spans. Its gate measures extraction lower than v1's did
    # (another extraction prompt, and more of each long draft rejected), which is what lets the
    # drift ladder's rollback rule prefer v1 on a collapse there (demo/ladder.py).
    spec["gating"]["prompts"] = [{"prompt": p, "category": c} for c, p in (traffic.COPYING[1], traffic.COPYING[2])]
    spec["gating"]["thresholds"] = {**THRESHOLDS, "minCategoryAcceptance": {
        "extraction": learning.V2_FLOOR if learning_on(args) else 0.2}}
    spec["speculation"] = {**spec.get("speculation", {}), "k": 8, "dynamicK": False}
    return spec, ("golden prompts become the team's document work only (extraction of dates, summarisation), "
                  "and the n-gram drafter proposes a fixed k tokens a round (k 8, dynamic k off; the gate's "
                  "tuning picks the k it serves with), rolled out by Replace")


def gated_categories(spec: dict[str, Any]) -> set[str]:
    return {p["category"] for p in spec["gating"]["prompts"]}


def check_speculating(demo: Session, why: str) -> None:
    """Fail at once, saying why, where v2's gate shipped it target-only (a batch threshold of 0):
    a chapter that needs drafted tokens would otherwise wait its whole step time for them."""
    verdict = (demo.facts.get("verdicts") or {}).get("2") or {}
    if ((verdict.get("bestSpeculation") or {}).get("batchSizeThreshold")) == 0:
        raise DemoFailed(f"v2's gate shipped it with speculation off, so {why}: {verdict.get('speculationOff')}")


ROLLOUT_STAGES = ["registered in MLflow", "gate Job running", "gate passed", "promoted to champion",
                  "engine pod starting", "serving, identity verified"]


def rollout_stage(obj: dict[str, Any] | None, version: str) -> int:
    """How far release `version` got along ROLLOUT_STAGES (its index + 1)."""
    st = (obj or {}).get("status") or {}
    for h in st.get("history") or []:
        if h.get("action") == "RolledBack" and h.get("fromVersion") == version:
            raise DemoFailed(f"v{version} was rolled back while rolling out: {h.get('reason')}")
    gated = condition(obj or {}, "Gated")
    if st.get("candidateVersion") == version and gated.get("status") == "False":
        raise DemoFailed(f"v{version} failed its gate: {gated.get('message')}")
    if st.get("candidateVersion") != version:
        return 0
    stage = 1
    if st.get("phase") == "Gating":
        stage = 2
    if gated.get("status") == "True" and gated.get("message", "").startswith(f"v{version}:"):
        stage = 3
    if st.get("servingVersion") == version:
        stage = 4
        if st.get("phase") == "RollingOut":
            stage = 5
        if st.get("phase") == "Serving":
            stage = 6
    return stage


def first_release(demo: Session, total: int) -> dict[str, Any]:
    """Steps 2 and 3: v1 applied and followed to serving, then answers streamed from its pod.
    Returns the pair as applied."""
    demo.stage_models()
    pair = demo_pair(demo.args)
    target, draft = pair["spec"]["target"], pair["spec"]["draft"]
    step(2, total, "Applying the default SpecModelPair (target "
         + ("embedded SmolLM2-135M" if target.get("source") == "default" else target.get("source"))
         + ", " + (f"{draft['drafter']} drafter" if draft.get("drafter") else f"draft {draft.get('source')}") + ")")
    say("  the gates' speedup floor is 0 (gating.thresholds.minSpeedup): the chapters need speculation on, "
        "and a busy machine can time tiny models' drafting slower; without a floor such a release "
        "would ship with speculation off")
    demo.name = pair["metadata"]["name"]
    (demo.workdir / "pair-v1.yaml").write_text(yaml.safe_dump(pair, sort_keys=False))
    if learning_on(demo.args):
        # Where the pods capture: a claim bound to a folder of the run (the devcluster has no
        # provisioner), there before the pair's first pod mounts it.
        volumes.hostpath_claim(demo.cluster.kube, NS, learning.CLAIM, demo.workdir / "capture")
        say(f"  spec.learning on: the engine pods capture every request to claim '{learning.CLAIM}' "
            f"({demo.workdir / 'capture'})")
    demo.cluster.create_pair(pair)
    demo.sampler = Sampler(demo.timeline, demo.address, demo.pair)
    demo.sampler.start()
    demo.timeline.mark("v1 applied")
    obj = demo.wait("v1", ROLLOUT_STAGES, lambda o: rollout_stage(o, "1"), demo.args.step_timeout)
    demo.show_release(obj, "1")

    step(3, total, "Streaming answers from the engine pod over gRPC (each also decoded target-only for the speedup)")
    demo.converse("v1", traffic.COPYING[:demo.args.answers])
    return pair


def second(demo: Session, pair: dict[str, Any], total: int) -> dict[str, Any]:
    """Step 4: v2 (second_release) shipped and followed to serving, one answer streamed from it.
    Returns v2's spec."""
    v2_spec, what = second_release(pair, demo.args, demo.models)
    step(4, total, f"Shipping a second release: {what}")
    demo.cluster.patch_pair_spec(demo.name, v2_spec)
    demo.timeline.mark("v2 applied")
    obj = demo.wait("v2", ROLLOUT_STAGES, lambda o: rollout_stage(o, "2"), demo.args.step_timeout)
    demo.show_release(obj, "2")
    demo.converse("v2", traffic.COPYING[:1])
    return v2_spec
