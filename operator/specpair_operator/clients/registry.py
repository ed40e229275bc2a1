"""The release registry: one MLflow registered model per pair, one model version per release.

A thin adapter over MlflowClient. Every write is idempotent (find before create, aliases and
tags are overwritten with the same value), nothing is ever deleted. MLflow's own HTTP retries
would block for minutes when the server is down; they are turned off here in favour of a short
in-call retry, and the caller (the reconcile loop) backs off between attempts.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable, TypeVar

from specpair_operator.release import content as release_mod

# Must be set before mlflow builds its HTTP session.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

# Before every request MLflow's client asks whether it runs inside Databricks (its request header
# providers): it imports dbruntime, IPython and pyspark each time, and an import that failed is
# searched for again along the whole sys.path. That was 0.43 ms of CPU a request (0.04 ms once
# these answer at once), and 17% of the operator's samples while 240 pairs were being brought up
# (2026-12-07e). Those not installed are recorded absent (None in sys.modules), once: importing
# them still fails, at once, as it would after the search.
DATABRICKS_PROBED_MODULES = ("dbruntime", "IPython", "pyspark")


def answer_absent_modules_at_once(names: tuple[str, ...] = DATABRICKS_PROBED_MODULES) -> list[str]:
    """Records each of `names` that is not installed as absent; returns those it recorded."""
    recorded = []
    for name in names:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = None  # type: ignore[assignment]  (the import system's "absent")
            recorded.append(name)
    return recorded


answer_absent_modules_at_once()

from mlflow import MlflowClient  # noqa: E402
from mlflow.entities import LoggedModelStatus, Metric, Param  # noqa: E402
from mlflow.exceptions import MlflowException, RestException  # noqa: E402

from specpair_operator.release.registry_contract import (  # noqa: E402
    EVENT_NAMES, PARAMS_PER_BATCH, TAG_EVENT, TAG_EVENT_KEY, TAG_EXPERIMENT_KIND, TAG_HASH, TAG_LOGGED_MODEL, TAG_OWNER,
    TAG_OWNER_UID, TAG_RUN_DESCRIPTION, EventRecord, RegistryUnavailable, event_record, experiment_tags,
    find_or_create, gate_error_tags, gate_experiment, gate_result_of, release_params, unlogged, with_history_line)

T = TypeVar("T")


class ModelClaimed(Exception):
    """The registered model belongs to another pair (or was not made by specpair)."""


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, RestException):
        code = getattr(exc, "get_http_status_code", lambda: 500)()
        return code >= 500 or code == 429
    if isinstance(exc, MlflowException):
        text = str(exc)
        return any(s in text for s in ("Max retries", "Connection", "API request", "timed out", "503", "502"))
    return isinstance(exc, (ConnectionError, TimeoutError, OSError))


class ReleaseRegistry:
    def __init__(self, tracking_uri: str, attempts: int = 3, backoff_s: float = 0.3):
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        self.attempts = attempts
        self.backoff_s = backoff_s

    def _call(self, fn: Callable[[], T]) -> T:
        delay = self.backoff_s
        for attempt in range(self.attempts):
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified below
                if not _is_transient(exc):
                    raise
                if attempt == self.attempts - 1:
                    raise RegistryUnavailable(f"MLflow at {self.tracking_uri} unreachable: {exc}") from exc
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    # -- registered model and versions ---------------------------------------------------

    def ensure_model(self, model_name: str, pair_ref: str, pair_uid: str = "") -> Any:
        """The pair's registered model, created and owned by it, as MLflow returned it (its
        aliases with it). A model is owned by one pair (NAMESPACE/NAME, whatever its uid: a pair
        deleted and made again takes its model back); another pair naming it gets ModelClaimed,
        so two pairs never move one model's aliases."""
        def check(model: Any) -> Any:
            owner = (model.tags or {}).get(TAG_OWNER)
            if owner != pair_ref:
                raise ModelClaimed(
                    f"registered model {model_name!r} belongs to SpecModelPair {owner}" if owner else
                    f"registered model {model_name!r} exists and was not made by specpair")
            if pair_uid and (model.tags or {}).get(TAG_OWNER_UID) != pair_uid:
                self.client.set_registered_model_tag(model_name, TAG_OWNER_UID, pair_uid)
            return model

        def find() -> Any | None:
            try:
                return check(self.client.get_registered_model(model_name))
            except RestException as exc:
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                return None

        def create() -> Any:
            return self.client.create_registered_model(
                model_name, tags={TAG_OWNER: pair_ref, TAG_OWNER_UID: pair_uid},
                description=f"Speculative-decoding releases of SpecModelPair `{pair_ref}`. "
                            "Aliases: candidate (being gated), champion (serving), previous (rollback target).")
        return self._call(lambda: find_or_create(find, create))

    def _find(self, model_name: str, digest: str) -> Any | None:
        found = self.client.search_model_versions(f"name='{model_name}' and tags.`{TAG_HASH}`='{digest}'")
        # Oldest first: if a race ever made two, everyone agrees on the same one.
        return min(found, key=lambda v: int(v.version)) if found else None

    def find_version(self, model_name: str, digest: str) -> Any | None:
        return self._call(lambda: self._find(model_name, digest))

    def ensure_release(self, model_name: str, rel: dict[str, Any], digest: str) -> str:
        """The model version holding this release, created with its release run if missing."""
        existing = self.find_version(model_name, digest)
        if existing is not None:
            return str(existing.version)
        exp_id = self._experiment(model_name)

        def find_or_create() -> str:
            # Every attempt looks first: when MLflow committed a create whose reply was lost (a
            # timeout, a dropped connection), the retry finds that version instead of making a
            # second one with the same hash.
            again = self._find(model_name, digest)
            if again is not None:
                return str(again.version)
            # The release run is resumed the same way: each of its steps is done once, so an
            # operator killed between them gets one step further every time.
            runs = self.client.search_runs([exp_id], filter_string=f"tags.`{TAG_HASH}` = '{digest}'",
                                           max_results=1, order_by=["attributes.start_time ASC"])
            run = runs[0] if runs else self.client.create_run(
                exp_id, tags={"mlflow.runName": f"release-{digest[:12]}", TAG_HASH: digest,
                              TAG_RUN_DESCRIPTION: release_mod.describe_release(rel, digest)[:8000]})
            run_id = run.info.run_id
            # The release's settings, so MLflow's comparison of two versions (their release runs)
            # lines them up setting by setting: those the run lacks, so a try whose first batch
            # landed (its reply lost) still logs the batches after it.
            self._log_params(run_id, release_params(rel), dict(run.data.params))
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "release.json")
                with open(path, "w") as f:
                    json.dump(rel, f, indent=2, sort_keys=True)
                if not self.client.list_artifacts(run_id, "release"):
                    self.client.log_artifact(run_id, path, "release")
                # The version's logged model: the gate logs its headline figures to it, and
                # MLflow's version page shows a logged model's metrics. Found by its run first,
                # so an operator killed after creating it does not make a second.
                made = self.client.search_logged_models(experiment_ids=[exp_id],
                                                        filter_string=f"source_run_id = '{run_id}'", max_results=1)
                model = made[0] if made else self.client.create_logged_model(
                    exp_id, name=f"release-{digest[:12]}", source_run_id=run_id, params=release_params(rel),
                    tags={TAG_HASH: digest})
                model_id = model.model_id
                if model.status != LoggedModelStatus.READY:
                    self.client.log_model_artifacts(model_id, d)
                    self.client.finalize_logged_model(model_id, "READY")
                if run.data.tags.get(TAG_LOGGED_MODEL) != model_id:
                    self.client.set_tag(run_id, TAG_LOGGED_MODEL, model_id)
            if run.info.status != "FINISHED":
                self.client.set_terminated(run_id)
            mv = self.client.create_model_version(
                model_name, source=f"models:/{model_id}", run_id=run_id, model_id=model_id,
                tags=release_mod.release_tags(rel, digest),
                description=release_mod.describe_release(rel, digest))
            # A create of an earlier try that the server finished after this try's find (its
            # reply timed out while MLflow waited on a lock) made an older version of the same
            # release: everyone answers the oldest, this try and every later find.
            oldest = self._find(model_name, digest)
            return str(oldest.version if oldest is not None else mv.version)

        return self._call(find_or_create)

    def _log_params(self, run_id: str, wanted: dict[str, str], logged: dict[str, str]) -> None:
        """`wanted` on the run, in batches of MLflow's largest, skipping what it holds. A batch
        the server refuses or does not answer is checked against the run before it counts as
        failed: a request of an earlier try, still waiting on the server's lock when that try
        timed out, may have written the same parameters between this try's read and its write
        (MLflow's sqlite store then refuses the second insert: UNIQUE constraint)."""
        todo = unlogged(wanted, logged)
        for i in range(0, len(todo), PARAMS_PER_BATCH):
            batch = dict(todo[i:i + PARAMS_PER_BATCH])
            try:
                self.client.log_batch(run_id, params=[Param(k, v) for k, v in batch.items()])
            except MlflowException:
                if unlogged(batch, dict(self.client.get_run(run_id).data.params)):
                    raise

    def _experiment(self, model_name: str) -> str:
        name = gate_experiment(model_name)

        def find() -> str | None:
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                return None
            if TAG_EXPERIMENT_KIND not in (exp.tags or {}):
                # An experiment made before it had a kind (or by an older gate runner) opens on
                # the runs from now on too.
                for key, value in experiment_tags().items():
                    self.client.set_experiment_tag(exp.experiment_id, key, value)
            return exp.experiment_id
        return self._call(lambda: find_or_create(
            find, lambda: self.client.create_experiment(name, tags=experiment_tags())))

    def version_tags(self, model_name: str, version: str) -> dict[str, str]:
        return dict(self._call(lambda: self.client.get_model_version(model_name, version)).tags)

    def set_tags(self, model_name: str, version: str, tags: dict[str, str]) -> None:
        """The tags, in the dict's order; then, for an event mark among them (promotion, shadow
        verdict, SpeculationOff, rollback), the record a reviewer reads. The mark first: it is the
        operator's crash safety and must not wait on the record; and the record is keyed by the
        mark as written (a pass that dies before writing it plans it again with another
        timestamp or reason). An operator killed between the two leaves that one event without
        its record (docs/mlflow.md)."""
        events = [(k, v) for k, v in tags.items() if k in EVENT_NAMES]
        before = self.version_tags(model_name, version) if events else {}
        for k, v in tags.items():
            self._call(lambda k=k, v=v: self.client.set_model_version_tag(model_name, version, k, v))
        for k, v in events:
            event = event_record(k, v, version, {**before, **tags})
            if event is not None and before.get(k) != v:   # a mark written again is no new event
                self._record_event(model_name, version, event)

    def _record_event(self, model_name: str, version: str, event: EventRecord) -> None:
        """The event's run (its evidence: description and metrics), a short tag in words on the
        version and a line in the version's history (its description), each once."""
        exp_id = self._experiment(model_name)

        def record() -> None:
            # Each step once, and each found done when an earlier attempt (a lost reply, an
            # operator killed halfway) got that far.
            found = self.client.search_runs([exp_id], filter_string=f"tags.`{TAG_EVENT_KEY}` = '{event.key}'",
                                            max_results=1)
            run = found[0] if found else self.client.create_run(exp_id, tags={
                "mlflow.runName": f"{event.name}-v{version}", TAG_EVENT: event.name, TAG_EVENT_KEY: event.key,
                "specpair.model_version": str(version), TAG_RUN_DESCRIPTION: event.description[:8000]})
            run_id = run.info.run_id
            missing = unlogged(event.metrics or {}, dict(run.data.metrics))
            if missing:
                now = int(time.time() * 1000)
                try:
                    self.client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in missing])
                except MlflowException:   # written by an earlier try's late request? (_log_params)
                    if unlogged(dict(missing), dict(self.client.get_run(run_id).data.metrics)):
                        raise
            mv = self.client.get_model_version(model_name, version)
            if f"/runs/{run_id})" not in (mv.description or ""):
                stamp = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(run.info.start_time / 1000))
                line = f"{stamp} **{event.name}**: {event.summary} ([evidence](#/experiments/{exp_id}/runs/{run_id}))"
                self.client.update_model_version(model_name, version, with_history_line(mv.description or "", line))
            if (mv.tags or {}).get(event.version_tag) != event.summary:
                self.client.set_model_version_tag(model_name, version, event.version_tag, event.summary)
            if run.info.status != "FINISHED":
                self.client.set_terminated(run_id)
        self._call(record)

    def count_versions(self, model_name: str) -> int:
        return len(self._call(lambda: self.client.search_model_versions(f"name='{model_name}'")))

    # -- aliases -----------------------------------------------------------------------

    def aliases(self, model_name: str) -> dict[str, str]:
        return {k: str(v) for k, v in self._call(lambda: self.client.get_registered_model(model_name)).aliases.items()}

    def set_alias(self, model_name: str, alias: str, version: str) -> None:
        self._call(lambda: self.client.set_registered_model_alias(model_name, alias, version))

    # -- gating ------------------------------------------------------------------------

    def gate_result(self, model_name: str, version: str) -> tuple[str, dict[str, Any] | None, str]:
        """(status, verdict or None, message) as the gate runner recorded them on the version."""
        return gate_result_of(self.version_tags(model_name, version))

    def for_pass(self) -> "PassRegistry":
        return PassRegistry(self)

    def record_gate_error(self, model_name: str, version: str, message: str) -> None:
        self.set_tags(model_name, version, gate_error_tags(message))


class NotReadYet(Exception):
    """A read local_first's function made that this pass has not: it runs again on a thread."""


class PassRegistry:
    """One reconcile pass's view of the registry: a model's aliases and a version's tags are
    read from MLflow once per pass and then answered from what was read. A pass asks for the
    same ones several times (the candidate's tags for its release, its gate result and its
    world; the champion's for its serving and its verdict), and every request costs the MLflow
    server far more than the pass's own work (a pass every 0.4 s per pair, as the tests once
    ran, kept it one of the suite's largest CPU users). A write through this view drops what it changed, so the pass
    reads its own writes; the next pass starts empty, so others' writes (the gate's verdict)
    are seen one pass later at most, as before."""

    def __init__(self, registry: ReleaseRegistry):
        self.registry = registry
        self._aliases: dict[str, dict[str, str]] = {}
        self._tags: dict[tuple[str, str], dict[str, str]] = {}
        self._local_only = False      # inside local_first: a read not yet made raises NotReadYet

    def answered(self, method: str, *args: Any) -> bool:
        """Whether `method(*args)` is answered from what this pass has read, without asking MLflow."""
        if method == "aliases":
            return args[0] in self._aliases
        if method in ("version_tags", "gate_result"):
            return (args[0], str(args[1])) in self._tags
        return False

    async def local_first(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, a function that only reads through this view: on the event loop while every
        read it makes is answered from this pass's reads, and run again on a thread (MLflow's
        client blocks) from its first read that is not."""
        self._local_only = True
        try:
            return fn(*args)
        except NotReadYet:
            pass
        finally:
            self._local_only = False
        return await asyncio.to_thread(fn, *args)

    async def read(self, method: str, *args: Any) -> Any:
        """`method(*args)`: on the event loop when this pass's reads answer it, else on a thread
        (MLflow's client blocks). A settled pass's reads are all answered so: a hop to a thread
        and back for each (seven a pass) cost more CPU than the answers."""
        fn = getattr(self, method)
        if self.answered(method, *args):
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    def ensure_model(self, model_name: str, pair_ref: str, pair_uid: str = "") -> None:
        model = self.registry.ensure_model(model_name, pair_ref, pair_uid)
        self._aliases[model_name] = {k: str(v) for k, v in (getattr(model, "aliases", None) or {}).items()}

    def ensure_release(self, model_name: str, rel: dict[str, Any], digest: str) -> str:
        return self.registry.ensure_release(model_name, rel, digest)

    def aliases(self, model_name: str) -> dict[str, str]:
        if model_name not in self._aliases:
            if self._local_only:
                raise NotReadYet(model_name)
            self._aliases[model_name] = self.registry.aliases(model_name)
        return dict(self._aliases[model_name])

    def version_tags(self, model_name: str, version: str) -> dict[str, str]:
        key = (model_name, str(version))
        if key not in self._tags:
            if self._local_only:
                raise NotReadYet(f"{model_name} v{version}")
            self._tags[key] = self.registry.version_tags(model_name, version)
        return dict(self._tags[key])

    def gate_result(self, model_name: str, version: str) -> tuple[str, dict[str, Any] | None, str]:
        return gate_result_of(self.version_tags(model_name, version))

    def set_alias(self, model_name: str, alias: str, version: str) -> None:
        self._aliases.pop(model_name, None)
        self.registry.set_alias(model_name, alias, version)

    def set_tags(self, model_name: str, version: str, tags: dict[str, str]) -> None:
        self._tags.pop((model_name, str(version)), None)
        self.registry.set_tags(model_name, version, tags)

    def record_gate_error(self, model_name: str, version: str, message: str) -> None:
        self._tags.pop((model_name, str(version)), None)
        self.registry.record_gate_error(model_name, version, message)
