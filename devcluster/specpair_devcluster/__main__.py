"""`python -m specpair_devcluster up|down|status|serve` (scripts/devcluster.sh wraps it).

up      start a cluster in the background, print its kubeconfig path, return
down    stop the cluster `up` started (every process it owns)
status  print the running cluster's description (JSON), exit 1 when none runs
serve   run a cluster in the foreground until SIGTERM / Ctrl-C (what `up` starts)
prometheus  run a real Prometheus in the foreground against the running cluster, scraping what
        the chart's PodMonitor and ServiceMonitor select for `--release` in `--namespace` (as
        rendered by helm with `--values`), with the chart's alert rules; prints its URL
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .cluster import DevCluster
from .node_agent import NodeSpec


def default_dir() -> Path:
    return Path(os.environ.get("SPECPAIR_CACHE", Path.home() / ".cache" / "specpair")) / "devcluster"


def model_cache() -> str:
    return str(Path(os.environ.get("SPECPAIR_CACHE", Path.home() / ".cache" / "specpair")))


def node_specs(nodes: int, gpus: int, pods_per_node: int = NodeSpec.max_pods) -> list[NodeSpec]:
    from specpair_operator.desired.manifests import CACHE_DIR
    # The model cache is pre-seeded on the nodes (one conversion of the embedded model per machine).
    return [NodeSpec(name=f"devcluster-node-{i + 1}", gpus=gpus, max_pods=pods_per_node,
                     preseeded={CACHE_DIR: model_cache()},
                     env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
            for i in range(nodes)]


def _running(folder: Path) -> dict | None:
    state = folder / "cluster.json"
    if not state.exists():
        return None
    info = json.loads(state.read_text())
    try:
        os.kill(int(info["pid"]), 0)
    except (OSError, KeyError, ValueError):
        return None
    return info


def serve(folder: Path, nodes: int, gpus: int, pods_per_node: int) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    (folder / "cluster.json").unlink(missing_ok=True)
    cluster = DevCluster(folder, nodes=node_specs(nodes, gpus, pods_per_node))
    cluster.start()
    try:
        cluster.write_state()
        print(f"devcluster up in {cluster.startup_seconds:.1f} s: {cluster.kubeconfig}", flush=True)
        stop.wait()
    finally:
        (folder / "cluster.json").unlink(missing_ok=True)
        cluster.stop()
        for err in cluster.node_errors()[-10:]:
            print(f"node: {err}", file=sys.stderr)
    return 0


def up(folder: Path, nodes: int, gpus: int, pods_per_node: int, timeout: float) -> int:
    info = _running(folder)
    if info:
        print(info["kubeconfig"])
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "devcluster.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specpair_devcluster", "serve", "--dir", str(folder),
                                 "--nodes", str(nodes), "--gpus", str(gpus), "--pods-per-node", str(pods_per_node)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(f"devcluster failed to start (exit {proc.returncode}); log {log}:\n"
                  f"{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            return 1
        info = _running(folder)
        if info:
            print(f"devcluster up in {info['startupSeconds']} s (nodes: {', '.join(info['nodes'])}); "
                  f"stop it with: scripts/devcluster.sh down", file=sys.stderr)
            print(info["kubeconfig"])
            return 0
        time.sleep(0.3)
    proc.terminate()
    print(f"devcluster did not come up within {timeout:.0f} s; log {log}", file=sys.stderr)
    return 1


def down(folder: Path) -> int:
    info = _running(folder)
    if not info:
        print("no devcluster is running", file=sys.stderr)
        return 0
    os.kill(int(info["pid"]), signal.SIGTERM)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(int(info["pid"]), 0)
        except OSError:
            print("devcluster stopped", file=sys.stderr)
            return 0
        time.sleep(0.3)
    os.kill(int(info["pid"]), signal.SIGKILL)
    print("devcluster did not stop within 60 s; killed", file=sys.stderr)
    return 1


def prometheus(folder: Path, release: str, namespace: str, values: list[Path], port: int, interval: str) -> int:
    from types import SimpleNamespace

    import yaml

    from .client import Kube
    from .prometheus import CHART_RULES, DevPrometheus, chart_monitors

    info = _running(folder)
    if not info:
        print("no devcluster is running: scripts/devcluster.sh up", file=sys.stderr)
        return 1
    config = yaml.safe_load(Path(info["kubeconfig"]).read_text())["clusters"][0]["cluster"]
    cluster = SimpleNamespace(kube=Kube.from_kubeconfig(info["kubeconfig"]), server=config["server"],
                              ca_file=Path(config["certificate-authority"]))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    prom = DevPrometheus(cluster, folder / "prometheus", chart_monitors(release, namespace, values),
                         rule_files=[CHART_RULES], interval=interval, port=port).start()
    try:
        jobs = [j["job_name"] for j in prom.config_file_jobs()]
        print(f"Prometheus {prom.url} (jobs: {', '.join(jobs)}; rules: {CHART_RULES}); Ctrl-C stops it", flush=True)
        stop.wait()
    finally:
        prom.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="devcluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["up", "down", "status", "serve", "prometheus"])
    ap.add_argument("--dir", type=Path, default=default_dir(), help="state folder (default: %(default)s)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu capacity of each node")
    ap.add_argument("--pods-per-node", type=int, default=NodeSpec.max_pods,
                    help="the pods capacity of each node (a kubelet's maxPods; default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds `up` waits (a cold build takes minutes)")
    ap.add_argument("--release", default="specpair", help="prometheus: the chart's helm release (default: %(default)s)")
    ap.add_argument("--namespace", default="specpair-system", help="prometheus: its namespace (default: %(default)s)")
    ap.add_argument("--values", type=Path, action="append", default=[],
                    help="prometheus: the release's values file (watchNamespaces decides where engines are scraped)")
    ap.add_argument("--port", type=int, default=9090, help="prometheus: its HTTP port on 127.0.0.1 (default: %(default)s)")
    ap.add_argument("--interval", default="15s", help="prometheus: scrape and rule evaluation interval (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.command == "prometheus":
        return prometheus(args.dir, args.release, args.namespace, args.values, args.port, args.interval)
    if args.command == "serve":
        return serve(args.dir, args.nodes, args.gpus, args.pods_per_node)
    if args.command == "up":
        return up(args.dir, args.nodes, args.gpus, args.pods_per_node, args.timeout)
    if args.command == "down":
        return down(args.dir)
    info = _running(args.dir)
    print(json.dumps(info or {}, indent=1))
    return 0 if info else 1


if __name__ == "__main__":
    sys.exit(main())
