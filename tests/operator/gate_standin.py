"""Stand-in for `specpair gate` in the operator tests, so a gate Job judges a release in seconds.

Same CLI and verdict shape as `specpair gate` (engine/specpair/gate/verdict.py); instead of running
models it reads the candidate's numbers from the test's declared model world
(SPECPAIR_STANDIN_WORLD: draft -> rates) and applies the release's thresholds itself, as the real
gate does.
"""

import argparse
import hashlib
import json
import os
import sys
import time

from specpair.contract import speculation_pays, threshold_failures


def fingerprint(source):
    return hashlib.sha256(f"tokenizer-of:{source}".encode()).hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--release", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rel = json.load(open(a.release))
    world = json.load(open(os.environ["SPECPAIR_STANDIN_WORLD"]))
    draft = rel["draft"].get("source") or rel["draft"].get("drafter")
    if draft not in world:
        sys.exit(f"cannot load draft {draft!r}")
    w = world[draft]
    # A gate that takes its time, for tests that act while it runs.
    time.sleep(float(world.get("_gateSeconds", 0)))
    target = rel["target"]["source"]
    tok_of = w.get("tokenizerOf", target if rel["draft"].get("drafter") else draft)
    compatible = rel["draft"].get("drafter") is not None or tok_of == target or "tokenizerOf" not in w
    th = rel["gating"]["thresholds"]
    reasons = []
    verdict = {
        "tokenizer": {"compatible": compatible, "notes": [],
                      "differences": [] if compatible else [f"vocab of {draft} differs from {target} (49152 vs 32000 ids)"],
                      "targetFingerprint": fingerprint(target),
                      "draftFingerprint": fingerprint(tok_of) if rel["draft"].get("source") else None},
        "mlflowRunId": None, "device": "cpu",
    }
    if not compatible:
        reasons.append("tokenizer mismatch: " + verdict["tokenizer"]["differences"][0])
    else:
        verdict.update(greedyIdentity=1.0, acceptanceRate=w["acceptanceRate"], speedup=w["speedup"],
                       meanAcceptanceLength=1 + w["acceptanceRate"] * rel["speculation"]["k"],
                       categories={c: {"acceptanceRate": r} for c, r in w["categories"].items()},
                       acceptancePerPosition=[w["acceptanceRate"] ** (i + 1) for i in range(rel["speculation"]["k"])],
                       kSweep=[{"k": k, "speedup": w["speedup"] * (0.9 + 0.05 * k)} for k in (2, 3, 4)],
                       bestSpeculation={"k": 4, "batchSizeThreshold": rel["speculation"]["batchSizeThreshold"]})
        if not speculation_pays(verdict, th):
            # As the real gate: under the default floor a slower release ships speculation off.
            verdict["bestSpeculation"]["batchSizeThreshold"] = 0
        # The real gate's judgement, in the one wording gate and operator share.
        reasons += threshold_failures(verdict, th)
    verdict.update(passed=not reasons, reasons=reasons)
    # A gate with a bug of its own: these fields written as the world gives them.
    verdict.update(w.get("verdictFields") or {})
    json.dump(verdict, open(a.out, "w"))


if __name__ == "__main__":
    main()
