"""The whole specpair loop on one machine: `python -m demo.run_demo` (scripts/demo.sh).

A real Kubernetes control plane (devcluster: etcd, kube-apiserver, controller-manager,
scheduler, and a node that runs pods as local processes), a local MLflow server, and the
operator installed by the real helm chart (its Deployment's pod, with the chart's RBAC). The
demo applies the default SpecModelPair (examples/default-pair.yaml: the embedded SmolLM2-135M
target drafted by n-gram prompt lookup), watches it get registered, gated (a real Job), promoted
and served (a real Deployment), streams answers, ships a second release, then drives the drift
chapter: a traffic shift the operator reports and leaves alone, then acceptance that drifts in a
gated category, which it switches off, probes and rolls back on evidence: with the n-gram
drafter a domain shift (requests labelled as document work whose content is free-form writing),
with a draft model a draft gone bad. Then a candidate that changes only the draft side is scored
in shadow on the champion's pods while they serve, and promoted or rejected on that live evidence.
It ends with an HTML report (out/demo/<run>/report.html).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from . import learning, shadow_chapter, traffic
from .chapters import drift, releases, shadow, start, traffic_shift
from .chapters import learning as learning_chapter
from .cluster import REPO
from .session import Session
from .settings import DRIFT, DemoFailed, at_least_one, learning_on, say, step


class Demo(Session):
    def run(self) -> Path:
        """The story, chapter by chapter (demo/chapters/)."""
        a = self.args
        # The shadow chapter's place is the learning loop's where it runs: the learned draft is
        # scored in shadow there (on the live shifted traffic, and promoted on that evidence).
        loop = learning_on(a)
        total = 8 if a.no_shadow and not loop else 9
        step(1, total, "Starting a real Kubernetes control plane (devcluster), MLflow, and the operator from its helm chart")
        start.run(self)
        pair = releases.first_release(self, total)
        v2_spec = releases.second(self, pair, total)

        shifted = traffic_shift.shift_prompts(v2_spec)
        step(5, total, f"Traffic shift: requests in '{shifted[0][0]}', a category v2's gate never measured")
        traffic_shift.run(self, v2_spec, shifted)

        if a.draft:
            step(6, total, "A bad draft: v2's draft files are overwritten with noise and its pod is deleted")
            drift.bad_draft(self)
        else:
            category = drift.shift_category(self)
            step(6, total, f"Domain shift: requests labelled '{category}', a category both gates measured, "
                           "whose content is free-form writing with nothing to copy")
            ladder = drift.domain_shift(self, category)
            if loop and ladder.rolled_back is False:
                st = (self.pair() or {}).get("status") or {}
                version = str(st.get("servingVersion"))
                step(7, total, f"Learning from the shift: the operator trains a drafter (an EAGLE-3 head) for "
                               f"'{category}' on the traffic v{version}'s pods captured, gates it, scores it in "
                               "shadow on the live shifted traffic and promotes it")
                learning_chapter.run(self, version, category)
            elif loop:
                say("  (no learning loop: the operator rolled back, and only a category that no rollback "
                    "helps is trained for)")

        n = 7
        if loop:
            n = 8
        elif not a.no_shadow:
            st = (self.pair() or {}).get("status") or {}
            step(n, total, f"Shadow scoring: a candidate that changes only the draft side (k {shadow_chapter.CANDIDATE_K}"
                           + (", v2's noisy draft files" if a.draft else
                              f", a draft model of the target's first {shadow_chapter.LAYER_SKIP_LAYERS} layers "
                              "in place of n-gram lookup")
                           + f") is scored on v{st.get('servingVersion')}'s pods on live traffic")
            shadow.run(self)
            n += 1

        st = (self.pair() or {}).get("status") or {}
        chapters = "drift chapter" if a.no_shadow or loop else "drift and shadow chapters"
        step(n, total, f"After the {chapters}: v{st.get('servingVersion')} "
                       f"serves, speculation {'on' if st.get('speculationEnabled', True) else 'off'}")
        self.converse("after drift", traffic.COPYING[1:2])

        step(n + 1, total, "Report")
        self.sampler.stop()
        obj = self.pair() or {}
        self.timeline.history = list((obj.get("status") or {}).get("history") or [])
        report = self.write_report(obj)
        self.write_summary(obj)
        say(f"  report            {report}")
        say(f"  MLflow UI         {self.mlflow_url}/#/models/{self.model_name(obj)}")
        say(f"  pod logs          {self.cluster.cluster.workdir / 'nodes'}")
        return report


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m demo.run_demo", description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="target model source (default: the pair's, 'default')")
    ap.add_argument("--draft", default=None,
                    help="a draft model directory instead of the n-gram drafter (the drift chapter is then a bad draft)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens per streamed answer")
    ap.add_argument("--gate-tokens", type=int, default=16, help="tokens per golden prompt at the gate")
    ap.add_argument("--answers", type=int, default=2, help="document-work answers streamed after v1 serves")
    ap.add_argument("--shift-requests", type=int, default=4,
                    help="requests (ungated category and gated document work, alternating) of the traffic shift")
    ap.add_argument("--shift-seconds", type=float, default=45,
                    help="the traffic shift goes on at most this long waiting for a gated window to be judged")
    ap.add_argument("--drift-breaches", type=at_least_one, default=DRIFT["consecutiveBreaches"],
                    help="breaching drift windows before each ladder step (the pair's drift.consecutiveBreaches)")
    ap.add_argument("--no-shadow", action="store_true",
                    help="leave out the shadow chapter (its candidate's gate alone takes 35-135 s with tiny models "
                         "on 2 busy cores)")
    ap.add_argument("--no-learning", action="store_true",
                    help="end the domain shift chapter at the drift ladder (a rollback to v1), without the "
                         "operator's learning loop (spec.learning: its training Job, the learned draft's gate, "
                         "shadow and promotion take 15-30 min on 2 busy cores), and run the shadow chapter")
    ap.add_argument("--training-steps", type=at_least_one, default=learning.TRAINING["steps"],
                    help="steps of the learning loop's training Job (default: the bench's 300; fewer for a "
                         "shorter run)")
    ap.add_argument("--out", default=str(REPO / "out" / "demo"), help="where runs (logs, MLflow store, report) go")
    ap.add_argument("--timeout", type=float, default=5400, help="the whole demo's time limit, seconds")
    ap.add_argument("--step-timeout", type=float, default=900, help="one step's time limit, seconds")
    ap.add_argument("--keep", action="store_true", help="keep MLflow (and the rest) running until Ctrl-C")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # One thread per process: the demo runs several torch processes side by side, and OpenMP
    # threads that outnumber free cores spin-wait (measured here: 3.5x slower decoding with 2).
    # The devcluster node hands the same setting to every pod it runs.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    demo = Demo(args)

    def interrupted(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    code = 0
    try:
        demo.run()
        say(f"\nDone in {demo.elapsed():.0f} s. Run folder: {demo.workdir}")
        if args.keep:
            say(f"MLflow UI stays up at {demo.mlflow_url}, the cluster at KUBECONFIG={demo.cluster.kubeconfig} "
                "(Ctrl-C to stop everything)")
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        say("\nstopping")
        code = 0 if args.keep else 130
    except (DemoFailed, RuntimeError) as exc:
        say(f"\ndemo failed: {exc}\nrun folder (pod logs under cluster/nodes/): {demo.workdir}")
        code = 1
    finally:
        demo.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
