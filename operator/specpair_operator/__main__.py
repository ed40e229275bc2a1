"""`python -m specpair_operator` / `specpair-operator`: run the Kopf operator (no torch)."""

from __future__ import annotations

import argparse
import logging
import os


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="specpair-operator", description=__doc__)
    ap.add_argument("-n", "--namespace", action="append", default=[],
                    help="namespace (or glob) to watch; repeatable; default: all namespaces")
    ap.add_argument("--mlflow-tracking-uri", default=None, help="overrides SPECPAIR_MLFLOW_TRACKING_URI")
    ap.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="Kopf liveness endpoint")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.mlflow_tracking_uri:
        os.environ["SPECPAIR_MLFLOW_TRACKING_URI"] = args.mlflow_tracking_uri
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import kopf

    from . import handlers  # noqa: F401 - registers the handlers

    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=args.liveness or None)


if __name__ == "__main__":
    main()
