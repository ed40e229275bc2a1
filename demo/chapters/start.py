"""Chapter 1: a real Kubernetes control plane (devcluster), MLflow beside it, and the operator
installed by its helm chart, Ready, with its CRD served."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from ..cluster import OPERATOR_NAMESPACE, DemoCluster
from ..processes import start_mlflow
from ..session import Session
from ..settings import NS, OPERATOR_ENV, DemoFailed, say


def run(demo: Session) -> None:
    t0 = time.monotonic()
    # MLflow starts while the control plane does: neither needs the other until the operator is installed.
    mlflow = ThreadPoolExecutor(1, thread_name_prefix="mlflow")
    mlflow_url = mlflow.submit(start_mlflow, demo.children, demo.workdir)
    mlflow.shutdown(wait=False)
    demo.cluster = DemoCluster(demo.workdir / "cluster", NS, os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        demo.cluster.start()
    finally:
        mlflow_url.exception()   # waits for it, on errors too: close() stops what it started
    demo.mlflow_url = mlflow_url.result()
    say(f"  Kubernetes        {demo.cluster.cluster.server}  etcd, kube-apiserver, controller-manager, scheduler; "
        f"node demo-node-1 ({time.monotonic() - t0:.0f} s)")
    say(f"                    KUBECONFIG={demo.cluster.kubeconfig}")
    say(f"  MLflow            {demo.mlflow_url}  (sqlite: {demo.workdir / 'mlflow.db'})")
    t0 = time.monotonic()
    demo.cluster.install_operator(demo.mlflow_url, OPERATOR_ENV)
    pod = demo.cluster.wait_operator_ready(demo.args.step_timeout)
    deadline = time.monotonic() + 60
    while not demo.cluster.crd_served():
        if time.monotonic() > deadline:
            raise DemoFailed("the SpecModelPair CRD was not served 60 s after helm installed it")
        time.sleep(0.3)
    say(f"  operator          helm release '{OPERATOR_NAMESPACE}/specpair' (charts/specpair), pod "
        f"{pod['metadata']['name']} at {pod['status']['podIP']}, Ready ({time.monotonic() - t0:.0f} s)")
