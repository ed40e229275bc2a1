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
import copy
import json
import os
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import yaml
from tqdm import tqdm

from . import shadow_chapter, traffic
from specpair_operator import manifests, release

from .ladder import PROBE, Ladder, actions, condition, domain_shift_prompts, rollback_prediction

from .cluster import OPERATOR_NAMESPACE, REPO, DemoCluster, model_cache
from .processes import Children, start_mlflow
from .timeline import Sampler, Timeline

NS = "specpair-demo"
GROUP_VERSION = "specpair.io/v1alpha1"
EXAMPLE = REPO / "examples" / "default-pair.yaml"
ENGINE_PORT = 50051


def http_address(grpc_address: str) -> str:
    """The same pod's OpenAI-compatible HTTP API, where the demo's answers are streamed from."""
    return f"{grpc_address.rsplit(':', 1)[0]}:{manifests.HTTP_PORT}"


# The operator's settings for a demo: reconcile every second, short watches.
OPERATOR_ENV = {"SPECPAIR_RECONCILE_INTERVAL": "1", "SPECPAIR_WATCH_TIMEOUT": "60"}
# The drift policy sized for minutes on 2 CPU cores instead of the defaults' hours in production
# (docs/drift.md): read every 2 s; disjoint 10 s windows, each judged only with at least 4
# effective requests (the engine reports per-request sums, so each finished request that drafted
# counts once) and 40 drafted tokens; two breaching windows per ladder step; a probe
# after one quiet window while speculation is off. Tolerance, noise allowance and the 99% bound
# are the defaults.
DRIFT = {"intervalSeconds": 2, "windowSeconds": 10, "minRequests": 4, "minDraftedTokens": 40,
         "consecutiveBreaches": 2, "probeAfterWindows": 1, "tolerance": 0.2, "noiseAllowance": 0.02,
         "confidenceZ": 2.33}


def at_least_one(text: str) -> int:
    """--drift-breaches: a whole number the CRD admits (its minimum is 1)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is below 1, the least drift.consecutiveBreaches admits")
    return n


def drift_policy(args: argparse.Namespace) -> dict[str, Any]:
    """DRIFT with the breaching windows per ladder step of --drift-breaches."""
    return {**DRIFT, "consecutiveBreaches": args.drift_breaches}


# Paths a pod mounts volumes at: a model directory under one of them is hidden from the pod
# (in any cluster; devcluster rewrites such paths to the pod's volume folder).
POD_MOUNTS = ("/tmp", manifests.RELEASE_DIR, manifests.CACHE_DIR)


class DemoFailed(Exception):
    pass


def pod_visible(path: Path) -> bool:
    text = str(path.resolve())
    return not any(text == m or text.startswith(m + "/") for m in POD_MOUNTS)


def say(text: str = "") -> None:
    print(text, flush=True)


def step(n: int, total: int, title: str) -> None:
    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
    say(f"\n{bold}[{n}/{total}] {title}{plain}")


# -- the pair -----------------------------------------------------------------------------------

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
                      "maxNewTokens": args.gate_tokens, "thresholds": {"requireGreedyIdentity": True}}
    # The engine's own fallback (target-only below 0.5 running acceptance) is off, so what the
    # drift chapter shows is the operator's decision alone, made on the counters it reads.
    spec["speculation"] = {"fallbackThreshold": 0.0}
    spec["rollout"] = {"progressDeadlineSeconds": 1200}
    spec["drift"] = drift_policy(args)
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
    spec["gating"]["thresholds"] = {"requireGreedyIdentity": True, "minCategoryAcceptance": {"extraction": 0.2}}
    spec["speculation"] = {**spec.get("speculation", {}), "k": 8, "dynamicK": False}
    return spec, ("golden prompts become the team's document work only (extraction of dates, summarisation), "
                  "and the n-gram drafter proposes a fixed k tokens a round (k 8, dynamic k off; the gate's "
                  "tuning picks the k it serves with), rolled out by Replace")


def gated_categories(spec: dict[str, Any]) -> set[str]:
    return {p["category"] for p in spec["gating"]["prompts"]}


def shift_prompts(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """Traffic in a category the release's gate never measured."""
    gated = gated_categories(spec)
    for pool in (traffic.CREATIVE, traffic.COPYING):
        found = [(c, p) for c, p in pool if c not in gated]
        if found:
            return found
    raise DemoFailed("every category of the demo's traffic is gated")


# -- waiting, with progress ----------------------------------------------------------------------

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

    # -- the story -----------------------------------------------------------------------------

    def run(self) -> Path:
        a = self.args
        total = 8 if a.no_shadow else 9
        step(1, total, "Starting a real Kubernetes control plane (devcluster), MLflow, and the operator from its helm chart")
        t0 = time.monotonic()
        # MLflow starts while the control plane does: neither needs the other until the operator is installed.
        mlflow = ThreadPoolExecutor(1, thread_name_prefix="mlflow")
        mlflow_url = mlflow.submit(start_mlflow, self.children, self.workdir)
        mlflow.shutdown(wait=False)
        self.cluster = DemoCluster(self.workdir / "cluster", NS, os.environ.get("OMP_NUM_THREADS", "1"))
        try:
            self.cluster.start()
        finally:
            mlflow_url.exception()   # waits for it, on errors too: close() stops what it started
        self.mlflow_url = mlflow_url.result()
        say(f"  Kubernetes        {self.cluster.cluster.server}  etcd, kube-apiserver, controller-manager, scheduler; "
            f"node demo-node-1 ({time.monotonic() - t0:.0f} s)")
        say(f"                    KUBECONFIG={self.cluster.kubeconfig}")
        say(f"  MLflow            {self.mlflow_url}  (sqlite: {self.workdir / 'mlflow.db'})")
        t0 = time.monotonic()
        self.cluster.install_operator(self.mlflow_url, OPERATOR_ENV)
        pod = self.cluster.wait_operator_ready(a.step_timeout)
        deadline = time.monotonic() + 60
        while not self.cluster.crd_served():
            if time.monotonic() > deadline:
                raise DemoFailed("the SpecModelPair CRD was not served 60 s after helm installed it")
            time.sleep(0.3)
        say(f"  operator          helm release '{OPERATOR_NAMESPACE}/specpair' (charts/specpair), pod "
            f"{pod['metadata']['name']} at {pod['status']['podIP']}, Ready ({time.monotonic() - t0:.0f} s)")

        self.stage_models()
        pair = demo_pair(a)
        target, draft = pair["spec"]["target"], pair["spec"]["draft"]
        step(2, total, "Applying the default SpecModelPair (target "
             + ("embedded SmolLM2-135M" if target.get("source") == "default" else target.get("source"))
             + ", " + (f"{draft['drafter']} drafter" if draft.get("drafter") else f"draft {draft.get('source')}") + ")")
        self.name = pair["metadata"]["name"]
        (self.workdir / "pair-v1.yaml").write_text(yaml.safe_dump(pair, sort_keys=False))
        self.cluster.create_pair(pair)
        self.sampler = Sampler(self.timeline, self.address, self.pair)
        self.sampler.start()
        self.timeline.mark("v1 applied")
        obj = self.wait("v1", ROLLOUT_STAGES, lambda o: rollout_stage(o, "1"), a.step_timeout)
        self.show_release(obj, "1")

        step(3, total, "Streaming answers from the engine pod over gRPC (each also decoded target-only for the speedup)")
        self.converse("v1", traffic.COPYING[:a.answers])

        v2_spec, what = second_release(pair, a, self.models)
        step(4, total, f"Shipping a second release: {what}")
        self.cluster.patch_pair_spec(self.name, v2_spec)
        self.timeline.mark("v2 applied")
        obj = self.wait("v2", ROLLOUT_STAGES, lambda o: rollout_stage(o, "2"), a.step_timeout)
        self.show_release(obj, "2")
        self.converse("v2", traffic.COPYING[:1])

        shifted = shift_prompts(v2_spec)
        step(5, total, f"Traffic shift: requests in '{shifted[0][0]}', a category v2's gate never measured")
        self.traffic_shift(v2_spec, shifted)

        if a.draft:
            step(6, total, "A bad draft: v2's draft files are overwritten with noise and its pod is deleted")
            self.bad_draft()
        else:
            shifted = self.shift_category()
            step(6, total, f"Domain shift: requests labelled '{shifted}', a category both gates measured, "
                           "whose content is free-form writing with nothing to copy")
            self.domain_shift(shifted)

        n = 7
        if not a.no_shadow:
            st = (self.pair() or {}).get("status") or {}
            step(n, total, f"Shadow scoring: a candidate that changes only the draft side (k {shadow_chapter.CANDIDATE_K}"
                           + (", v2's noisy draft files" if a.draft else
                              f", a draft model of the target's first {shadow_chapter.LAYER_SKIP_LAYERS} layers "
                              "in place of n-gram lookup")
                           + f") is scored on v{st.get('servingVersion')}'s pods on live traffic")
            self.shadow()
            n += 1

        st = (self.pair() or {}).get("status") or {}
        step(n, total, f"After the {'drift chapter' if a.no_shadow else 'drift and shadow chapters'}: v{st.get('servingVersion')} "
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

    def traffic_shift(self, v2_spec: dict[str, Any], shifted: list[tuple[str, str]]) -> None:
        """Requests in a category v2 was never gated on, mixed with its gated document work. The
        operator counts them in status.live.trafficShift and judges only the gated categories."""
        a = self.args
        gated = sorted(gated_categories(v2_spec))
        documents = [(c, p) for c, p in traffic.COPYING if c in gated] or traffic.COPYING[:1]
        mix = [x for pair in zip(shifted, documents * len(shifted)) for x in pair]
        before = len(actions(self.pair()))
        self.timeline.mark(f"traffic shift: {shifted[0][0]}")
        t0 = time.monotonic()
        stop, sent = threading.Event(), [0]
        sender = self.flood("traffic shift", mix, stop, sent)
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
            obj = self.wait("traffic shift", stages, progress, a.step_timeout)
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
            f" vs gated {((self.facts.get('verdicts') or {}).get('2') or {}).get('categories') and {c: round(v.get('acceptanceRate', 0), 3) for c, v in self.facts['verdicts']['2']['categories'].items()}}")
        say(f"  Drifted={drifted.get('status', '-')} {drifted.get('reason', '')}: {drifted.get('message', '')}")
        say(f"  operator actions: {', '.join(new) or 'none'}; phase {st.get('phase')}, serving v{st.get('servingVersion')}, "
            f"speculation {'on' if st.get('speculationEnabled', True) else 'off'}")
        self.facts["drift"]["trafficShift"] = {
            "category": shift_cat, "requests": sent[0], "seconds": round(time.monotonic() - t0, 1),
            "trafficShift": live.get("trafficShift"), "liveAcceptance": live.get("acceptance"),
            "drifted": drifted, "actions": new, "speculationEnabled": st.get("speculationEnabled", True)}

    def bad_draft(self) -> None:
        self.check_speculating()
        degrade_draft(self.models / "draft-v2")
        deleted = self.cluster.delete_engine_pods(self.name)
        say(f"  draft files overwritten; deleted pod {', '.join(deleted)} (its Deployment makes a new one)")
        documents = [(c, p) for c, p in traffic.COPYING if c in gated_categories(self.pair()["spec"])] \
            or traffic.COPYING[:1]
        self.drift_ladder("bad draft", "bad draft: files overwritten, pod deleted", documents)

    def shift_category(self) -> str:
        """The category the domain shift is labelled with: one both releases were gated on (so
        the rollback rule has both gated numbers to weigh), where the answer copies the document."""
        verdicts = self.facts.get("verdicts") or {}
        now = set((verdicts.get("2") or {}).get("categories") or {})
        both = [c for c, _ in traffic.COPYING if c in now and c in ((verdicts.get("1") or {}).get("categories") or {})]
        if not both:
            raise DemoFailed(f"no category was gated by both releases (v2: {sorted(now)})")
        return both[0]

    def domain_shift(self, category: str) -> None:
        """Live traffic in a gated category that comes from another domain: the n-gram drafter
        finds nothing to copy, live acceptance falls below what the gate measured, and the
        operator climbs its drift ladder. Whether it may roll back is the rule's call on the two
        gates' numbers; the demo says which before it starts and shows what happened."""
        verdicts = self.facts.get("verdicts") or {}
        possible, why = rollback_prediction(self.facts["drift"]["policy"], verdicts.get("2"), verdicts.get("1"), category)
        v2 = ((verdicts.get("2") or {}).get("categories") or {}).get(category, {}).get("acceptanceRate")
        best = (verdicts.get("2") or {}).get("bestSpeculation") or {}
        say(f"  v2 was gated at {v2:.0%} on '{category}' and serves at k {best.get('k')} (dynamic k off); "
            "the same label now carries poems and stories")
        say(f"  the operator's rule, from the two gates: {why}")
        self.facts["drift"]["domainShift"] = {"category": category, "gatedV2": v2,
                                              "gatedV1": ((verdicts.get("1") or {}).get("categories") or {})
                                              .get(category, {}).get("acceptanceRate"),
                                              "rollbackPossible": possible, "prediction": why}
        self.check_speculating()
        ladder = self.drift_ladder("domain shift", f"domain shift: '{category}' carries free-form writing",
                                   domain_shift_prompts(category))
        if ladder.rolled_back:
            say("  v1 serves again: its gate measured this category higher, and live acceptance fell below its "
                "floor as well, so the rule judged that rolling back helps. v1 drafts with the same n-gram "
                "drafter, so on these requests it still has little to copy (its k adapts to acceptance, so it "
                "wastes fewer drafts than v2's fixed k): acceptance alone cannot tell a change of content inside a gated category from a "
                "broken release (docs/drift.md, Limits). Label such traffic with its own category (counted, not "
                "judged, as in step 5) or gate on it.")
        else:
            say("  no rollback: the operator keeps v2 serving target-only and goes on probing; its reason is in "
                "the Drifted condition above. Label such traffic with its own category (counted, not judged, as "
                "in step 5) or gate on it.")

    def check_speculating(self) -> None:
        best = (self.facts.get("verdicts", {}).get("2") or {}).get("bestSpeculation") or {}
        if best.get("batchSizeThreshold") == 0:
            raise DemoFailed("v2's gate tuning switched speculation off, so there is no acceptance to drift")

    def drift_ladder(self, chapter: str, mark: str, prompts: list[tuple[str, str]]) -> Ladder:
        """Send `prompts` to whichever pod serves until the operator has made its rollback
        decision, following the ladder on the pair's status (demo/ladder.py); every stage goes
        into the timeline and the report."""
        a = self.args
        obj = self.pair() or {}
        ladder = Ladder(len(actions(obj)), str((obj.get("status") or {}).get("previousVersion") or "1"))
        self.timeline.mark(f"drift: {mark}")
        stop, sent = threading.Event(), [0]
        sender = self.flood("drift", prompts, stop, sent)

        def progress(o: dict[str, Any] | None) -> int:
            n = ladder.update(o)
            if PROBE in ladder.at and not any(label.startswith("probe:") for _, label in self.timeline.marks):
                self.timeline.mark("probe: the operator turns speculation on to measure")
            if ladder.rolled_back is not None:
                # Decided: after a rollback the previous release serves, without one nothing more
                # happens but further probes; the requests can stop.
                stop.set()
            return n

        try:
            self.wait(chapter, ladder.stages, progress, a.step_timeout)
        finally:
            stop.set()
            sender.join(130)
        obj = self.pair() or {}
        st = obj.get("status") or {}
        for h in (st.get("history") or [])[ladder.before:]:
            if h.get("action") in ("SpeculationOff", "RolledBack"):
                say(f"  {h['time']}  {h['action']}: v{h.get('fromVersion')} -> v{h.get('toVersion')}: {h.get('reason')}")
        if ladder.rolled_back is False:
            say(f"  Drifted=RollbackWouldNotHelp: {ladder.decision}")
        drift = [x for label, x in self.answers if label == "drift"]
        drafted = sum(x.drafted for x in drift)
        acceptance = sum(x.accepted for x in drift) / drafted if drafted else None
        say(f"  {sent[0]} requests; acceptance over their drafted tokens "
            f"{acceptance if acceptance is not None else 0:.0%} ({drafted} drafted); "
            + "; ".join(f"{stage} after {t} s" for t, stage in ladder.rows()))
        say(f"  status: phase {st.get('phase')}, serving v{st.get('servingVersion')}: {st.get('message')}")
        self.facts["drift"]["ladder"] = {"chapter": chapter, "requests": sent[0], "drafted": drafted,
                                         "acceptance": acceptance, "rolledBack": ladder.rolled_back,
                                         "decision": ladder.decision, "timeline": ladder.rows()}
        self.timeline.mark("rolled back" if ladder.rolled_back else "no rollback")
        return ladder

    def shadow(self) -> None:
        """Apply a candidate that differs from the champion only on its draft side (the operator
        then chooses Shadow), send document work to whichever pod serves once the champion's pods
        carry the candidate, and show the verdict the operator reaches with its numbers
        (demo/shadow_chapter.py)."""
        a = self.args
        obj = self.pair() or {}
        st = obj.get("status") or {}
        champion = str(st.get("servingVersion"))
        gated = set((((self.facts.get("verdicts") or {}).get(champion) or {}).get("categories")) or {})
        prompts = shadow_chapter.shadow_traffic(gated)
        progress = shadow_chapter.Progress(len(actions(obj)), str(st.get("candidateVersion") or ""))
        draft_source = None
        if not a.draft:
            # The n-gram pair's candidate: a layer-skip draft of the target, where the pods read models.
            from specpair.models import resolve_source

            target = resolve_source(str((obj["spec"].get("target") or {}).get("source") or "default"), progress=say)
            t0 = time.monotonic()
            draft_source = str(shadow_chapter.make_layer_skip_draft(target, self.models / "layer-skip-draft"))
            say(f"  wrote a draft model of the target's first {shadow_chapter.LAYER_SKIP_LAYERS} layers (untrained) "
                f"to {draft_source} ({time.monotonic() - t0:.0f} s)")
        spec = shadow_chapter.candidate_spec(obj["spec"], a.gate_tokens, draft_source)
        say(f"  v{champion} serves; the candidate: k {shadow_chapter.CANDIDATE_K}, draft "
            f"{(spec.get('draft') or {}).get('drafter') or (spec.get('draft') or {}).get('source')}, "
            f"rollout.shadow {json.dumps(shadow_chapter.SHADOW)}; gated on one '{prompts[0][0]}' prompt")
        self.cluster.patch_pair_spec(self.name, spec)
        self.timeline.mark("shadow: candidate applied")
        stop, sent, failed = threading.Event(), [0], [0]
        sender: list[threading.Thread] = []

        def reached(o: dict[str, Any] | None) -> int:
            try:
                n = progress.update(o)
            except ValueError as exc:
                raise DemoFailed(str(exc)) from None
            if n >= 3 and not sender and progress.result is None:
                self.timeline.mark(f"shadow: v{progress.version} scored on live traffic")
                # Twice the answers' length: more scored positions per request, whose own costs
                # (the HTTP call, the prefill) dominate on small models.
                sender.append(self.flood("shadow", prompts, stop, sent, failed, 2 * a.max_new_tokens))
            return n

        t0 = time.monotonic()
        try:
            self.wait("shadow", shadow_chapter.STAGES, reached, a.step_timeout)
        finally:
            stop.set()
            for thread in sender:
                thread.join(130)
        obj = self.pair() or {}
        st = obj.get("status") or {}
        version = progress.version or "?"
        scored = condition(obj, "ShadowScored")
        shadow = st.get("shadow") or {}
        self.show_release(obj, version)
        say(f"  ShadowScored={scored.get('status', '-')} {scored.get('reason', '')}: {scored.get('message', '')}")
        for row in shadow_chapter.numbers_rows(shadow):
            say("    {}: candidate alpha {}, champion alpha {}, difference {}, {} requests: {}".format(*row))
        meaning = shadow_chapter.explain(progress.result, shadow)
        say(f"  v{version} {meaning}")
        say(f"  {sent[0]} requests answered during the shadow, {failed[0]} failed; v{st.get('servingVersion')} "
            f"serving, phase {st.get('phase')}")
        steps = [(t, stage) for what, stage, t in self.facts["steps"] if what == "shadow"]
        self.facts["shadow"] = {"version": version, "champion": champion, "result": progress.result,
                                "meaning": meaning, "condition": scored, "status": shadow, "requests": sent[0],
                                "failed": failed[0], "seconds": round(time.monotonic() - t0, 1), "timeline": steps,
                                "servingAfter": st.get("servingVersion")}
        self.timeline.mark(f"shadow: {progress.result}")

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
                                "tokens": a.tokens, "seconds": a.seconds, "error": a.error} for label, a in self.answers]}
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
    ap.add_argument("--out", default=str(REPO / "out" / "demo"), help="where runs (logs, MLflow store, report) go")
    ap.add_argument("--timeout", type=float, default=2700, help="the whole demo's time limit, seconds")
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
