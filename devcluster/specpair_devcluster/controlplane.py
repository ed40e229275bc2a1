"""etcd, kube-apiserver, kube-controller-manager and kube-scheduler on 127.0.0.1.

Every component talks TLS to the others with certificates from one generated CA; the
controllers log in with their own identities and `--use-service-account-credentials`, so each
controller is held to its built-in RBAC role as on any cluster.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import requests
import yaml

from .certs import CertificateAuthority, KeyPair, service_account_keys
from .processes import Child, built_binaries, first_exit, free_port, wait_until

PROGRAMS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
SERVICE_CIDR = "10.96.0.0/16"


def control_plane_binaries() -> Path:
    """The folder with the four binaries ($SPECPAIR_CONTROL_PLANE_BIN or the build script's cache)."""
    return built_binaries("build-control-plane.sh", "SPECPAIR_CONTROL_PLANE_BIN", PROGRAMS)


def write_kubeconfig(path: Path, server: str, ca: Path, user: str, *, cert: KeyPair | None = None,
                     token: str | None = None, namespace: str = "default") -> Path:
    creds: dict[str, str] = {}
    if cert is not None:
        creds = {"client-certificate": str(cert.cert), "client-key": str(cert.key)}
    if token is not None:
        creds["token"] = token
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": user, "preferences": {},
        "clusters": [{"name": "devcluster", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": user, "context": {"cluster": "devcluster", "user": user, "namespace": namespace}}],
    }))
    path.chmod(0o600)
    return path


@dataclass
class ControlPlane:
    workdir: Path
    binaries: Path
    children: list[Child] = field(default_factory=list)
    server: str = ""
    admin_kubeconfig: Path | None = None
    ca: CertificateAuthority | None = None
    audit_log: Path | None = None

    def start(self, timeout: float = 120.0) -> None:
        started = time.monotonic()
        pki = self.workdir / "pki"
        logs = self.workdir / "logs"
        if pki.exists():
            shutil.rmtree(pki)
        self.ca = ca = CertificateAuthority(pki)
        loopback = ("127.0.0.1", "localhost")
        etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
        etcd_server = ca.issue("etcd", "etcd", server=True, hosts=loopback)
        etcd_client = ca.issue("apiserver-etcd-client", "kube-apiserver-etcd-client", client=True)
        api_serving = ca.issue("apiserver", "kube-apiserver", server=True,
                               hosts=loopback + ("10.96.0.1", "kubernetes", "kubernetes.default",
                                                 "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"))
        admin = ca.issue("admin", "devcluster-admin", groups=("system:masters",), client=True)
        kcm = ca.issue("controller-manager", "system:kube-controller-manager", client=True)
        sched = ca.issue("scheduler", "system:kube-scheduler", client=True)
        sa = service_account_keys(pki)
        # The aggregation layer (an extension API server such as KEDA's metrics server): the API
        # server proxies to it as `front-proxy-client`, from a CA of its own as kubeadm sets it up,
        # and publishes that CA in kube-system/extension-apiserver-authentication, from which the
        # extension server learns whom to trust for the X-Remote-* headers. Nothing answers for an
        # APIService until one is created.
        front_proxy_ca = CertificateAuthority(pki / "front-proxy", name="specpair-devcluster-front-proxy-ca")
        front_proxy = front_proxy_ca.issue("front-proxy-client", "front-proxy-client", client=True)
        self.server = f"https://127.0.0.1:{api_port}"

        etcd_url = f"https://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{etcd_peer}"
        self._spawn("etcd", [
            str(self.binaries / "etcd"), "--name", "devcluster", "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"devcluster={peer_url}", "--initial-cluster-state", "new",
            "--cert-file", str(etcd_server.cert), "--key-file", str(etcd_server.key),
            "--client-cert-auth", "--trusted-ca-file", str(ca.cert),
            # A throwaway cluster: losing the last writes on a power cut costs nothing, fsync costs seconds.
            "--unsafe-no-fsync", "--log-level", "warn"], logs)
        # Every request by a ServiceAccount is audited (who, verb, resource, answer): tests prove
        # least-privilege RBAC from what the operator really asked for.
        audit_policy = pki / "audit-policy.yaml"
        audit_policy.write_text(yaml.safe_dump({
            "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
            "rules": [{"level": "Metadata", "userGroups": ["system:serviceaccounts"]}, {"level": "None"}]}))
        self.audit_log = logs / "audit.log"
        self._spawn("kube-apiserver", [
            str(self.binaries / "kube-apiserver"),
            "--etcd-servers", etcd_url, "--etcd-cafile", str(ca.cert),
            "--etcd-certfile", str(etcd_client.cert), "--etcd-keyfile", str(etcd_client.key),
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", str(api_port),
            "--tls-cert-file", str(api_serving.cert), "--tls-private-key-file", str(api_serving.key),
            "--client-ca-file", str(ca.cert),
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", str(sa.cert), "--service-account-signing-key-file", str(sa.key),
            "--service-cluster-ip-range", SERVICE_CIDR,
            "--authorization-mode", "Node,RBAC",
            "--requestheader-client-ca-file", str(front_proxy_ca.cert),
            "--requestheader-allowed-names", "front-proxy-client",
            "--requestheader-username-headers", "X-Remote-User", "--requestheader-group-headers", "X-Remote-Group",
            "--requestheader-extra-headers-prefix", "X-Remote-Extra-",
            "--proxy-client-cert-file", str(front_proxy.cert), "--proxy-client-key-file", str(front_proxy.key),
            # On top of the default plugins (NamespaceLifecycle, ServiceAccount, PodSecurity,
            # ResourceQuota, LimitRanger, the webhooks, ...), as kubeadm enables it.
            "--enable-admission-plugins", "NodeRestriction",
            "--allow-privileged=false",
            # The `kubernetes` Service would get 127.0.0.1 as its endpoint, which Endpoints refuse.
            "--endpoint-reconciler-type", "none",
            "--audit-policy-file", str(audit_policy), "--audit-log-path", str(self.audit_log),
            "--audit-log-format", "json", "--audit-log-mode", "blocking",
            "--profiling=false", "--v", "1"], logs)
        self.admin_kubeconfig = write_kubeconfig(self.workdir / "kubeconfig", self.server, ca.cert,
                                                 "devcluster-admin", cert=admin)
        self._admin = admin
        session = requests.Session()
        # Not the environment's CA bundle (REQUESTS_CA_BUNDLE would win over `verify`) or proxies.
        session.trust_env = False
        session.verify, session.cert = str(ca.cert), (str(admin.cert), str(admin.key))

        def ready() -> bool:
            try:
                return session.get(self.server + "/readyz", timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_until(ready, max(5.0, timeout - (time.monotonic() - started)), what="kube-apiserver /readyz",
                   abort=self._dead_child)
        kcm_config = write_kubeconfig(pki / "controller-manager.kubeconfig", self.server, ca.cert,
                                      "system:kube-controller-manager", cert=kcm)
        sched_config = write_kubeconfig(pki / "scheduler.kubeconfig", self.server, ca.cert,
                                        "system:kube-scheduler", cert=sched)
        self._spawn("kube-controller-manager", [
            str(self.binaries / "kube-controller-manager"),
            "--kubeconfig", str(kcm_config), "--authentication-kubeconfig", str(kcm_config),
            "--authorization-kubeconfig", str(kcm_config),
            "--bind-address", "127.0.0.1", "--secure-port", str(free_port()),
            "--cert-dir", str(pki / "controller-manager-serving"),
            "--use-service-account-credentials", "--service-account-private-key-file", str(sa.key),
            "--root-ca-file", str(ca.cert),
            "--cluster-signing-cert-file", str(ca.cert), "--cluster-signing-key-file", str(ca.key),
            "--service-cluster-ip-range", SERVICE_CIDR,
            "--leader-elect=false", "--controllers", "*",
            # Garbage collection and Job/Deployment status within a second or two, not minutes.
            "--concurrent-gc-syncs", "5",
            # HorizontalPodAutoscalers (KEDA's among them) read their metrics every second, not every 15 s.
            "--horizontal-pod-autoscaler-sync-period", "1s", "--v", "1"], logs)
        self._spawn("kube-scheduler", [
            str(self.binaries / "kube-scheduler"),
            "--kubeconfig", str(sched_config), "--authentication-kubeconfig", str(sched_config),
            "--authorization-kubeconfig", str(sched_config),
            "--bind-address", "127.0.0.1", "--secure-port", str(free_port()),
            "--cert-dir", str(pki / "scheduler-serving"),
            "--leader-elect=false", "--v", "1"], logs)

        def default_service_account() -> bool:
            # The ServiceAccount controller has run once the default namespace has its account:
            # before that, the ServiceAccount admission plugin refuses every pod.
            try:
                return session.get(self.server + "/api/v1/namespaces/default/serviceaccounts/default",
                                   timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_until(default_service_account, max(5.0, timeout - (time.monotonic() - started)),
                   what="kube-controller-manager (default ServiceAccount)", abort=self._dead_child)
        session.close()

    def restart(self, name: str, *, crash: bool = True, down_seconds: float = 0.0, timeout: float = 90.0) -> float:
        """Restart one component in place, as a node restarts a static pod: stopped (crash: SIGKILL,
        mid-request; else SIGTERM, draining as a rolling restart does), kept down `down_seconds`,
        then started with the same arguments, ports, certificates and data, its log appended. Waits
        until it serves again (the API server's /readyz, which checks etcd; a controller's
        /healthz) and returns the seconds it was away. The others keep running and reconnect on
        their own, as they do in any cluster."""
        index = next((i for i, c in enumerate(self.children) if c.name == name), None)
        if index is None:
            raise ValueError(f"no control-plane component {name!r}; there are {[c.name for c in self.children]}")
        started = time.monotonic()
        old = self.children[index]
        if crash:
            old.kill()
        else:
            old.stop(grace=3 if name == "kube-apiserver" else 10)
        time.sleep(down_seconds)
        self.children[index] = new = old.again()
        wait_until(lambda: self._serving(new), timeout, what=f"{name} serving again after its restart",
                   abort=self._dead_child)
        return time.monotonic() - started

    def _serving(self, child: Child) -> bool:
        """Whether a (re)started component answers: its own health endpoint, and for etcd the
        API server's readiness (which checks etcd)."""
        assert self.ca is not None
        if child.name in ("kube-apiserver", "etcd"):
            url, verify, cert = self.server + "/readyz", str(self.ca.cert), (str(self._admin.cert), str(self._admin.key))
        else:
            port = child.argv[child.argv.index("--secure-port") + 1]
            # Their serving certificates are self-signed (--cert-dir); /healthz needs no login.
            url, verify, cert = f"https://127.0.0.1:{port}/healthz", False, None
        session = requests.Session()
        session.trust_env = False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # urllib3's InsecureRequestWarning for verify=False
                return session.get(url, timeout=2, verify=verify, cert=cert).status_code == 200
        except requests.RequestException:
            return False
        finally:
            session.close()

    def _spawn(self, name: str, argv: list[str], logs: Path) -> None:
        self.children.append(Child(name, argv, logs / f"{name}.log", env={"PATH": os.environ.get("PATH", "")}))

    def _dead_child(self) -> str | None:
        return first_exit(self.children)

    def stop(self) -> None:
        for child in reversed(self.children):
            # On SIGTERM the API server drains its requests and flushes its audit log within
            # milliseconds (its log says so), then waits out its shutdown timeout on connections
            # left open (every stop waited the whole 10 s grace and was killed): a throwaway
            # cluster gives it a few seconds.
            child.stop(grace=3 if child.name == "kube-apiserver" else 10)
        self.children.clear()
