"""A real Kubernetes control plane on one machine, for the tests and the demo.

`DevCluster` starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler (built from
the pinned Go modules by scripts/build-control-plane.sh) on 127.0.0.1 with generated
certificates, and one or more nodes whose pods run as local processes (`node_agent`). Nothing
here stands in for the API server: every object goes through real admission, validation, RBAC,
the garbage collector, the Deployment/ReplicaSet/Job controllers and the scheduler.
"""

from .cluster import DevCluster, NodeSpec

__all__ = ["DevCluster", "NodeSpec"]
