"""A vLLM engine pod's companion container run here from the command the operator renders
(engine_objects.engine_deployment), its files laid out as the kubelet mounts them: the pair's
engine certificate Secret as desired/tls.py issues it, the token Secret. Shared by the test in
front of a stand-in upstream (tests/operator/test_operator_serving_auth.py) and the one in front
of real vLLM (tests/engine/test_engine_vllm_peer.py). A module, not conftest, so any test folder
can import it."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

PORT_FLAGS = ("--port", "--metrics-port", "--control-port")


def write_engine_secret(run: Path, ca, service: str, namespace: str):
    """The pair's engine certificate Secret (ca.crt, tls.crt, tls.key) issued by `ca` for the
    engine Service's names, written where the pod mounts it under `run`, each file replaced whole
    (as the kubelet's atomic writer does). Returns the issued key pair."""
    from specpair_operator.desired import manifests
    from specpair_operator.desired import tls as tls_mod

    issued = tls_mod.issue(ca, service, tls_mod.engine_dns_names(service, namespace), server=True, days=1)
    folder = run / manifests.TLS_DIR.lstrip("/")
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in (("ca.crt", ca.cert_pem), ("tls.key", issued.key_pem), ("tls.crt", issued.cert_pem)):
        (folder / f".{name}").write_bytes(data)
        os.replace(folder / f".{name}", folder / name)
    return issued


def local_argv(command: list[str], run: Path, ports: dict[str, int]) -> list[str]:
    """The rendered companion command as this machine runs it: this Python, its ports the free
    ones in `ports` (flag -> port), loopback for 0.0.0.0, its absolute paths under `run`."""
    assert command[:3] == ["python", "-m", "specpair.vllm_companion"], command
    args = []
    for i, arg in enumerate(command[3:], start=3):
        if command[i - 1] in ports:
            arg = str(ports[command[i - 1]])
        elif arg == "0.0.0.0":
            arg = "127.0.0.1"
        elif arg.startswith("/"):
            arg = str(run / arg.lstrip("/"))
        args.append(arg)
    return [sys.executable, "-m", "specpair.vllm_companion", *args]


def start(argv: list[str], base: str, timeout: float = 120) -> subprocess.Popen:
    """The companion started, once its /health answers 200 over HTTPS as the kubelet's probe
    reads it (no certificate check, no token)."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    unverified = ssl.create_default_context()
    unverified.check_hostname, unverified.verify_mode = False, ssl.CERT_NONE
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", context=unverified, timeout=10) as health:
                    assert health.status == 200
                return proc
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None and time.monotonic() < deadline, "the companion did not serve"
                time.sleep(0.2)
    except BaseException:
        proc.kill()
        proc.wait(30)
        raise
