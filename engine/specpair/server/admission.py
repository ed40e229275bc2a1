"""The one way a generation request enters the worker, whichever protocol carried it.

    RequestFields -> check_fields (every field against its real range) -> tokenize (one thread
    for both protocols: a tokenizer is not safe to use from two at once) -> fit_context ->
    bounded category label -> a Job in the worker, its events handed to the caller's event loop

Each front reads its own wire format into RequestFields and answers refusals in its own terms;
what is refused, and how it is counted in `specpair_requests_total`, is decided here once:
InvalidField / TooLarge ("invalid"), QueueFull ("rejected"), NotAccepting ("unavailable"), and a
client gone while its prompt was tokenized (the front says whether "cancelled" or "deadline").
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from specpair.contract import DEFAULT_CATEGORY
from specpair.errors import SpecpairError
from specpair.server.requests import DEFAULT_MAX_NEW_TOKENS, InvalidField, RequestFields, check_fields, fit_context
from specpair.server.worker import Job, NotAccepting, QueueFull


@dataclass
class Admitted:
    """A request in the worker: its job (to cancel), the queue its events arrive on, and `replied`,
    which its front calls once the reply has ended however it ended (sent, failed, or the client
    gone); calling it again does nothing."""

    job: Job
    events: asyncio.Queue
    replied: Callable[[], None]


class Admission:
    """Admits requests into one server's worker (`state`: engine, worker, limits, metrics)."""

    def __init__(self, state):
        self.state = state
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="specpair-tokenize")
        # Requests admitted whose replies have not ended: a request the worker has finished may
        # still be on its way to the client, and a drain waits for it too. Both fronts' threads.
        self._replying: set[int] = set()
        self._replying_lock = threading.Lock()

    @property
    def replying(self) -> int:
        """How many admitted requests' replies have not ended yet (both protocols)."""
        with self._replying_lock:
            return len(self._replying)

    def close(self) -> None:
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def refused(self, category: str, status: str, protocol: str) -> None:
        """Count a Generate request that never reached the worker."""
        self.state.count_rejected(category, status, protocol)

    async def admit(self, fields: RequestFields, *, protocol: str, arrived: float,
                    client_id: str = "", default_max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS,
                    gone: Callable[[], str] = lambda: "cancelled") -> Admitted:
        """Check, tokenize and submit; raises InvalidField, QueueFull or NotAccepting (counted).

        arrived: when the request arrived (time.perf_counter()); gone: why the client left, asked
        if it leaves while its prompt is tokenized.
        """
        state = self.state
        engine = state.engine
        category = DEFAULT_CATEGORY
        try:
            checked = check_fields(fields, state.limits, vocab_size=engine.vocab_size,
                                   default_max_new_tokens=default_max_new_tokens)
            category = checked.params.category
            loop = asyncio.get_running_loop()
            try:
                ids = await loop.run_in_executor(self.tokenize_pool, engine.encode, checked.prompt, checked.chat)
            except SpecpairError as exc:     # the tokenizer refused the prompt
                raise InvalidField(checked.prompt_field, str(exc)) from None
            fit_context(checked, len(ids), engine.target.context_length)
        except InvalidField:
            self.refused(category, "invalid", protocol)
            raise
        except asyncio.CancelledError:
            self.refused(category, gone(), protocol)
            raise
        category = state.metrics.category(category)     # a bounded label set
        events: asyncio.Queue = asyncio.Queue()
        job = Job(prompt_ids=ids, params=checked.params, category=category, client_id=client_id,
                  protocol=protocol, arrived=arrived,
                  sink=lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        key = id(job)
        with self._replying_lock:
            self._replying.add(key)

        def replied() -> None:
            with self._replying_lock:
                self._replying.discard(key)
        try:
            state.worker.submit(job)
        except QueueFull:
            replied()
            self.refused(category, "rejected", protocol)
            raise
        except NotAccepting:
            replied()
            self.refused(category, "unavailable", protocol)
            raise
        return Admitted(job=job, events=events, replied=replied)
