"""The whole specpair loop on one machine, no cluster: `python -m demo.run_demo` (scripts/demo.sh).

A local MLflow server, the Kubernetes API emulator, the real operator (Kopf, as its own
process) and a local runtime that runs gate Jobs and engine pods as processes. The demo applies
the default SpecModelPair (examples/default-pair.yaml: the embedded SmolLM2-135M target drafted
by n-gram prompt lookup), watches it get registered, gated, promoted and served, streams
answers, ships a second release, then drives drift and watches the operator switch speculation
off and roll back. It ends with an HTML report (out/demo/<run>/report.html).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import yaml
from tqdm import tqdm

from . import traffic
from .local_cluster import REPO, LocalApi, LocalRuntime
from .processes import Children, start_mlflow, tail
from .timeline import Sampler, Timeline

NS = "specpair-demo"
GROUP_VERSION = "specpair.io/v1alpha1"
EXAMPLE = REPO / "examples" / "default-pair.yaml"


class DemoFailed(Exception):
    pass


def say(text: str = "") -> None:
    print(text, flush=True)


def step(n: int, total: int, title: str) -> None:
    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
    say(f"\n{bold}[{n}/{total}] {title}{plain}")


# -- the pair -----------------------------------------------------------------------------------

def demo_pair(args: argparse.Namespace, port: int) -> dict[str, Any]:
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
    # prompts keep the gate (with its k and batch sweeps) to a few minutes on 2 CPU cores.
    prompts = traffic.COPYING[:1] + traffic.CREATIVE[:1]
    spec["gating"] = {"prompts": [{"prompt": p, "category": c} for c, p in prompts],
                      "maxNewTokens": args.gate_tokens, "thresholds": {"requireGreedyIdentity": True}}
    spec["rollout"] = {"port": port, "progressDeadlineSeconds": 1200}
    # Judged every 2 s over a 20 s window: minutes in a cluster, seconds in a demo.
    spec["drift"] = {"intervalSeconds": 2, "windowSeconds": 20, "minDraftedTokens": 24,
                     "consecutiveBreaches": 2, "tolerance": 0.1, "noiseAllowance": 0.05}
    return pair


def second_release(pair: dict[str, Any], args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], str]:
    """The spec change that makes v2, and a sentence saying what it is."""
    spec = copy.deepcopy(pair["spec"])
    if args.drift == "degraded-draft":
        # A re-trained draft at a new path (here: a copy, until someone overwrites it).
        new_draft = workdir / "draft-v2"
        shutil.copytree(args.draft, new_draft, dirs_exist_ok=True)
        spec["draft"] = {"source": str(new_draft)}
        return spec, f"the draft moves to {new_draft} (a re-trained draft)"
    # The team's traffic is document work: they re-gate on it alone, with a floor per category.
    spec["gating"]["prompts"] = [{"prompt": p, "category": c} for c, p in (traffic.COPYING[0], traffic.COPYING[2])]
    spec["gating"]["thresholds"] = {"requireGreedyIdentity": True, "minCategoryAcceptance": {"extraction": 0.2}}
    return spec, "golden prompts become the team's document work only (extraction, summarisation)"


# -- waiting, with progress ----------------------------------------------------------------------

def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == type_), {})


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
    gated = condition(obj, "Gated")
    if gated.get("status") == "True" and gated.get("message", "").startswith(f"v{version}:"):
        stage = 3
    if st.get("servingVersion") == version:
        stage = 4
        if st.get("phase") == "RollingOut":
            stage = 5
        if st.get("phase") == "Serving":
            stage = 6
    return stage


class Demo:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.started = time.monotonic()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.workdir = Path(args.out).resolve() / f"run-{stamp}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.children = Children()
        self.timeline = Timeline()
        self.answers: list[tuple[str, traffic.Answer]] = []      # (phase label, answer)
        self.api: LocalApi | None = None
        self.runtime: LocalRuntime | None = None
        self.sampler: Sampler | None = None
        self.operator = None
        self.mlflow_url = ""
        self.name = "default"
        self.port = 0
        self.facts: dict[str, Any] = {"steps": []}

    # -- plumbing ------------------------------------------------------------------------------

    def deadline_check(self) -> None:
        if time.monotonic() - self.started > self.args.timeout:
            raise DemoFailed(f"the demo ran past its time limit of {self.args.timeout:.0f} s")

    def pair(self) -> dict[str, Any] | None:
        return self.api.get(GROUP_VERSION, "SpecModelPair", NS, self.name) if self.api else None

    def check_processes(self) -> None:
        if self.operator is not None and self.operator.poll() is not None:
            raise DemoFailed(f"the operator exited {self.operator.returncode}:\n"
                             f"{tail(self.workdir / 'logs' / 'operator.log')}")
        if self.runtime is not None and self.runtime.errors:
            say(f"  (local runtime: {self.runtime.errors.pop(0)})")

    def wait(self, what: str, stages: list[str], progress: Callable[[dict[str, Any] | None], int],
             timeout: float, during: Callable[[], None] | None = None) -> dict[str, Any]:
        """Wait until progress(pair) reaches len(stages), with a bar over the stages."""
        deadline = time.monotonic() + timeout
        started = time.monotonic()
        # A live bar on a terminal; in a log (CI, tests) one line per stage instead of redraws.
        live = sys.stdout.isatty()
        bar = tqdm(total=len(stages), desc=f"  {what}", bar_format="{desc}: {bar:20} {n}/{total} [{elapsed}]{postfix}",
                   file=sys.stdout, dynamic_ncols=True, disable=not live)
        done = 0
        try:
            while True:
                self.check_processes()
                self.deadline_check()
                obj = self.pair()
                reached = progress(obj)
                if reached > done:
                    bar.update(reached - done)
                    for i in range(done, reached):
                        self.facts["steps"].append((what, stages[i], round(time.monotonic() - started, 1)))
                        if not live:
                            say(f"  {what}: {stages[i]} ({i + 1}/{len(stages)}, {time.monotonic() - started:.0f} s)")
                    done = reached
                activity = "; ".join(v for v in (self.runtime.activity.values() if self.runtime else []) if v)
                bar.set_postfix_str((stages[done - 1] if done else "waiting for the operator")
                                    + (f" | {activity}" if activity else ""), refresh=True)
                if done >= len(stages):
                    return obj
                if time.monotonic() > deadline:
                    st = (obj or {}).get("status") or {}
                    raise DemoFailed(f"{what}: stuck at '{stages[done - 1] if done else 'start'}' after {timeout:.0f} s; "
                                     f"phase {st.get('phase')}: {st.get('message')}")
                if during is not None:
                    during()
                else:
                    time.sleep(0.5)
        finally:
            bar.close()

    # -- the story -----------------------------------------------------------------------------

    def run(self) -> Path:
        a = self.args
        total = 7
        step(1, total, "Starting a local MLflow, the Kubernetes API emulator, the operator and a local kubelet")
        self.mlflow_url = start_mlflow(self.children, self.workdir)
        say(f"  MLflow            {self.mlflow_url}  (sqlite: {self.workdir / 'mlflow.db'})")
        self.api = LocalApi()
        self.api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        kubeconfig = self.api.write_kubeconfig(self.workdir / "kubeconfig", NS)
        say(f"  Kubernetes API    {self.api.url}  (KUBECONFIG={kubeconfig})")
        gate_command = a.gate_command or f"{sys.executable} -m specpair gate --device cpu"
        self.runtime = LocalRuntime(self.api, NS, self.workdir, self.children, gate_command=gate_command)
        self.runtime.start()
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "SPECPAIR_MLFLOW_TRACKING_URI": self.mlflow_url,
               "SPECPAIR_RECONCILE_INTERVAL": "1", "SPECPAIR_WATCH_TIMEOUT": "60"}
        self.operator = self.children.start([sys.executable, "-m", "specpair_operator", "-n", NS, "--liveness", ""],
                                            self.workdir / "logs" / "operator.log", env=env)
        say(f"  operator          pid {self.operator.pid}  (log: {self.workdir / 'logs' / 'operator.log'})")

        from .processes import free_port
        self.port = free_port()
        pair = demo_pair(a, self.port)
        target, draft = pair["spec"]["target"], pair["spec"]["draft"]
        step(2, total, "Applying the default SpecModelPair (target "
             + ("embedded SmolLM2-135M" if target.get("source") == "default" else target.get("source"))
             + ", " + (f"{draft['drafter']} drafter" if draft.get("drafter") else f"draft {draft.get('source')}") + ")")
        self.name = pair["metadata"]["name"]
        (self.workdir / "pair-v1.yaml").write_text(yaml.safe_dump(pair, sort_keys=False))
        self.api.create(pair)
        self.sampler = Sampler(self.timeline, f"127.0.0.1:{self.port}", self.pair)
        self.sampler.start()
        self.timeline.mark("v1 applied")
        obj = self.wait("v1", ROLLOUT_STAGES, lambda o: rollout_stage(o, "1"), a.step_timeout)
        self.show_release(obj, "1")

        step(3, total, "Streaming answers from the engine over gRPC (each also decoded target-only for the speedup)")
        # Document work only: the drift policy also judges overall acceptance over a 20 s window,
        # and a lone creative answer in that window would (rightly) read as drift.
        self.converse("v1", traffic.COPYING[:a.answers])

        v2_spec, what = second_release(pair, a, self.workdir)
        step(4, total, f"Shipping a second release: {what}")
        self.api.patch(GROUP_VERSION, "SpecModelPair", NS, self.name, {"spec": v2_spec})
        self.timeline.mark("v2 applied")
        obj = self.wait("v2", ROLLOUT_STAGES, lambda o: rollout_stage(o, "2"), a.step_timeout)
        self.show_release(obj, "2")
        self.converse("v2", traffic.COPYING[:1])

        step(5, total, "Drift: " + ("the draft's files are overwritten with a degraded model and the pod restarts"
                                    if a.drift == "degraded-draft" else
                                    "traffic turns creative, which the n-gram drafter cannot predict"))
        self.drift()

        step(6, total, "After the rollback: v1 serves again, with speculation on")
        self.converse("after rollback", traffic.COPYING[1:2])

        step(7, total, "Report")
        self.sampler.stop()
        obj = self.pair() or {}
        self.timeline.history = list((obj.get("status") or {}).get("history") or [])
        report = self.write_report(obj)
        self.write_summary(obj)
        say(f"  report            {report}")
        say(f"  MLflow UI         {self.mlflow_url}/#/models/{self.model_name(obj)}")
        return report

    def model_name(self, obj: dict[str, Any]) -> str:
        return ((obj.get("spec") or {}).get("mlflow") or {}).get("modelName") or f"{NS}-{self.name}"

    def show_release(self, obj: dict[str, Any], version: str) -> None:
        from mlflow import MlflowClient

        client = MlflowClient(self.mlflow_url)
        model = self.model_name(obj)
        mv = client.get_model_version(model, version)
        aliases = client.get_registered_model(model).aliases
        verdict = json.loads(mv.tags.get("specpair.gate.verdict", "{}"))
        self.facts.setdefault("verdicts", {})[version] = verdict
        cats = ", ".join(f"{c} {v.get('acceptanceRate', 0):.0%}" for c, v in (verdict.get("categories") or {}).items())
        say(f"  MLflow model '{model}' v{version}: aliases {dict(sorted(aliases.items()))}")
        say(f"  gate: identity {verdict.get('greedyIdentity')}, acceptance {verdict.get('acceptanceRate', 0):.0%} "
            f"({cats}), speedup {verdict.get('speedup', 0):.2f}x, best {verdict.get('bestSpeculation')}")
        st = obj.get("status") or {}
        say(f"  status: phase {st.get('phase')}, serving v{st.get('servingVersion')}, "
            f"previous v{st.get('previousVersion') or '-'}: {st.get('message')}")
        say(f"  {self.mlflow_url}/#/models/{model}/versions/{version}")

    def converse(self, label: str, prompts: list[tuple[str, str]]) -> None:
        address = f"127.0.0.1:{self.port}"
        for category, prompt in prompts:
            self.deadline_check()
            dim, plain = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "")
            say(f"  {dim}> {prompt.splitlines()[0][:90]}{plain}")
            sys.stdout.write("    ")
            answer = traffic.ask(address, category, prompt, self.args.max_new_tokens,
                                 on_text=traffic.stream_to_terminal)
            say()
            say(traffic.describe(answer))
            self.answers.append((label, answer))

    def drift(self) -> None:
        a = self.args
        address = f"127.0.0.1:{self.port}"
        best = (self.facts.get("verdicts", {}).get("2") or {}).get("bestSpeculation") or {}
        if best.get("batchSizeThreshold") == 0:
            # The gate found speculation slower even for one request on this machine (timing
            # noise on a busy CPU can do that), so v2 serves target-only: nothing can drift.
            raise DemoFailed("v2's gate measured no speedup at batch size 1 on this machine "
                             f"({(self.facts['verdicts']['2'].get('batchSweep') or [{}])[0]}), so the operator "
                             "serves it target-only and there is no acceptance to drift; run again on a quieter machine")
        if a.drift == "degraded-draft":
            degrade_draft(Path(self.workdir / "draft-v2"), self.args.target)
            self.runtime.restart_pod(f"{self.name}-engine")
            prompts = traffic.COPYING
        else:
            prompts = traffic.CREATIVE
        self.timeline.mark("drift: " + ("v2's draft overwritten, pod restarted" if a.drift == "degraded-draft"
                                        else "creative traffic"))
        stop = threading.Event()
        sent = [0]

        def send() -> None:
            i = 0
            while not stop.is_set():
                category, prompt = prompts[i % len(prompts)]
                ans = traffic.ask(address, category, prompt, a.max_new_tokens, compare=False, timeout=120)
                if not ans.error:
                    self.answers.append(("drift", ans))
                    sent[0] += 1
                else:
                    time.sleep(1)
                i += 1

        sender = threading.Thread(target=send, name="drift-traffic", daemon=True)
        sender.start()
        stages = ["live acceptance below the gated baseline", "speculation switched off", "rolled back to v1",
                  "v1 serving, identity verified"]

        def ladder(obj: dict[str, Any] | None) -> int:
            st = (obj or {}).get("status") or {}
            actions = [h.get("action") for h in st.get("history") or []]
            n = 0
            if condition(obj or {}, "Drifted").get("status") == "True" or "SpeculationOff" in actions:
                n = 1
            if "SpeculationOff" in actions:
                n = 2
            if "RolledBack" in actions:
                n = 3
                if st.get("servingVersion") == "1" and not self.runtime.rolling and st.get("phase") in ("Degraded", "Serving"):
                    n = 4
            return n

        def stop_traffic_after_rollback(obj: dict[str, Any] | None) -> int:
            reached = ladder(obj)
            if reached >= 3:
                # v1 was gated on mixed traffic; the demo stops the creative flood here so what
                # follows shows v1 serving, not a second drift.
                stop.set()
            return reached

        try:
            self.wait("drift", stages, stop_traffic_after_rollback, a.step_timeout)
        finally:
            stop.set()
            sender.join(130)
        obj = self.pair() or {}
        st = obj.get("status") or {}
        for h in st.get("history") or []:
            if h.get("action") in ("SpeculationOff", "RolledBack"):
                say(f"  {h['time']}  {h['action']}: v{h.get('fromVersion')} -> v{h.get('toVersion')}: {h.get('reason')}")
        say(f"  {sent[0]} drift requests sent; status: phase {st.get('phase')}, serving v{st.get('servingVersion')}: "
            f"{st.get('message')}")
        self.timeline.mark("rolled back")

    def write_report(self, obj: dict[str, Any]) -> Path:
        from .report import write_report

        return write_report(self.workdir / "report.html", obj, self.timeline, self.answers,
                            self.facts.get("verdicts", {}), self.mlflow_url, self.model_name(obj),
                            time.monotonic() - self.started)

    def write_summary(self, obj: dict[str, Any]) -> Path:
        """The run's outcome as JSON, for scripts and the smoke test."""
        drift = [a for label, a in self.answers if label == "drift"]
        drafted = sum(a.drafted for a in drift)
        summary = {"status": obj.get("status") or {}, "verdicts": self.facts.get("verdicts", {}),
                   "enginePort": self.port, "mlflow": self.mlflow_url, "seconds": round(time.monotonic() - self.started, 1),
                   "steps": self.facts["steps"],
                   "drift": {"requests": len(drift), "drafted": drafted,
                             "acceptance": sum(a.accepted for a in drift) / drafted if drafted else None},
                   "answers": [{"when": label, "category": a.category, "acceptance": a.acceptance, "speedup": a.speedup,
                                "tokens": a.tokens, "seconds": a.seconds, "error": a.error} for label, a in self.answers]}
        path = self.workdir / "summary.json"
        path.write_text(json.dumps(summary, indent=1))
        return path

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
        if self.runtime is not None:
            self.runtime.stop()
        self.children.stop_all()
        if self.api is not None:
            self.api.stop()


def degrade_draft(path: Path, target: str | None) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m demo.run_demo", description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="target model source (default: the pair's, 'default')")
    ap.add_argument("--draft", default=None, help="a draft model directory instead of the n-gram drafter")
    ap.add_argument("--drift", choices=["creative", "degraded-draft"], default=None,
                    help="how drift is driven (default: creative traffic for n-gram, degraded-draft for a draft model)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens per streamed answer")
    ap.add_argument("--gate-tokens", type=int, default=16, help="tokens per golden prompt at the gate")
    ap.add_argument("--answers", type=int, default=2, help="document-work answers streamed after v1 serves")
    ap.add_argument("--out", default=str(REPO / "out" / "demo"), help="where runs (logs, MLflow store, report) go")
    ap.add_argument("--timeout", type=float, default=1800, help="the whole demo's time limit, seconds")
    ap.add_argument("--step-timeout", type=float, default=900, help="one step's time limit, seconds")
    ap.add_argument("--gate-command", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--keep", action="store_true", help="keep MLflow (and the rest) running until Ctrl-C")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.drift is None:
        args.drift = "degraded-draft" if args.draft else "creative"
    if args.drift == "degraded-draft" and not args.draft:
        build_parser().error("--drift degraded-draft needs --draft DIR")
    # One thread per process: the demo runs several torch processes side by side, and OpenMP
    # threads that outnumber free cores spin-wait (measured here: 3.5x slower decoding with 2).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    demo = Demo(args)

    def interrupted(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    code = 0
    try:
        demo.run()
        say(f"\nDone in {time.monotonic() - demo.started:.0f} s. Logs: {demo.workdir / 'logs'}")
        if args.keep:
            say(f"MLflow UI stays up at {demo.mlflow_url} (Ctrl-C to stop everything)")
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        say("\nstopping")
        code = 0 if args.keep else 130
    except DemoFailed as exc:
        say(f"\ndemo failed: {exc}\nlogs: {demo.workdir / 'logs'}")
        code = 1
    finally:
        demo.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
