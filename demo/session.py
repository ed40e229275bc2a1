"""What every chapter of the demo works through: one run's folder, cluster, MLflow, answers and
facts, and the plumbing to wait on the pair's status with progress, stream answers and keep
traffic flowing. The chapters (demo/chapters/) are functions of a Session; run_demo.py tells them
in order."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from specpair_operator.release import content as release

from . import traffic
from .cluster import DemoCluster, model_cache
from .processes import Children
from .settings import ENGINE_PORT, NS, DemoFailed, drift_policy, http_address, pod_visible, say
from .timeline import Sampler, Timeline


class Session:
    """One run of the demo: its folder, children, cluster, MLflow URL, answers and facts."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.started = time.monotonic()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.workdir = Path(args.out).resolve() / f"run-{stamp}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.children = Children()
        self.timeline = Timeline()
        self.answers: list[tuple[str, traffic.Answer]] = []      # (phase label, answer)
        self.cluster: DemoCluster | None = None
        self.sampler: Sampler | None = None
        self.mlflow_url = ""
        self.name = "default"
        self.facts: dict[str, Any] = {"steps": [], "drift": {"policy": drift_policy(args)}, "engineAddresses": []}
        # Model directories the pods read: somewhere a pod sees them (not under /tmp).
        self.models = self.workdir / "models" if pod_visible(self.workdir) else \
            Path(model_cache()) / "demo-models" / self.workdir.name

    def stage_models(self) -> None:
        """Copy --target/--draft directories a pod could not see into self.models."""
        for attr in ("target", "draft"):
            src = getattr(self.args, attr)
            if src and Path(src).is_dir() and not pod_visible(Path(src)):
                dest = self.models / attr
                shutil.copytree(src, dest, dirs_exist_ok=True)
                setattr(self.args, attr, str(dest))

    # -- plumbing ------------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def deadline_check(self) -> None:
        if self.elapsed() > self.args.timeout:
            raise DemoFailed(f"the demo ran past its time limit of {self.args.timeout:.0f} s")

    def pair(self) -> dict[str, Any] | None:
        return self.cluster.pair(self.name) if self.cluster else None

    def address(self) -> str | None:
        address = self.cluster.engine_address(self.name, ENGINE_PORT) if self.cluster else None
        if address and address not in self.facts["engineAddresses"]:
            self.facts["engineAddresses"].append(address)
        return address

    def check_cluster(self) -> None:
        if self.cluster is None:
            return
        if self.cluster.operator_restarts():
            raise DemoFailed(f"the operator's container restarted:\n{self.cluster.operator_log()[-3000:]}")
        errors = self.cluster.node_errors()
        if errors:
            say(f"  (devcluster node: {errors[-1]})")
            errors.clear()

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
                self.check_cluster()
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
                if live:
                    activity = self.cluster.activity() if self.cluster else ""
                    bar.set_postfix_str((stages[done - 1] if done else "waiting for the operator")
                                        + (f" | {activity}" if activity else ""), refresh=True)
                if done >= len(stages):
                    return obj
                if time.monotonic() > deadline:
                    st = (obj or {}).get("status") or {}
                    raise DemoFailed(f"{what}: stuck at '{stages[done - 1] if done else 'start'}' after {timeout:.0f} s; "
                                     f"phase {st.get('phase')}: {st.get('message')}; pods: {self.cluster.activity()}")
                if during is not None:
                    during()
                else:
                    time.sleep(0.5)
        finally:
            bar.close()

    def model_name(self, obj: dict[str, Any]) -> str:
        return ((obj.get("status") or {}).get("modelName") or ((obj.get("spec") or {}).get("mlflow") or {}).get("modelName")
                or release.effective_model_name(self.name, NS, obj.get("spec") or {}))

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
        if verdict.get("speculationOff"):
            say(f"  shipped with speculation off: {verdict['speculationOff']}")
        st = obj.get("status") or {}
        pods = [f"{p['metadata']['name']} ({p['status'].get('podIP')})" for p in self.cluster.engine_pods(self.name)
                if (p.get("status") or {}).get("podIP")]
        say(f"  status: phase {st.get('phase')}, serving v{st.get('servingVersion')}, "
            f"previous v{st.get('previousVersion') or '-'}: {st.get('message')}")
        say(f"  engine pods: {', '.join(pods)}")
        say(f"  {self.mlflow_url}/#/models/{model}/versions/{version}")

    def converse(self, label: str, prompts: list[tuple[str, str]]) -> None:
        for category, prompt in prompts:
            self.deadline_check()
            address = self.wait_for_address()
            dim, plain = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "")
            say(f"  {dim}> {prompt.splitlines()[0][:90]}{plain}")
            sys.stdout.write("    ")
            answer = traffic.ask(http_address(address), category, prompt, self.args.max_new_tokens,
                                 on_text=traffic.stream_to_terminal)
            say()
            say(traffic.describe(answer))
            self.answers.append((label, answer))

    def wait_for_address(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while True:
            address = self.address()
            if address:
                return address
            if time.monotonic() > deadline:
                raise DemoFailed(f"no ready engine pod for {timeout:.0f} s: {self.cluster.activity()}")
            time.sleep(0.5)

    def flood(self, label: str, prompts: list[tuple[str, str]], stop: threading.Event, sent: list[int],
              failed: list[int] | None = None, max_new_tokens: int | None = None) -> threading.Thread:
        """Send `prompts` round-robin to whichever engine pod is ready, until `stop`; `failed`
        counts the requests that got an error (a pod going away under them)."""
        def send() -> None:
            i = 0
            while not stop.is_set():
                address = self.address()
                if not address:
                    time.sleep(0.5)
                    continue
                category, prompt = prompts[i % len(prompts)]
                ans = traffic.ask(http_address(address), category, prompt, max_new_tokens or self.args.max_new_tokens,
                                  compare=False, timeout=120)
                if not ans.error:
                    self.answers.append((label, ans))
                    sent[0] += 1
                else:
                    if failed is not None:
                        failed[0] += 1
                    time.sleep(0.5)
                i += 1
        thread = threading.Thread(target=send, name=f"{label}-traffic", daemon=True)
        thread.start()
        return thread

    def write_report(self, obj: dict[str, Any]) -> Path:
        from .report import write_report

        return write_report(self.workdir / "report.html", obj, self.timeline, self.answers,
                            self.facts.get("verdicts", {}), self.mlflow_url, self.model_name(obj),
                            self.elapsed(), self.facts["drift"], self.facts.get("shadow"))

    def write_summary(self, obj: dict[str, Any]) -> Path:
        """The run's outcome as JSON, for scripts and the smoke test."""
        drift = [a for label, a in self.answers if label == "drift"]
        drafted = sum(a.drafted for a in drift)
        summary = {"status": obj.get("status") or {}, "verdicts": self.facts.get("verdicts", {}),
                   "engineAddresses": self.facts["engineAddresses"], "mlflow": self.mlflow_url,
                   "seconds": round(self.elapsed(), 1), "steps": self.facts["steps"],
                   "driftChapter": self.facts["drift"], "shadowChapter": self.facts.get("shadow"),
                   "drift": {"requests": len(drift), "drafted": drafted,
                             "acceptance": sum(a.accepted for a in drift) / drafted if drafted else None},
                   "answers": [{"when": label, "category": a.category, "acceptance": a.acceptance, "speedup": a.speedup,
                                "tokens": a.tokens, "seconds": a.seconds, "targetOnlySeconds": a.target_only_seconds,
                                "cachedTokens": [a.cached_tokens, a.target_only_cached_tokens], "error": a.error}
                               for label, a in self.answers]}
        path = self.workdir / "summary.json"
        path.write_text(json.dumps(summary, indent=1))
        return path

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
        if self.cluster is not None:
            try:
                (self.workdir / "operator.log").write_text(self.cluster.operator_log())
            except Exception:  # noqa: BLE001 - the log is a courtesy
                pass
            self.cluster.stop()
        self.children.stop_all()
        if self.models.parent.parent == Path(model_cache()):
            shutil.rmtree(self.models, ignore_errors=True)
