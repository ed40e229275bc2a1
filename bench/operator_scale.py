"""Many pairs on one operator: what it costs to keep them.

Starts its own devcluster (nodes sized to hold the pairs: --pods-per-node, --nodes), a real MLflow
server (--mlflow-workers: the operator registers each pair's release and each gate pod records
its verdict there; its store is one sqlite file, so more workers mostly wait on each other's
locks), the chart (helm, the chart's RBAC) and the operator as a separate process (`kopf run`, as
the chart's Deployment runs it, logged in with the chart's ServiceAccount token), then creates
SpecModelPairs on the stand-in engine image (tests/operator/engine_standin.py: the real gRPC API,
no model; by default every engine pod served by one host process, engine_standin_host.py, so
1,000 pairs fit in memory), waits until every pair is Serving and measures the operator in
steady state. `--pairs 100,500,1000` measures each size in turn on one cluster (pairs are added
to reach the next size, at most --in-flight of them created and not yet Serving at a time, so
that the ones made first get through registration and gating instead of all waiting together;
the load average before and after each window is recorded):

  pairs, time to Serving (per pair, from its creation; p50, p90, max),
  the operator's CPU while the pairs were made and gated, and in steady state: cores, CPU per pair
    per interval (SPECPAIR_RECONCILE_INTERVAL, --interval), passes per second (each pass lists
    the pair's pods once; a full pass also reads its Service: both counted in the audit log) and
    CPU per pass,
  resident memory (VmRSS) at the end of the steady window,
  API requests per second by the operator's ServiceAccount (the API server's audit log), by verb,
  after a restart of the operator (before each size's steady window): how long until it has
    made a full pass over every pair, and its CPU by then,
  and how long deleting them all took;
  and where the CPU of bringing the pairs to Serving went, by component (the API server, etcd,
    the controllers, MLflow, the operator, the pods forked from the nodes' warm python: gate Jobs,
    ...), from /proc of this process's descendants.
With --before-env NAME=VALUE the steady window is measured twice on the same pairs (the first
size only): first with the operator run with those variables, then restarted without them (an
A/B under the same load), e.g. SPECPAIR_WATCHED_READS=0 (full passes GET their children and
LIST their pods instead of reading the watches). With --before-tree REF the "before" operator is
the operator of another commit (`git archive REF`, first on its PYTHONPATH): an A/B of two
versions of the code on the same pairs. --rounds N alternates the two N times (before, after,
before, ...), each window after a restart of the operator, so that a change of load during the
run falls on both sides.

    .venv/bin/python bench/operator_scale.py --pairs 100,500,1000 --json docs/measurements/x.json

Beside other jobs the numbers are noisy (say so where they are recorded). With
--standin-processes each engine pod is a stand-in process of its own (~35 MB each).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "operator")]

PAIRS_PER_NAMESPACE = 50
# How often the pairs are listed while waiting for them to serve (time to Serving is this exact).
POLL_S = 5.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


# Where the CPU of bringing pairs to Serving goes: this process's descendants by what they run
# (first match of the command line), each with the CPU of its children that have ended (gate
# pods, reaped by the node's warm python or its agent).
COMPONENTS = (("operator", "kopf"), ("kube-apiserver", "kube-apiserver"), ("etcd", "etcd"),
              ("controller-manager", "kube-controller-manager"), ("scheduler", "kube-scheduler"),
              ("mlflow", "mlflow"), ("engine stand-ins", "engine_standin"), ("pods (warm python)", "warm_python"))


def component_cpu() -> Counter:
    """CPU seconds (own and reaped children's) of this process's descendants, by COMPONENTS;
    the rest (pods started fresh) as "nodes and other"; this process's own (its node agents)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found: Counter = Counter()
    todo = list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        seconds = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
        found[next((name for name, mark in COMPONENTS if mark in argv), "nodes and other")] += seconds
    # The node agents run as threads of this process (with its own polling of the pairs).
    found["this process (node agents)"] += time.process_time()
    return found


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class AuditTail:
    """The operator's requests from the API server's audit log, from a byte offset on."""

    def __init__(self, path: Path, user: str):
        self.path, self.user = path, user
        self.offset = path.stat().st_size if path.exists() else 0

    def take(self) -> Counter:
        verbs: Counter = Counter()
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            if self.user.encode() not in line:
                continue
            event = json.loads(line)
            if event.get("user", {}).get("username") == self.user:
                ref = event.get("objectRef") or {}
                verbs[f"{event.get('verb')} {ref.get('resource', '')}"] += 1
        return verbs


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if ordered else float("nan")


def steady_window(pid: int, audit: AuditTail, window: float, pairs: int, interval: float,
                  engine_calls: Callable[[], Counter] = Counter, host_pid: int | None = None) -> dict:
    """The operator's CPU, resident memory, API requests and calls to engine pods over `window`
    seconds of steady state; beside them what the stand-ins cost (this process's node agents, the
    stand-in host process)."""
    audit.take()
    calls1 = engine_calls()
    own1, hosted1 = time.process_time(), cpu_seconds(host_pid) if host_pid else 0.0
    cpu1, t1 = cpu_seconds(pid), time.monotonic()
    time.sleep(window)
    cpu2, t2 = cpu_seconds(pid), time.monotonic()
    own2, hosted2 = time.process_time(), cpu_seconds(host_pid) if host_pid else 0.0
    requests = audit.take()
    calls = engine_calls() - calls1
    calls.pop("Check", None)     # the node's readiness and liveness probes, not the operator's
    seconds = t2 - t1
    # In steady state a pass over a serving pair asks its one engine pod for its counters once
    # (GetStats: the drift check is what brings a settled pair's pass), and a full pass also asks
    # it who it is (GetModelInfo; replayed passes take that from the full one's record). Without
    # the watches (SPECPAIR_WATCHED_READS=0) a full pass also lists its pods and reads its
    # Service; with stand-in processes the engines' calls are not counted: the audit log is.
    passes = max(requests["list pods"], calls["GetStats"])
    full = max(requests["get services"], calls["GetModelInfo"])
    return {
        "windowSeconds": round(seconds, 1),
        "operatorCores": round((cpu2 - cpu1) / seconds, 4),
        "cpuMsPerPairPerInterval": round(1000 * (cpu2 - cpu1) / (pairs or 1) / (seconds / interval), 2),
        "passesPerSecond": round(passes / seconds, 2),
        "fullPassesPerSecond": round(full / seconds, 2),
        "cpuMsPerPass": round(1000 * (cpu2 - cpu1) / max(1, passes), 2),
        "rssMB": round(rss_mb(pid), 1),
        "apiRequestsPerSecond": round(sum(requests.values()) / seconds, 2),
        "apiRequestsPerSecondByVerb": {k: round(v / seconds, 2) for k, v in requests.most_common()},
        "engineCallsPerSecondByMethod": {k: round(v / seconds, 2) for k, v in calls.most_common()},
        "nodeAgentsCores": round((own2 - own1) / seconds, 4),
        "standinHostCores": round((hosted2 - hosted1) / seconds, 4) if host_pid else None,
    }


def profile(pid: int, out: Path, seconds: float, native: bool = False) -> dict:
    """py-spy's stacks of the operator over `seconds` (raw: one stack a line, then its samples),
    and the share of samples under each of a few homes of the pass's work. `native`: with C
    frames (py-spy pauses the process for each sample then), so the cyclic garbage collector's
    share shows (gc_collect_main)."""
    spy = shutil.which("py-spy")
    if spy is None:
        return {"skipped": "py-spy is not on PATH"}
    out.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([spy, "record", "--native" if native else "--nonblocking", "--rate", "50", "--duration", str(int(seconds)),
                           "--format", "raw", "--output", str(out), "--pid", str(pid)],
                          capture_output=True, text=True, timeout=seconds + 120)
    if done.returncode != 0 or not out.exists():
        return {"failed": done.stderr[-500:]}
    total, under = 0, Counter()
    homes = ("specpair_operator/observe", "specpair_operator/plan", "specpair_operator/act",
             "specpair_operator/clients", "specpair_operator/release", "specpair_operator/desired",
             "specpair_operator/crd", "grpc", "aiohttp", "mlflow", "kopf", "json", "copy.py", "gc_collect_main")
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        for home in homes:
            if home in stack:
                under[home] += int(count)
    return {"file": out.name, "samples": total,
            "shareUnder": {k: round(v / total, 3) for k, v in under.most_common()} if total else {}}


def git_commit(ref: str) -> str:
    if Path(ref).is_dir():
        return str(ref)
    return subprocess.run(["git", "rev-parse", "--short", ref], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def source_tree(ref: str, dest: Path) -> str:
    """The operator's and engine's packages as commit `ref` has them (git archive), under `dest`
    (or `ref` itself, a folder that holds them: a tree extracted before, for a bench run from a
    snapshot that is no git checkout): the PYTHONPATH that runs that operator ahead of the
    installed (editable) tree."""
    if Path(ref).is_dir():
        dest = Path(ref).resolve()
    else:
        dest.mkdir(parents=True)
        # crds/ too: the operator's CRD file (crd/specmodelpair.crd.yaml, where its defaults are
        # read) is a link into it; without it every pass of that operator raised.
        archive = subprocess.run(["git", "archive", ref, "operator", "engine", "crds"], cwd=REPO,
                                 capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return os.pathsep.join([str(dest / "operator"), str(dest / "engine"),
                            *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])


def time_of_day(hhmm: str) -> float:
    """The next (or current minute's) UTC `hh:mm` as a wall-clock epoch."""
    hours, minutes = (int(x) for x in hhmm.split(":"))
    now = time.time()
    at = now - now % 86400 + hours * 3600 + minutes * 60
    return at if at > now - 60 else at + 86400


def load_average() -> list[float]:
    return [round(x, 1) for x in os.getloadavg()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="100", help="pairs, or sizes measured in turn: 100,500,1000")
    ap.add_argument("--standin-processes", action="store_true",
                    help="each engine pod a stand-in process of its own, not one host process for all")
    ap.add_argument("--pods-per-node", type=int, default=250)
    ap.add_argument("--light-nodes", action=argparse.BooleanOptionalAction, default=True,
                    help="nodes look for a container's exit every 2 s (not 0.2), keep a gRPC probe's "
                         "connection while it answers (not a dial a probe, as a kubelet does) and keep their "
                         "pods from their watch's events (no list at each event; a look every 10 s, not 2); "
                         "default: on")
    ap.add_argument("--nodes", type=int, default=0, help="default: enough for the pairs' engine and gate pods")
    ap.add_argument("--interval", type=float, default=10.0, help="SPECPAIR_RECONCILE_INTERVAL (default: %(default)s)")
    ap.add_argument("--settle", type=float, default=30.0, help="seconds after the last pair serves before measuring")
    ap.add_argument("--window", type=float, default=120.0, help="seconds of steady state measured")
    ap.add_argument("--serve-timeout", type=float, default=1800.0)
    ap.add_argument("--create-seconds", type=float, default=0.0,
                    help="create no pair after this long into a size: the size becomes the pairs made by then "
                         "(all waited for and measured standing still; default: no limit)")
    ap.add_argument("--create-until", metavar="HH:MM",
                    help="create no pair after this time of day (UTC), at any size: the size becomes the pairs made "
                         "by then, waited for and measured standing still (a run that must end by a given time)")
    ap.add_argument("--late-tree", metavar="DIR",
                    help="after the last size's steady window, if DIR holds a tree (DIR/operator, extracted while "
                         "the run went on: a change made during a long run), alternate windows of DIR's operator "
                         "and the run's own on the same pairs (late, own, late), each after a restart, as long as "
                         "--stop-by allows")
    ap.add_argument("--stop-by", metavar="HH:MM",
                    help="start no late window (--late-tree) that would end after this time of day (UTC)")
    ap.add_argument("--in-flight", type=int, default=100,
                    help="at most this many pairs created and not yet Serving at a time (default: %(default)s)")
    ap.add_argument("--mlflow-workers", type=int, default=1,
                    help="the MLflow server's gunicorn workers (default: %(default)s; on its sqlite store 4 "
                         "workers wrote into each other's locks: 'database is locked', requests timed out)")
    ap.add_argument("--mlflow-wal", action=argparse.BooleanOptionalAction, default=True,
                    help="MLflow's sqlite store in write-ahead-log mode (default: on)")
    ap.add_argument("--before-env", action="append", default=[], metavar="NAME=VALUE",
                    help="measure a first steady window with the operator run with these variables, then "
                         "restart it without them and measure the same pairs again (an A/B on one cluster, "
                         "under the same load: e.g. SPECPAIR_REPLAY_SETTLED_READS=0)")
    ap.add_argument("--before-tree", metavar="REF",
                    help="measure a first steady window with the operator of this commit (git archive REF, "
                         "put first on the operator's PYTHONPATH), then the working tree's: an A/B of code")
    ap.add_argument("--tree", metavar="REF",
                    help="run the operator of this commit (git archive REF) instead of the working tree's: "
                         "other engineers' unfinished edits in a shared tree stay out of a long run")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --before-env/--before-tree: alternate the before and after windows this many "
                         "times at the first size, each after a restart (default: %(default)s)")
    ap.add_argument("--bring-up-env", action="append", default=[], metavar="NAME=VALUE",
                    help="run the operator with these variables while pairs are brought to Serving, and restart "
                         "it without them before every measured window, e.g. SPECPAIR_RECONCILE_INTERVAL=30: "
                         "pairs in motion are passed less often (their Jobs and Deployments still wake them)")
    ap.add_argument("--operator-env", action="append", default=[], metavar="NAME=VALUE",
                    help="run the operator with these variables (every window; --before-env overrides them "
                         "for the first), e.g. SPECPAIR_RESYNC_INTERVAL=300")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument("--profile-dir", type=Path,
                    help="after each size's steady window, sample the operator with py-spy (--profile-seconds, "
                         "not paused: --nonblocking) and write its raw stacks here")
    ap.add_argument("--profile-seconds", type=float, default=60.0)
    ap.add_argument("--profile-native", action="store_true",
                    help="profile with C frames (py-spy --native: pauses the operator at each sample), so the "
                         "garbage collector's share shows")
    ap.add_argument("--keep", action="store_true",
                    help="skip the deletion timing and keep the work folder (logs, audit log)")
    args = ap.parse_args()
    # Stopped with SIGTERM (a background job ignores SIGINT): the finally below still stops the
    # cluster, MLflow and the operator, which run in sessions of their own.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = sorted({int(n) for n in str(args.pairs).split(",")})
    before = dict(item.split("=", 1) for item in args.before_env)
    bring_up = dict(item.split("=", 1) for item in args.bring_up_env)
    trees = Path(tempfile.mkdtemp(prefix="operator-scale-trees-"))
    if args.before_tree:
        before["PYTHONPATH"] = source_tree(args.before_tree, trees / "before")
    # With several sizes, the A/B (--before-env) is measured at the first only.

    from cluster_env import (MODELS, OPERATOR, OPERATOR_ACCOUNT, OPERATOR_NAMESPACE, World, install_chart,
                             operator_env, pair, register_standin_image)
    from engine_standin_host import StandinHost, read_calls, register_hosted_standin_image
    from mlflow_server import MlflowServer
    import requests

    from specpair_devcluster import DevCluster, NodeSpec
    from specpair_devcluster.client import ApiError
    from specpair_operator.desired.manifests import CACHE_DIR

    work = Path(tempfile.mkdtemp(prefix="operator-scale-"))
    most = sizes[-1]
    nodes = args.nodes or max(1, math.ceil((most + 20) / args.pods_per_node))
    cache = os.environ.get("SPECPAIR_CACHE", str(Path.home() / ".cache" / "specpair"))
    # A bench run from a snapshot of the tree (PYTHONPATH naming its packages, so that others'
    # unfinished edits in a shared working tree stay out of a long run) runs its pods on it too.
    node_env = {"OMP_NUM_THREADS": "1", **{k: os.environ[k] for k in ("PYTHONPATH",) if os.environ.get(k)}}
    # Light nodes (the default): the node agents run in this process, two threads a pod; at ~800
    # pods their 0.2 s looks for an exit and a fresh gRPC dial a probe (~250 a second at 1,000
    # engine pods, each ~0.5 ms of CPU on both ends) made this process the machine's largest CPU
    # user (2026-12-07d). Looking every 2 s and keeping a probe's connection while it answers
    # changes neither what the pods report (probe periods, thresholds, Ready) nor anything the
    # operator does or reads; a gate pod's exit is noticed up to 2 s later. Each node also lists
    # its (up to 250) pods every 10 s instead of 2 when no watch event woke it: at 500 pairs the
    # nodes' lists (their JSON parsed) were a quarter of this process's samples, its probes a
    # third, of 0.25 core (2026-12-07e).
    # And each node keeps its pods from its watch's events (pods_from_watch) instead of listing them
    # at each event: at 546 pairs the nodes' lists were still the largest part of bringing pairs up
    # (node agents 319 CPU-s of 1,553, the API server answering them part of its 284; 2026-12-07e).
    # And a probe that keeps succeeding is looked at every 60 s (settled_probe_period_seconds), not
    # every 5 s (readiness) and 20 s (liveness): at ~960 idle engine pods their ~240 Checks a second
    # cost 0.71 core on both ends, most of the machine by the end of a 1,000-pair run (2026-12-07f),
    # so pairs came slower as they grew. The pods stay Ready while they answer; the operator reads
    # the same; a stand-in that stopped answering would be seen up to a minute later.
    light = {"exit_poll_seconds": 2.0, "probe_connections_kept": True, "sync_seconds": 10.0,
             "pods_from_watch": True, "settled_probe_period_seconds": 60.0} \
        if args.light_nodes else {}
    specs = [NodeSpec(name=f"scale-node-{i + 1}", cpu="64", memory="256Gi", max_pods=args.pods_per_node,
                      env=node_env, preseeded={CACHE_DIR: cache}, **light) for i in range(nodes)]
    cluster = DevCluster(work / "devcluster", nodes=specs).start()
    # Several workers share one sqlite file: a writer waits up to 60 s for another's lock
    # (pysqlite's default is 5 s) instead of failing the request. The later options win.
    mlflow = MlflowServer(work / "mlflow", args=(
        "--workers", str(args.mlflow_workers),
        "--backend-store-uri", f"sqlite:///{work / 'mlflow'}/mlflow.db?timeout=60"))
    (work / "mlflow").mkdir()
    if args.mlflow_wal:
        # Write-ahead logging (kept in the file): readers no longer wait on a writer's lock, and
        # a writer waits only on another writer.
        with sqlite3.connect(work / "mlflow" / "mlflow.db") as db:
            db.execute("PRAGMA journal_mode=WAL")
    operator = host = None
    result: dict = {"sizes": sizes, "nodes": nodes, "podsPerNode": args.pods_per_node,
                    "standins": "a process per pod" if args.standin_processes else "one host process for all pods",
                    "lightNodes": args.light_nodes,
                    "intervalSeconds": args.interval, "inFlight": args.in_flight,
                    "mlflowWorkers": args.mlflow_workers, "mlflowWal": args.mlflow_wal, "commit": subprocess.run(
                        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip(),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{os.cpu_count()} CPUs",
                    "bySize": {}}
    try:
        mlflow.start()
        kubeconfig = install_chart(cluster, mlflow.url, work)
        world = World(work / "world.json", MODELS)
        if args.standin_processes:
            register_standin_image(cluster, world.path)
        else:
            host = StandinHost(work / "standin-spool", world.path).start()
            register_hosted_standin_image(cluster, world.path, host.spool)
        env = {**os.environ, **operator_env(kubeconfig, mlflow.url, {
            "SPECPAIR_RECONCILE_INTERVAL": f"{args.interval:g}", "SPECPAIR_METRICS_PORT": "0"})}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        env.update(item.split("=", 1) for item in args.operator_env)
        if args.tree:
            env["PYTHONPATH"] = source_tree(args.tree, trees / "after")
        result["operatorEnv"] = args.operator_env
        result["trees"] = {"before": args.before_tree and git_commit(args.before_tree),
                           "after": git_commit(args.tree) if args.tree else "the working tree"}
        log = open(work / "operator.log", "wb")
        result["bringUpEnv"] = args.bring_up_env
        # The pairs are brought up by the operator under test (with --bring-up-env, each window restarts it
        # as its side runs), else by the one the first window measures.
        operator = subprocess.Popen([sys.executable, "-m", "kopf", *OPERATOR],
                                    env={**env, **bring_up} if bring_up else {**env, **before},
                                    stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_ACCOUNT}"
        assert cluster.control_plane and cluster.control_plane.audit_log
        audit = AuditTail(cluster.control_plane.audit_log, user)

        namespaces = [f"scale-{i}" for i in range(math.ceil(most / PAIRS_PER_NAMESPACE))]
        created: dict[tuple[str, str], float] = {}
        served: dict[tuple[str, str], float] = {}
        for size in sizes:
            figures: dict = result["bySize"].setdefault(str(size), {"pairs": size})
            if bring_up and size != sizes[0]:
                # The steady windows ran the operator as configured: the next pairs are brought up
                # as the first were.
                operator.terminate()
                operator.wait(60)
                operator = subprocess.Popen([sys.executable, "-m", "kopf", *OPERATOR], env={**env, **bring_up},
                                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            cpu0, t0, components0 = cpu_seconds(operator.pid), time.monotonic(), component_cpu()
            deadline = time.monotonic() + args.serve_timeout
            last_said = t0
            # A pair that stalled (Stalled True: the operator gave up on it, e.g. MLflow refused a
            # request) will not serve by waiting: it is counted, said, and not waited for.
            stalled: set[tuple[str, str]] = set()
            # With --create-seconds, no pair is created after that long: the size becomes the pairs made
            # by then, which are waited for, so that the windows measure pairs that all stand still.
            create_until = t0 + args.create_seconds if args.create_seconds else float("inf")
            if args.create_until:
                create_until = min(create_until, t0 + time_of_day(args.create_until) - time.time())

            def goal() -> int:
                return size if time.monotonic() < create_until else min(size, len(created))

            while len(served) + len(stalled) < goal() and time.monotonic() < deadline:
                # New pairs while fewer than --in-flight are on their way, then a look at them all.
                made = 0
                while len(created) < goal() and len(created) - len(served) - len(stalled) < args.in_flight:
                    i = len(created)
                    ns = namespaces[i // PAIRS_PER_NAMESPACE]
                    if i % PAIRS_PER_NAMESPACE == 0:
                        cluster.ensure_namespace(ns)
                    obj = pair(f"p{i:04d}", "good-draft")
                    obj["metadata"]["namespace"] = ns
                    cluster.kube.create(obj)
                    created[(ns, f"p{i:04d}")] = time.monotonic()
                    made += 1
                if made:
                    print(f"{len(created)}/{size} created ({made} now), {len(served)} serving", flush=True)
                # Only the namespaces that hold pairs not yet Serving (or stalled) are listed: a
                # list of every pair with its status every POLL_S is MBs at 1,000 pairs, the API
                # server's own CPU taken from the pairs on their way (and from the steady window).
                waiting = sorted({ns for ns, name in created if (ns, name) not in served and (ns, name) not in stalled})
                pairs = []
                for ns in waiting:
                    try:
                        pairs += cluster.kube.list("specpair.io/v1alpha1", "SpecModelPair", ns)
                    except (OSError, requests.RequestException, ApiError) as exc:
                        # A loaded machine's API server can take longer than the client waits: ask again.
                        print(f"listing the pairs of {ns} failed ({type(exc).__name__}); again", flush=True)
                for obj in pairs:
                    key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
                    st = obj.get("status") or {}
                    if key not in served and st.get("phase") == "Serving" and st.get("servingVersion") == "1":
                        served[key] = time.monotonic()
                    elif key not in served and key not in stalled and any(
                            c.get("type") == "Stalled" and c.get("status") == "True" for c in st.get("conditions") or []):
                        stalled.add(key)
                        print(f"{key[0]}/{key[1]} stalled: {(st.get('conditions') or [{}])[0].get('message', '')[:300]}",
                              flush=True)
                if operator.poll() is not None:
                    raise RuntimeError(f"the operator exited ({operator.returncode}); log {work / 'operator.log'}")
                if time.monotonic() - last_said >= 60:
                    last_said = time.monotonic()
                    print(f"{len(served)}/{size} serving, {len(created)} created after {time.monotonic() - t0:.0f} s, "
                          f"load {load_average()}, operator CPU {cpu_seconds(operator.pid) - cpu0:.0f} s", flush=True)
                # Each look lists every pair with its status (MBs at 1,000): not more often than this.
                if len(served) + len(stalled) < goal():
                    time.sleep(POLL_S)
            to_serving = [served[k] - created[k] for k in served if created[k] >= t0]
            figures["created"] = len(created)
            figures["served"] = len(served)
            figures["stalled"] = len(stalled)
            figures["timeToServingSeconds"] = {"p50": round(percentile(to_serving, 0.5), 1),
                                               "p90": round(percentile(to_serving, 0.9), 1),
                                               "max": round(max(to_serving, default=float("nan")), 1)}
            figures["allServingAfterSeconds"] = round(time.monotonic() - t0, 1)
            figures["operatorCpuSecondsToServing"] = round(cpu_seconds(operator.pid) - cpu0, 1)
            spent = component_cpu()
            spent.subtract(components0)
            figures["cpuSecondsToServingByComponent"] = {k: round(v, 1) for k, v in spent.most_common()}
            print(f"{len(served)}/{size} serving; the new ones' {json.dumps(figures['timeToServingSeconds'])}",
                  flush=True)
            if len(served) < size:
                phases = Counter((o.get("status") or {}).get("phase") for o in
                                 cluster.kube.list("specpair.io/v1alpha1", "SpecModelPair"))
                figures["notServing"] = dict(phases)

            windows = [("steady", {})]
            if before and size == sizes[0]:
                windows = [("before", before), ("steady", {})] * max(1, args.rounds)
            if args.late_tree and size == sizes[-1]:
                # The late tree's operator first on the path, ahead of the run's own (--tree or the
                # working tree); its windows are recorded under "late", the run's own under "lateOwn".
                late = Path(args.late_tree).resolve()
                late_path = os.pathsep.join([str(late / "operator"), str(late / "engine"),
                                             *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
                windows += [("late", {"PYTHONPATH": late_path}), ("lateOwn", {}), ("late", {"PYTHONPATH": late_path})]
            for turn, (label, extra) in enumerate(windows):
                restart = None
                if label.startswith("late"):
                    # A window costs a restart (a full pass over every pair), the settling and the window.
                    needed = args.settle + args.window + ((figures.get("restart") or {}).get("everyPairPassedSeconds") or 60) + 30
                    if not (Path(args.late_tree) / "operator").is_dir():
                        print(f"late windows skipped: {args.late_tree} holds no tree", flush=True)
                        break
                    if args.stop_by and time.time() + needed > time_of_day(args.stop_by):
                        print(f"late windows stopped: the next would end after {args.stop_by}", flush=True)
                        break
                if label == "steady" or turn >= 2 or bring_up:
                    # The same pairs, the same cluster and load: the operator restarted as this side
                    # runs (the first "before" window measures the operator that brought the pairs
                    # to Serving): it remembers nothing, every pair is resumed. How long until it
                    # has made a full pass over each (asked each pair's engine pod who it is,
                    # GetModelInfo: one pod a pair, and replayed passes do not ask) and the CPU
                    # that took.
                    operator.terminate()
                    operator.wait(60)
                    asked0 = read_calls(host.spool)["GetModelInfo"] if host else 0
                    operator = subprocess.Popen([sys.executable, "-m", "kopf", *OPERATOR], env={**env, **extra},
                                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
                    t_restart = time.monotonic()
                    converged = None
                    while host and time.monotonic() - t_restart < args.serve_timeout:
                        if read_calls(host.spool)["GetModelInfo"] - asked0 >= len(served):
                            converged = round(time.monotonic() - t_restart, 1)
                            break
                        if operator.poll() is not None:
                            raise RuntimeError(f"the operator exited ({operator.returncode}); log {work / 'operator.log'}")
                        time.sleep(1.0)
                    restart = {"everyPairPassedSeconds": converged,
                               "operatorCpuSeconds": round(cpu_seconds(operator.pid), 1),
                               "loadAverage": load_average()}
                    if label == "steady" and turn < 2:
                        figures["restart"] = restart
                    print(f"{size} pairs, restart ({label})", json.dumps(restart), flush=True)
                time.sleep(args.settle)
                load = load_average()
                measured = steady_window(operator.pid, audit, args.window, len(served), args.interval,
                                         (lambda: read_calls(host.spool)) if host else Counter,
                                         host.process.pid if host and host.process else None)
                measured.update(env={k: v for k, v in extra.items() if k != "PYTHONPATH"},
                                loadAverageBefore=load, loadAverageAfter=load_average())
                if label.startswith("late"):
                    figures.setdefault("lateRounds", []).append({"side": label, **measured, "restart": restart})
                elif turn < 2:
                    figures[label] = measured
                if len(windows) > 2 and not label.startswith("late"):
                    figures.setdefault("rounds", []).append({"side": label, **measured, "restart": restart})
                print(f"{size} pairs, {label} (window {turn + 1} of {len(windows)})", json.dumps(measured, indent=1),
                      flush=True)
                if args.profile_dir and label in ("before", "steady") and turn >= len([w for w in windows if not w[0].startswith("late")]) - 2:
                    # The last window of each side: where its operator's CPU goes.
                    figures.setdefault("profiles", {})[label] = profile(
                        operator.pid, args.profile_dir / f"operator_scale_{size}_{label}.txt", args.profile_seconds,
                        args.profile_native)
            if args.json:
                args.json.write_text(json.dumps(result, indent=1) + "\n")

        if not args.keep:
            t3 = time.monotonic()
            for ns in namespaces:
                cluster.kube.delete("v1", "Namespace", None, ns)
            while time.monotonic() - t3 < 600:
                try:
                    if not cluster.kube.list("specpair.io/v1alpha1", "SpecModelPair"):
                        break
                except (OSError, requests.RequestException, ApiError):
                    pass
                time.sleep(1)
            result["deleteAllSeconds"] = round(time.monotonic() - t3, 1)
    finally:
        if operator is not None:
            operator.terminate()
            try:
                operator.wait(30)
            except subprocess.TimeoutExpired:
                operator.kill()
        cluster.stop()
        if host is not None:
            host.stop()
        mlflow.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(trees, ignore_errors=True)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(f.get("served") == f["pairs"] for f in result["bySize"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
