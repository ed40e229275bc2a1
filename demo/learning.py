"""The domain shift chapter's learning loop (issue 58), the pieces without a cluster: what the
demo's pair asks for (spec.learning, the drift tolerance that makes rollback not help), how far
the operator's loop got, read from the pair's status alone, and the acceptance figures on the
shifted category before the shift, during it and after the learned release.

The loop is the operator's, not the demo's: with spec.learning on, the engine pods capture the
traffic they serve (a hostPath claim, specpair_devcluster.volumes, as the loop's e2e test makes
it); when the shifted category drifts and no rollback helps (`Drifted: RollbackWouldNotHelp`), the
operator runs its training Job on that category's captured traffic, and the version it registers
(only the draft side changes) is gated, scored in shadow on the live shifted traffic and promoted.
The demo sends the traffic and reads the status."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .ladder import condition
from .traffic import Answer

CLAIM = "traffic"            # the PersistentVolumeClaim the pair's pods capture to
# The training the bench measured on this shift (bench/learning_loop.py, docs/measurements/
# 2026-12-07c-learning-loop-smollm2-cpu.md): an EAGLE-3 head, 300 steps, the training loop's
# budget 660 s (the Job's activeDeadlineSeconds x 0.6, training_job.TRAINING_SHARE). The head:
# ~0.2 CPU-s a step after one feature pass, where a draft model (the CRD's default method) costs
# ~4 CPU-s a step on SmolLM2's 49,152-token vocabulary.
TRAINING = {"method": "eagle3", "steps": 300, "activeDeadlineSeconds": 1100}
# The learned release's shadow (as the loop's e2e test sizes it): every request scored, a verdict
# from 4 requests on, at most 900 s.
SHADOW = {"share": 1.0, "minRequests": 4, "maxSeconds": 900}
# With the loop, the pair's drift tolerance is 0.35 (the demo's other runs: 0.2). Both releases
# draft by n-gram on the same target, so the rollback rule rolls back only where v1's gated
# floor (gated x (1 - tolerance) - 0.02) is above v2's gated number: v1 gated 'extraction' at 0.75,
# v2 at 0.55 (2026-12-07 runs), floors 0.58 at 0.2 (a rollback) and 0.47 at 0.35 (none). That is
# the honest answer on this traffic: v1 drafts with the same lookup and has nothing to copy
# either. v2's own floor stays under the shifted traffic's live acceptance (0.55 x 0.65 - 0.02 =
# 0.34 against upper bounds of 0.11-0.25 measured), so it still breaches.
TOLERANCE = 0.35
# v2's gated floor on 'extraction' with the loop: a learned head keeps v2's speculation settings
# (k 8 fixed) at its gate, where accepted/drafted stays low even for a head whose first position
# is right 40% of the time; the shadow judges the first position against max(this floor, v2's
# drifted live acceptance).
V2_FLOOR = 0.05


def learning_spec(steps: int = TRAINING["steps"]) -> dict[str, Any]:
    """spec.learning of the demo's pair: every finished request captured (the chapter sends tens,
    not thousands), the bench's training settings (`steps`: --training-steps, for a shorter run)."""
    return {"enabled": True, "persistentVolumeClaim": CLAIM, "sampleRate": 1.0,
            "training": {**TRAINING, "steps": steps}}


DRIFTED = "no rollback helps (Drifted: RollbackWouldNotHelp)"
TRAINING_STARTED = "the operator's training Job runs on the captured traffic (TrainingStarted)"
REGISTERED = "a draft-side release registered with its lineage (TrainingSucceeded)"
GATED = "its gate passed (GatePassed)"
SHADOWED = "scored in shadow on the live shifted traffic (ShadowStarted)"
PROMOTED = "promoted on that evidence (LearnedDraftPromoted), its draft swapped into the pods"
SERVING = "serving it, speculation on"
STAGES = [DRIFTED, TRAINING_STARTED, REGISTERED, GATED, SHADOWED, PROMOTED, SERVING]


class Loop:
    """How far the operator's loop got for (release `version`, `category`), from the pair's
    status: `update` is fed each status read and returns the stages reached (STAGES, in order);
    `failed` says why the loop ended short (a training that failed or timed out, a learned draft
    rejected), `candidate` is the learned version once registered."""

    def __init__(self, version: str, category: str, clock: Callable[[], float] = time.monotonic):
        self.version, self.category = str(version), category
        self.clock = clock
        self.t0 = clock()
        self.at: dict[str, float] = {}
        self.candidate = ""
        self.failed = ""
        self.waiting = ""     # the training's wait for captured requests, as the operator words it

    def run(self, st: dict[str, Any]) -> dict[str, Any]:
        runs = [r for r in (st.get("training") or {}).get("runs") or []
                if str(r.get("version")) == self.version and r.get("category") == self.category]
        return runs[-1] if runs else {}

    def update(self, obj: dict[str, Any] | None) -> int:
        st = (obj or {}).get("status") or {}
        reached: set[str] = set()
        run = self.run(st)
        if condition(obj, "Drifted").get("reason") == "RollbackWouldNotHelp" or run:
            reached.add(DRIFTED)
        self.waiting = str(run.get("message") or "") if run.get("phase") == "wanted" else ""
        if run.get("phase") in ("running", "done") or run.get("job"):
            reached |= {DRIFTED, TRAINING_STARTED}
        if run.get("phase") in ("failed", "timed-out"):
            self.failed = f"training {run['phase']}: {run.get('message')}"
        if run.get("phase") == "done" and run.get("candidate"):
            reached |= {DRIFTED, TRAINING_STARTED, REGISTERED}
            self.candidate = str(run["candidate"])
        if self.candidate:
            mine = [h.get("action") for h in st.get("history") or [] if str(h.get("toVersion")) == self.candidate]
            learned = st.get("learnedRelease") or {}
            stage = learned.get("stage") if str(learned.get("version")) == self.candidate else None
            if "GatePassed" in mine or stage in ("shadow", "promoted"):
                reached.add(GATED)
            if "ShadowStarted" in mine or stage == "promoted":
                reached |= {GATED, SHADOWED}
            if stage == "promoted" or "LearnedDraftPromoted" in mine:
                reached |= {GATED, SHADOWED, PROMOTED}
                if str(st.get("servingVersion")) == self.candidate and st.get("speculationEnabled", True) is True:
                    reached.add(SERVING)
            elif stage == "rejected" or "LearnedDraftRejected" in mine:
                self.failed = f"v{self.candidate} rejected: {condition(obj, 'Learning').get('message')}"
        now = round(self.clock() - self.t0, 1)
        for s in STAGES:
            if s in reached:
                self.at.setdefault(s, now)
        n = 0
        while n < len(STAGES) and STAGES[n] in self.at:
            n += 1
        return n

    def rows(self) -> list[tuple[float, str]]:
        return [(self.at[s], s) for s in STAGES if s in self.at]


@dataclass
class Acceptance:
    """Acceptance over some answers: first position (accepted drafts at position 1 over rounds
    that drafted: the issue's figure) and over drafted tokens (what the rest of the demo shows)."""
    requests: int = 0
    drafts: int = 0
    first: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def first_position(self) -> float | None:
        return self.first / self.drafts if self.drafts else None

    @property
    def tokens(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "drafts": self.drafts, "firstPositionAccepted": self.first,
                "firstPosition": self.first_position, "drafted": self.drafted, "accepted": self.accepted,
                "tokens": self.tokens}

    def words(self) -> str:
        if not self.drafts:
            return f"{self.requests} requests, nothing drafted"
        return (f"first position {self.first_position:.2f} ({self.first} of {self.drafts} rounds), "
                f"{self.tokens:.0%} of {self.drafted} drafted tokens, over {self.requests} requests")


def acceptance(answers: Iterable[Answer], category: str) -> Acceptance:
    out = Acceptance()
    for a in answers:
        if a.category != category or a.error:
            continue
        out.requests += 1
        out.drafts += a.drafts
        out.first += a.first_accepted
        out.drafted += a.drafted
        out.accepted += a.accepted
    return out

