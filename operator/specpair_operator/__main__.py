"""`python -m specpair_operator` / `specpair-operator`: `kopf run` with the specpair handlers (no torch).

Every flag of `kopf run` is accepted and handed to Kopf as it is (`--log-format=json`, `--debug`,
`--quiet`, `--log-refkey`, `--peering`, ...). On top, the operator brings its own defaults: Kopf
runs standalone (unless `--peering` names a peering object), all namespaces when no `--namespace`
is given, its liveness endpoint where the chart's probes call it, and `--mlflow-tracking-uri`.
"""

from __future__ import annotations

import argparse
import os
import sys

HANDLERS_MODULE = "specpair_operator.handlers"
DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


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
    from kopf.cli import main as kopf_cli

    kopf_cli.main(args=args, prog_name="specpair-operator")


if __name__ == "__main__":
    main()
