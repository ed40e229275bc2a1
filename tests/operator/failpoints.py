"""The real operator with failpoints on its writes, run by `kopf run -m failpoints` in a process
of its own (failing_operator.py forks one per life; test_operator_leadership.py starts them).

Every write the operator makes goes through two adapters: MlflowClient (registry.py) and the
Kubernetes client (kube.py: create, merge_patch, json_patch, delete; dry runs write nothing and
are not counted). Wrapping their write methods here, outside the operator's code,
gives two ways to fail that a real deployment meets:

    SPECPAIR_FAILPOINT=crash-after-first-write
        the process performs its first write and dies at once (os._exit, like SIGKILL or an
        OOM kill): no status patch, no handler bookkeeping, nothing in memory survives. Run
        again and again, each life gets one write further, so every write of a reconcile is
        followed by a crash once.
    SPECPAIR_FAILPOINT=lose-first-reply
        the first call of each write method is performed and then answered with a lost reply
        (a connection error), as when a timeout fires after the server committed.
    SPECPAIR_FAILPOINT=crash-after:WRITE
        the process dies right after its first write described as WRITE (a prefix of the
        descriptions below, e.g. `mlflow.set_model_version_tag specpair.promoted_at` or
        `kube.json_patch secrets NAME`).
    SPECPAIR_FAILPOINT=log
        nothing fails; every write is logged.

SPECPAIR_FAILPOINT_SPARE (descriptions' prefixes, comma-separated) names writes that are logged
but neither fail nor count as a life's first write (e.g. `kube.merge_patch specmodelpairs`, the
status writes of a canary's judgement: its evidence is the operator's memory, which a kill after
every pass's status would never let grow).

Each write is appended to SPECPAIR_FAILPOINT_LOG as one JSON line: {"write", "pid", "at", "failed"}.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from typing import Any

from mlflow import MlflowClient

from specpair_operator import handlers  # noqa: F401 - registers the operator's handlers with Kopf
from specpair_operator.clients.kube import Kube, KubeError

MODE, LOG, SPARE = "", "", ()
MLFLOW_WRITES = ("create_registered_model", "set_registered_model_tag", "create_experiment", "create_run",
                 "log_artifact", "set_terminated", "create_model_version", "set_model_version_tag",
                 "set_registered_model_alias", "delete_registered_model_alias", "delete_model_version_tag")
KUBE_WRITES = ("create", "merge_patch", "json_patch", "delete")

_lock = threading.Lock()
_writes = 0
_lost: set[str] = set()


def configure() -> None:
    """The mode, log and spared writes from the environment, no write counted yet: at import,
    and again in each operator forked from a process that imported this module
    (failing_operator.py)."""
    global MODE, LOG, SPARE, _writes
    MODE = os.environ.get("SPECPAIR_FAILPOINT", "")
    LOG = os.environ.get("SPECPAIR_FAILPOINT_LOG", "")
    SPARE = tuple(p for p in os.environ.get("SPECPAIR_FAILPOINT_SPARE", "").split(",") if p)
    _writes = 0
    _lost.clear()


def _describe(name: str, args: tuple[Any, ...]) -> str:
    if name == "create":  # a Secret by its name too: the CA's and an engine's are told apart
        kind = args[0].get("kind")
        return f"kube.create {kind}" + (f" {args[0]['metadata']['name']}" if kind == "Secret" else "")
    if name == "json_patch":
        return f"kube.json_patch {args[1]} {args[3]}"
    if name in ("merge_patch", "delete"):
        return f"kube.{name} {args[1]}"
    detail = {"set_model_version_tag": 2, "set_registered_model_alias": 1}.get(name)  # the tag key, the alias
    return f"mlflow.{name}" + (f" {args[detail]}" if detail is not None and len(args) > detail else "")


def _after_write(name: str, args: tuple[Any, ...]) -> bool:
    """Log the write that just happened; die or report a lost reply as the mode says."""
    global _writes
    what = _describe(name, args)
    spared = what.startswith(SPARE) if SPARE else False
    with _lock:
        _writes += 0 if spared else 1
        lose = MODE == "lose-first-reply" and name not in _lost and not spared
        if lose:
            _lost.add(name)
        crash = not spared and ((MODE == "crash-after-first-write" and _writes == 1) or
                                (MODE.startswith("crash-after:") and what.startswith(MODE.split(":", 1)[1])))
        if LOG:
            with open(LOG, "a") as f:
                f.write(json.dumps({"write": what, "pid": os.getpid(), "at": round(time.time(), 3),
                                    "failed": "crash" if crash else "reply lost" if lose else ""}) + "\n")
    if crash:
        os._exit(137)
    return lose


def _wrap_mlflow(name: str) -> None:
    original = getattr(MlflowClient, name)

    @functools.wraps(original)
    def write(self: MlflowClient, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if _after_write(name, args):
            raise ConnectionError(f"failpoint: the reply to {name} was lost")
        return result
    setattr(MlflowClient, name, write)


def _wrap_kube(name: str) -> None:
    original = getattr(Kube, name)

    @functools.wraps(original)
    async def write(self: Kube, *args: Any, **kwargs: Any) -> Any:
        result = await original(self, *args, **kwargs)
        if kwargs.get("dry_run"):
            return result  # the API server wrote nothing
        if _after_write(name, args):
            raise KubeError(504, f"failpoint: the reply to {name} was lost")
        return result
    setattr(Kube, name, write)


configure()
for _name in MLFLOW_WRITES:   # with no mode, a wrapper only passes the call on
    _wrap_mlflow(_name)
for _name in KUBE_WRITES:
    _wrap_kube(_name)
