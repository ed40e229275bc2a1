"""The engine worker: one thread owns the running Batch and is the only one to touch it.

The decoding loop is synchronous torch code, so it runs in a dedicated thread. Requests wait in a
bounded queue and join the batch at step boundaries (continuous batching); commands from other
threads (cancel, SetSpeculation, abort on shutdown) are applied at step boundaries too, so the
batch never changes under a running step. Results go back through each job's `sink`, a callable
that must be thread-safe (the gRPC layer hands events to its event loop).

Nothing here knows about gRPC: events carry plain values and a failure kind the service maps to
a status code.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from specpair.config import GenerationParams
from specpair.contract import DEFAULT_CATEGORY
from specpair.errors import SpecpairError
from specpair.stats import AcceptanceStats, AcceptanceWindow, RequestMoments

log = logging.getLogger("specpair.server")

# Requests decoded together unless --max-batch-size says otherwise, where the engine's cache is
# not paged. 32: a platform's load of 32 concurrent chats runs as one batch, where 8 kept three
# quarters of them queued behind the first (the figures, taken on a busy machine:
# docs/measurements/2026-12-06-prefix-batch-cpu.md). Where it is paged (the CPU's C path), the
# default is what its block pool holds (paged_cache.PagedSpace.max_rows), and requests are admitted
# by free blocks besides.
DEFAULT_MAX_BATCH_SIZE = 32


def default_max_batch_size(engine) -> int:
    """The batch size a server admits without --max-batch-size: the paged pool's, else 32."""
    space = getattr(engine, "paged_space", None)
    return space.max_rows if space is not None else DEFAULT_MAX_BATCH_SIZE


def decode_rows(engine, max_batch_size: int | None) -> int:
    """Rows decoded together: --max-batch-size where set; else the rows start-up measured as
    paying (SpeculativeEngine.decode_rows, cli.decide_decode_rows_at_startup) within what
    admission holds, at first (the worker prices them again at the context it serves:
    EngineWorker._rows_at_context); else all of those."""
    if max_batch_size is not None:
        return max_batch_size
    admitted = default_max_batch_size(engine)
    measured = getattr(engine, "decode_rows", None)
    return admitted if measured is None else max(1, min(measured, admitted))


@dataclass(frozen=True)
class StepRecord:
    """One engine step as the worker saw it (EngineWorker.timeline): where a loaded server's time
    goes, step by step (bench/worker_timeline.py prints it)."""

    started: float        # time.perf_counter() at the step's start
    seconds: float        # the step's wall time
    waited: float         # idle on the condition since the last step (nothing to step)
    rows: int             # rows in the batch when it stepped
    joined: int           # rows admitted at this step's boundary
    fed: int              # prompt positions the target had not cached (prefills, recomputes)
    k: int                # the step's largest k (Batch.last_k)
    emitted: int          # tokens the step's rows committed
    # Requests admitted but held at this step's boundary for a running row to store their
    # prompt's first uncached blocks (Batch.prefix_pending), and rows whose first token this
    # step emitted: how a shared prompt's joiners reach their first tokens (issue 51's TTFT).
    held: int = 0
    first: int = 0
    # CPU seconds over the step: the process's (every thread: the kernels' pool, the HTTP loop)
    # and the worker thread's own. On a shared machine the wall time says how often the step's
    # threads were preempted; these say what it cost (issue 51's loaded figures compare these).
    cpu: float = 0.0
    thread_cpu: float = 0.0


class QueueFull(Exception):
    """No room in the waiting queue: the client should retry later (RESOURCE_EXHAUSTED)."""


class NotAccepting(Exception):
    """The worker is draining or stopped (UNAVAILABLE)."""


# -- events sent to a job's sink ------------------------------------------------------------------

@dataclass
class Tokens:
    text: str
    token_ids: list[int]
    logprobs: list | None = None     # per token when asked (decoding.StepOutput.logprobs)


@dataclass
class Finished:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: AcceptanceStats
    queue_seconds: float
    time_to_first_token: float
    total_seconds: float
    cached_tokens: int = 0       # prompt tokens served from the prefix store
    logprobs: list | None = None     # per token of token_ids when asked


@dataclass
class Failed:
    kind: str          # "unavailable" (shutdown), "internal" (engine error), "invalid" (rejected on add)
    message: str


@dataclass
class Job:
    prompt_ids: list[int]
    params: GenerationParams
    sink: Callable[[object], None]
    category: str = DEFAULT_CATEGORY     # metric label (already bounded)
    client_id: str = ""
    protocol: str = "grpc"               # metric label: "grpc" or "http"
    arrived: float = field(default_factory=time.perf_counter)
    request_id: str = ""                 # unique inside the worker, set on submit
    admitted: float | None = None
    first_token: float | None = None
    cancel_status: str | None = None     # "cancelled" / "deadline" once the client is gone
    seen: AcceptanceStats = field(default_factory=AcceptanceStats)   # stats already counted
    done: bool = False


def stats_delta(seen: AcceptanceStats, now: AcceptanceStats) -> AcceptanceStats:
    """What a sequence's stats gained since `seen` (per-step metric increments)."""
    d = AcceptanceStats()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
                 "num_target_steps", "fallback_events"):
        setattr(d, name, getattr(now, name) - getattr(seen, name))
    for name in ("num_accepted_tokens_per_pos", "num_draft_tokens_per_pos"):
        old, new = getattr(seen, name), getattr(now, name)
        setattr(d, name, [v - (old[i] if i < len(old) else 0) for i, v in enumerate(new)])
    return d


class Aggregate:
    """Acceptance of one category (or all): a sliding window and totals since start."""

    def __init__(self, window: int):
        self.window = AcceptanceWindow(window)
        self.cumulative = AcceptanceStats()
        self.requests = 0
        self.finished = RequestMoments.zero()   # over finished requests that drafted (drift's unit)

    def add_finished(self, drafted: int, accepted: int) -> None:
        self.requests += 1
        self.finished += RequestMoments.of_request(drafted, accepted)

    def add(self, delta: AcceptanceStats) -> None:
        self.cumulative.merge(delta)
        if delta.num_draft_tokens:
            self.window.add(delta.num_draft_tokens, delta.num_accepted_tokens)

    def snapshot(self) -> dict:
        stats = AcceptanceStats()
        stats.merge(self.cumulative)
        return {"window_rate": self.window.rate, "window_draft_tokens": self.window.drafted,
                "cumulative": stats, "requests": self.requests, "finished": self.finished}


class EngineWorker:
    """Owns a SpeculativeEngine's Batch in one thread; see the module docstring."""

    def __init__(self, engine, *, max_batch_size: int | None = None, max_queue: int = 32,
                 metrics=None, timeline: int = 0):
        """max_batch_size: requests admitted beside the queue (None: default_max_batch_size) and,
        where given, decoded together; else `decode_rows` of them are (the rest wait queued).
        timeline: keep the last this many steps' StepRecords (0: none)."""
        self.decode_rows = decode_rows(engine, max_batch_size)
        # Step costs measured at start-up (costs.DecodeStepCosts): the rows are decided again at
        # the context of the requests running and waiting, whenever some wait (no setting).
        self._decode_costs = getattr(engine, "decode_costs", None) if max_batch_size is None else None
        if max_batch_size is None:
            max_batch_size = default_max_batch_size(engine)
        if max_batch_size < 1 or max_queue < 0:
            raise SpecpairError("max_batch_size must be >= 1 and max_queue >= 0")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.metrics = metrics
        self.batch = engine.new_batch()
        self._pending: deque[Job] = deque()
        self._jobs: dict[str, Job] = {}          # in the batch, by request id
        self._commands: deque[tuple[Callable, Future]] = deque()
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None
        window = engine.config.fallback_window
        self._window_size = window
        self._stats_lock = threading.Lock()
        self.overall = Aggregate(window)
        self.categories: dict[str, Aggregate] = {}
        self.steps = 0
        self.timeline: deque[StepRecord] | None = deque(maxlen=timeline) if timeline else None
        self._waited = 0.0          # idle since the last step (timeline)
        self._joined = 0            # admitted since the last step (timeline)
        self._held = 0              # held at the last admission for a running row's blocks (timeline)
        # Called with (category, prompt_ids, reply_ids) of each request that finished ok, in this
        # thread: must not block (capture.CaptureWriter.offer queues without waiting).
        self.on_finished: Callable[[str, list[int], list[int]], None] | None = None

    # -- called from other threads ------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._admit_and_step_until_stopped, name="specpair-engine",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Job:
        with self._cond:
            if not self._accepting:
                raise NotAccepting("the server is shutting down")
            room = self.max_batch_size - len(self._jobs) + self.max_queue
            if len(self._pending) >= room:
                raise QueueFull(f"request queue is full ({len(self._pending)} waiting, "
                                f"{len(self._jobs)} running); retry later")
            job.request_id = f"r{next(self._ids)}"
            self._pending.append(job)
            self._cond.notify_all()
        return job

    def cancel(self, job: Job, status: str = "cancelled") -> None:
        """The client is gone: drop the job from the queue now, or from the batch at the next step."""
        with self._cond:
            if job.done:
                return
            job.cancel_status = status
            if job in self._pending:
                self._pending.remove(job)
                self._finish_cancelled(job)
            self._cond.notify_all()

    def call(self, fn: Callable[[], object], timeout: float = 30.0):
        """Run fn in the worker thread at a step boundary and return its result."""
        future: Future = Future()
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                return fn()   # not started (or stopped): nothing else touches the engine
            self._commands.append((fn, future))
            self._cond.notify_all()
        return future.result(timeout)

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False

    @property
    def busy(self) -> int:
        with self._cond:
            return len(self._pending) + len(self._jobs)

    @property
    def waiting(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self._jobs)

    def abort_all(self, message: str) -> int:
        """Fail every queued and running job (drain timeout). Returns how many were ended."""
        def abort():
            jobs = list(self._jobs.values())
            for job in jobs:
                self.batch.cancel(job.request_id)
                self._fail(job, "unavailable", message, status="aborted")
            self.batch.done.clear()
            return len(jobs)
        with self._cond:
            queued = list(self._pending)
            self._pending.clear()
        for job in queued:
            self._fail(job, "unavailable", message, status="aborted")
        return len(queued) + self.call(abort)

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._accepting = False
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def stats_snapshot(self) -> dict:
        with self._stats_lock:
            return {"overall": self.overall.snapshot(),
                    "categories": {name: agg.snapshot() for name, agg in self.categories.items()}}

    # -- the worker thread --------------------------------------------------------------------

    def warm_up(self, prompt_ids: list[int], max_new_tokens: int = 2) -> None:
        """One short request through the speculative path before the server reports SERVING."""
        controller = self.engine.controller
        events_before = controller.fallback_events
        # Warm-up rounds are not traffic: the shadow scorer does not see them either.
        with self.engine.observers_paused():
            batch = self.engine.new_batch()
            batch.add(prompt_ids, GenerationParams(max_new_tokens=max_new_tokens,
                                                   speculation_k=self.engine.config.k),
                      request_id="warm-up")
            while batch.active:
                batch.step()
        # Keep the warm-up rounds out of the acceptance window.
        controller.window.clear()
        controller.fallback_events = events_before

    def _admit_and_step_until_stopped(self) -> None:
        """The engine thread: apply commands, admit what waits, step the batch; idle on the
        condition while nothing runs; end once stopped with no job left."""
        try:
            while True:
                with self._cond:
                    self._apply_commands_locked()
                    if self._stop and not self._jobs and not self._pending:
                        break
                    self._admit_locked()
                    if not self._jobs:
                        self._publish_state()
                        idle = time.perf_counter()
                        self._cond.wait(timeout=0.5)
                        self._waited += time.perf_counter() - idle
                        continue
                self._step()
        finally:
            with self._cond:
                self._apply_commands_locked()

    def _apply_commands_locked(self) -> None:
        while self._commands:
            fn, future = self._commands.popleft()
            try:
                future.set_result(fn())
            except BaseException as exc:   # hand it to the caller, keep serving
                future.set_exception(exc)
        # Cancellations requested since the last step.
        for job in [j for j in self._jobs.values() if j.cancel_status]:
            self.batch.cancel(job.request_id)
            self._finish_cancelled(job)
        self.batch.done.clear()

    def _rows_at_context(self) -> int:
        """The rows to decode together priced at the context of the requests running and waiting
        (each its prompt and half what it may emit: its mean length while it decodes), within
        what admission holds: a long chat's step spends more on attention, which rows do not
        share, so fewer rows decode a token as fast (costs.decode_rows_at)."""
        from specpair.costs import decode_rows_at, serving_context

        costs = self._decode_costs
        lengths = [len(job.prompt_ids) + job.params.max_new_tokens // 2
                   for job in (*self._jobs.values(), *self._pending)]
        return max(1, min(decode_rows_at(costs, serving_context(lengths, costs.context)), self.max_batch_size))

    def _admit_locked(self) -> None:
        if self._decode_costs is not None and self._pending:
            self.decode_rows = self._rows_at_context()
        held = []     # waiting one step for a running row to store their prompt's first blocks
        while self._pending and len(self._jobs) < self.decode_rows:
            job = self._pending[0]
            if not self.batch.has_room(job.prompt_ids):
                break       # admission by free KV blocks: it waits, first in line, for rows to end
            self._pending.popleft()
            if self.batch.prefix_pending(job.prompt_ids):
                held.append(job)
                continue
            try:
                self.batch.add(job.prompt_ids, job.params, request_id=job.request_id)
            except SpecpairError as exc:
                self._fail(job, "invalid", str(exc), status="invalid")
                continue
            except Exception as exc:   # never let one request stop the worker thread
                log.exception("could not add request %s to the batch", job.request_id)
                self._fail(job, "internal", f"could not start decoding: {type(exc).__name__}: {exc}",
                           status="error")
                continue
            job.admitted = time.perf_counter()
            self._jobs[job.request_id] = job
            self._joined += 1
        self._pending.extendleft(reversed(held))
        self._held = len(held)

    def _step(self) -> None:
        started = time.perf_counter()
        cpu, thread_cpu = time.process_time(), time.thread_time()
        rows, fed = self.batch.active, self._uncached_positions()
        try:
            outputs = self.batch.step()
        except Exception as exc:   # a request the checks let through, an engine bug, a device error
            self._recover(exc)
            return
        self.steps += 1
        now = time.perf_counter()
        if self.timeline is not None:
            first = sum(1 for out in outputs if out.token_ids and (job := self._jobs.get(out.request_id))
                        is not None and job.first_token is None)
            self.timeline.append(StepRecord(
                started=started, seconds=now - started, waited=self._waited, rows=rows,
                joined=self._joined, fed=fed, k=self.batch.last_k,
                emitted=sum(len(out.token_ids) for out in outputs), held=self._held, first=first,
                cpu=time.process_time() - cpu, thread_cpu=time.thread_time() - thread_cpu))
        self._waited, self._joined = 0.0, 0
        done = {seq.request_id: seq for seq in self.batch.done}
        live = {seq.request_id: seq for seq in self.batch.rows}
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None:
                continue
            seq = done.get(out.request_id) or live.get(out.request_id)
            if seq is not None:
                self._count(job, seq.stats)
            if out.token_ids and job.first_token is None:
                job.first_token = now
            if out.finished and seq is not None:
                self._finish(job, self.batch.result(seq), out)
            elif out.text or out.token_ids:
                self._send(job, Tokens(text=out.text, token_ids=list(out.token_ids), logprobs=out.logprobs))
        self.batch.done.clear()
        self._publish_state()

    def _uncached_positions(self) -> int:
        """Positions of the rows' tokens their target cache lacks (what a step prefills)."""
        lengths = getattr(self.batch.target, "lengths", None)
        if self.timeline is None or lengths is None:
            return 0
        return sum(max(0, len(seq.tokens) - n) for seq, n in zip(self.batch.rows, lengths))

    def _recover(self, exc: Exception) -> None:
        """After a step raised: fail the rows that raise on their own, carry the others on.

        Each row is stepped alone in a batch of its own (its tokens so far as the prompt, its
        params, a generator of its own, the speculation controller put back afterwards), so the
        probe changes nothing the running rows read. The blameless rows move to a fresh batch that
        reads their committed tokens again, since the step that raised may have left the old one's
        caches half-written; their Sequences (tokens, generators, stats, text so far) move with
        them. When no row raises alone, or every one of several does (the device, not a request),
        nothing can be blamed and every row fails.
        """
        rows = list(self.batch.rows)
        # Outside the lock: submit and cancel go on while the rows are probed.
        blamed = {seq.request_id: error for seq in rows if (error := self._fails_alone(seq)) is not None}
        with self._cond:
            self._carry_on(exc, rows, blamed)

    def _carry_on(self, exc: Exception, rows: list, blamed: dict[str, Exception]) -> None:
        if not blamed or (len(blamed) == len(rows) > 1):
            log.error("engine step failed; failing %d running requests", len(rows), exc_info=exc)
            for job in list(self._jobs.values()):
                self._fail(job, "internal", f"engine step failed: {type(exc).__name__}: {exc}", status="error")
            self.batch.release()
            self.batch = self.engine.new_batch()
            return
        log.error("engine step failed; %d of %d requests fail alone and are ended: %s", len(blamed),
                  len(rows), ", ".join(blamed), exc_info=exc)
        self.batch.release()      # its half-written rows' blocks, before the fresh batch takes any
        fresh = self.engine.new_batch()
        fresh.speculate = self.batch.speculate
        for seq in rows:
            job = self._jobs.get(seq.request_id)
            error = blamed.get(seq.request_id)
            if error is not None:
                if job is not None:
                    self._fail(job, "internal", f"this request makes the engine step fail: "
                                                f"{type(error).__name__}: {error}", status="error")
                continue
            # add() sizes the caches for one more row; the row itself is the running Sequence.
            try:
                fresh.add(seq.tokens, dataclasses.replace(seq.params, max_new_tokens=1, temperature=0.0),
                          request_id=seq.request_id)
            except Exception as error:
                if job is not None:
                    self._fail(job, "internal", f"could not carry on after a failed engine step: "
                                                f"{type(error).__name__}: {error}", status="error")
                continue
            fresh.rows[-1] = seq
        self.batch = fresh

    def _fails_alone(self, seq) -> Exception | None:
        """The exception one step of this row raises in a batch of its own (None: it steps)."""
        controller = self.engine.controller
        saved = {name: copy.deepcopy(value) for name, value in vars(controller).items() if name != "config"}
        probe = self.engine.new_batch()
        probe.speculate = self.batch.speculate
        probe.prefill_budget = None     # the whole row in its one step, not a chunk of its prompt
        try:
            remaining = max(1, seq.params.max_new_tokens - len(seq.generated))
            probe.add(seq.tokens, dataclasses.replace(seq.params, max_new_tokens=remaining),
                      request_id=seq.request_id)
            probe.step()
            return None
        except Exception as error:
            return error
        finally:
            vars(controller).update(saved)

    def _count(self, job: Job, stats: AcceptanceStats) -> None:
        delta = stats_delta(job.seen, stats)
        job.seen.merge(delta)
        with self._stats_lock:
            self.overall.add(delta)
            self._category(job.category).add(delta)
        if self.metrics is not None:
            self.metrics.record_step(job.category, delta)

    def _category(self, name: str) -> Aggregate:
        agg = self.categories.get(name)
        if agg is None:
            agg = self.categories[name] = Aggregate(self._window_size)
        return agg

    def _finish(self, job: Job, result, out) -> None:
        self._jobs.pop(job.request_id, None)
        job.done = True
        end = time.perf_counter()
        first = job.first_token or end
        admitted = job.admitted or job.arrived
        completion = len(result.token_ids)
        # Drift's unit: audited requests only (stats.AcceptanceStats.drift_sample, costs.RequestAudit).
        drafted, accepted = result.stats.drift_sample() if hasattr(result.stats, "drift_sample") else (0, 0)
        with self._stats_lock:
            self.overall.add_finished(drafted, accepted)
            self._category(job.category).add_finished(drafted, accepted)
        if self.metrics is not None:
            tpot = (end - first) / (completion - 1) if completion > 1 else None
            self.metrics.record_finished(job.category, "ok", protocol=job.protocol, queue=admitted - job.arrived,
                                         ttft=first - job.arrived, e2e=end - job.arrived, tpot=tpot)
        self._send(job, Finished(text=out.text, token_ids=list(out.token_ids), finish_reason=result.finish_reason,
                          prompt_tokens=result.prompt_tokens, completion_tokens=completion,
                          stats=result.stats, queue_seconds=admitted - job.arrived,
                          time_to_first_token=first - job.arrived, total_seconds=end - job.arrived,
                          cached_tokens=result.cached_tokens, logprobs=out.logprobs))
        if self.on_finished is not None:
            try:
                self.on_finished(job.category, job.prompt_ids, result.token_ids)
            except Exception:   # capture is a side road: a failure in it never touches serving
                log.warning("on_finished failed for %s", job.request_id, exc_info=True)

    def _finish_cancelled(self, job: Job) -> None:
        self._jobs.pop(job.request_id, None)
        if job.done:
            return
        job.done = True
        if self.metrics is not None:
            self.metrics.record_finished(job.category, job.cancel_status or "cancelled", protocol=job.protocol)

    def _fail(self, job: Job, kind: str, message: str, status: str) -> None:
        self._jobs.pop(job.request_id, None)
        if job.done:
            return
        job.done = True
        if self.metrics is not None:
            self.metrics.record_finished(job.category, status, protocol=job.protocol)
        self._send(job, Failed(kind=kind, message=message))

    @staticmethod
    def _send(job: Job, event) -> None:
        try:
            job.sink(event)
        except Exception:   # the client's side is gone (e.g. its event loop closed): drop the event
            log.debug("could not deliver %s for %s", type(event).__name__, job.request_id, exc_info=True)

    def _publish_state(self) -> None:
        if self.metrics is None:
            return
        controller = self.engine.controller
        with self._stats_lock:
            rates = {name: agg.window.rate for name, agg in self.categories.items()}
            overall = self.overall.window.rate
        budget = self.engine.kv_budget
        self.metrics.set_state(running=len(self._jobs), waiting=len(self._pending), k=self.batch.last_k,
                               speculating=controller.should_speculate() and self.engine.drafter is not None,
                               window_rate=overall, category_rates=rates,
                               kv_usage=self.batch.kv_in_use() / budget if budget else None)
        # Rows admitted target-only (or stopped drafting) for want of KV memory: the engine keeps
        # the running total, the counter catches up with it here.
        self.metrics.record_memory_fallbacks(self.engine.memory_fallbacks)
        self.metrics.set_decode_rows(self.decode_rows)      # (priced again as requests come)
        prefix = self.engine.prefix_stats
        self.metrics.record_prefix_cache(prefix.looked_up, prefix.served)
        space = getattr(self.engine, "paged_space", None)
        if space is not None:
            self.metrics.record_preemptions(space.preemptions)
        shadow = getattr(self.engine, "shadow", None)
        if shadow is not None:   # a candidate drafter scored beside the serving one (specpair/shadow.py)
            self.metrics.record_shadow(shadow.candidate.version, shadow.candidate.content_hash,
                                       shadow.snapshot(), shadow.skipped_steps)
