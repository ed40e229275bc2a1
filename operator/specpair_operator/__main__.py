"""`python -m specpair_operator` / `specpair-operator`: `kopf run` with the specpair handlers (no torch).

Every flag of `kopf run` is accepted and handed to Kopf as it is (`--log-format=json`, `--debug`,
`--quiet`, `--log-refkey`, `--peering`, ...). On top, the operator brings its own defaults: Kopf
runs standalone (unless `--peering` names a peering object), all namespaces when no `--namespace`
is given, its liveness endpoint where the chart's probes call it, and `--mlflow-tracking-uri`.

With `--leader-election` (the chart's default) any number of replicas may run: each waits for the
Lease (leadership.py) before Kopf starts, so one operator acts; the leader renews it, hands it over
on a clean shutdown, and exits at once when it cannot renew in time.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass

HANDLERS_MODULE = "specpair_operator.handlers"
DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"
DEFAULT_LEASE = "specpair-operator"


def _parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: a Kopf flag must never be taken for an abbreviation of one of ours.
    ap = argparse.ArgumentParser(prog="specpair-operator", add_help=False, allow_abbrev=False,
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-h", "--help", action="store_true", help="show this help, Kopf's run flags included")
    ap.add_argument("-n", "--namespace", action="append", default=[],
                    help="namespace (or glob) to watch; repeatable; default: all namespaces")
    ap.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces (the default)")
    ap.add_argument("--mlflow-tracking-uri", default=None, help="overrides SPECPAIR_MLFLOW_TRACKING_URI")
    ap.add_argument("-L", "--liveness", default=DEFAULT_LIVENESS,
                    help=f"Kopf liveness endpoint (default {DEFAULT_LIVENESS}; empty: none)")
    ap.add_argument("-P", "--peering", default=None,
                    help="Kopf peering object; without it Kopf runs standalone (one replica)")
    le = ap.add_argument_group("leader election (a coordination.k8s.io Lease)")
    le.add_argument("--leader-election", action="store_true",
                    help="start Kopf only while this process holds the Lease (for more than one replica)")
    le.add_argument("--leader-election-lease", default=DEFAULT_LEASE, help=f"the Lease's name (default {DEFAULT_LEASE})")
    le.add_argument("--leader-election-namespace", default="",
                    help="the Lease's namespace (default: the operator's, SPECPAIR_OPERATOR_NAMESPACE or its pod's)")
    le.add_argument("--leader-election-id", default="", help="this candidate's holderIdentity (default: host_random)")
    le.add_argument("--lease-duration", type=float, default=15.0, help="seconds of silence before a takeover (15)")
    le.add_argument("--renew-deadline", type=float, default=10.0, help="seconds a leader acts without renewing (10)")
    le.add_argument("--retry-period", type=float, default=2.0, help="seconds between renewals and attempts (2)")
    return ap


def kopf_run_args(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Our command line -> (`kopf` argv starting with `run`, environment to set). Flags we do not
    know are Kopf's: they follow ours, in their order, and Kopf's own parser judges them."""
    ours, kopf_flags = _parser().parse_known_args(argv)
    if ours.namespace and ours.all_namespaces:
        raise SystemExit("specpair-operator: --namespace and --all-namespaces exclude each other")
    args = ["run", "--module", HANDLERS_MODULE]
    args += [f"--peering={ours.peering}"] if ours.peering else ["--standalone"]
    args += [f"--namespace={ns}" for ns in ours.namespace] or ["--all-namespaces"]
    if ours.liveness:
        args.append(f"--liveness={ours.liveness}")
    env = {"SPECPAIR_MLFLOW_TRACKING_URI": ours.mlflow_tracking_uri} if ours.mlflow_tracking_uri else {}
    return args + kopf_flags, env


@dataclass(frozen=True)
class Election:
    namespace: str
    lease: str
    identity: str
    timing: "leadership.Timing"


def election(argv: list[str], env: dict[str, str] | None = None) -> Election | None:
    """Our command line -> the leader election to run before Kopf (None: none, Kopf starts at once)."""
    from specpair_operator import leadership
    from specpair_operator.handlers import operator_namespace

    ours, _ = _parser().parse_known_args(argv)
    if not ours.leader_election:
        return None
    try:
        timing = leadership.Timing(ours.lease_duration, ours.renew_deadline, ours.retry_period)
    except ValueError as exc:
        raise SystemExit(f"specpair-operator: {exc}") from exc
    namespace = ours.leader_election_namespace or operator_namespace(env)
    if not namespace:
        raise SystemExit("specpair-operator: --leader-election needs the Lease's namespace: "
                         "--leader-election-namespace or SPECPAIR_OPERATOR_NAMESPACE")
    return Election(namespace, ours.leader_election_lease, ours.leader_election_id or leadership.default_identity(),
                    timing)


class _WaitingHealth:
    """The liveness endpoint while this process waits for the Lease (Kopf serves it once it
    leads): a waiting replica is alive, and its probes must not restart it."""

    def __init__(self, url: str):
        self.server = None
        if not url:
            return
        import http.server
        import threading
        from urllib.parse import urlsplit

        where = urlsplit(url)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802  (the stdlib's name)
                body = b'{"leading": false}'
                self.send_response(200 if self.path == (where.path or "/") else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass
        self.server = http.server.ThreadingHTTPServer((where.hostname or "0.0.0.0", where.port or 80), Handler)
        threading.Thread(target=self.server.serve_forever, name="waiting-health", daemon=True).start()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def _lead(chosen: Election, liveness: str) -> "leadership.Leadership":
    """Log in as Kopf will (service account, else kubeconfig) and block until this process leads."""
    import kopf

    from specpair_operator import leadership
    from specpair_operator.clients.kube import Kube

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(name)s [%(levelname)s] %(message)s"))
    leadership.log.addHandler(handler)
    leadership.log.setLevel(logging.INFO)
    leadership.log.propagate = False
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise SystemExit("specpair-operator: --leader-election found no credentials (service account or KUBECONFIG)")
    elector = leadership.Elector(Kube.from_connection_info(info), chosen.namespace, chosen.lease, chosen.identity,
                                 chosen.timing)
    leader = leadership.Leadership(elector)
    health = _WaitingHealth(liveness)
    try:
        leader.acquire()
    finally:
        health.close()  # Kopf binds the same address next
    return leader


def _help() -> str:
    import click
    from kopf.cli import run as kopf_run

    with click.Context(kopf_run, info_name="kopf run") as ctx:
        kopf_help = kopf_run.get_help(ctx)
    return (_parser().format_help()
            + "\nKopf's run flags, all accepted and passed on (--module and the paths are set already):\n\n"
            + kopf_help + "\n")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if _parser().parse_known_args(argv)[0].help:
        print(_help())
        return
    args, env = kopf_run_args(argv)
    os.environ.update(env)
    chosen = election(argv)
    leader = _lead(chosen, _parser().parse_known_args(argv)[0].liveness) if chosen else None
    from kopf.cli import main as kopf_cli

    try:
        kopf_cli.main(args=args, prog_name="specpair-operator")
    finally:
        if leader is not None:
            leader.release()


if __name__ == "__main__":
    main()
