"""How the worker schedules joins and prefills against the running batch (issue 51's HTTP gap):
its step timeline, and replies under concurrent joins equal to target-only."""

from __future__ import annotations

import threading

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.server.worker import EngineWorker, Failed, Finished, Job

SYSTEM = "You are a careful assistant who answers briefly and never guesses. " * 6


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def run_jobs(worker: EngineWorker, prompts: list[list[int]], max_new_tokens: int) -> list:
    """Submit every prompt at once; -> each one's last event (Finished or Failed)."""
    done = threading.Semaphore(0)
    events: list = [None] * len(prompts)

    def sink_for(i):
        def sink(event):
            if isinstance(event, (Finished, Failed)):
                events[i] = event
                done.release()
        return sink
    for i, ids in enumerate(prompts):
        worker.submit(Job(prompt_ids=ids, params=GenerationParams(max_new_tokens=max_new_tokens),
                          sink=sink_for(i)))
    for _ in prompts:
        assert done.acquire(timeout=120), "the jobs did not finish in 120 s"
    return events


def test_the_timeline_accounts_for_every_step_join_prefill_and_token(tiny_pair):
    target, _ = tiny_pair
    engine = SpeculativeEngine(target, "ngram", speculation=SpeculationConfig(k=4, batch_size_threshold=64))
    assert engine.paged_space is not None
    worker = EngineWorker(engine, max_batch_size=64, max_queue=16, timeline=1000)
    prompts = [engine.encode(chat(f"Question {i}: what follows {i * 7}?"), chat=True) for i in range(6)]
    worker.start()
    try:
        events = run_jobs(worker, prompts, 12)
    finally:
        worker.stop()
    assert all(isinstance(e, Finished) for e in events), events
    steps = list(worker.timeline)
    assert len(steps) == worker.steps
    assert sum(s.joined for s in steps) == len(prompts)
    assert sum(s.emitted for s in steps) == sum(e.completion_tokens for e in events)
    # Every prompt position was fed once, less what the prefix cache served.
    assert sum(s.fed for s in steps) >= sum(len(p) for p in prompts) - sum(e.cached_tokens for e in events)
    assert all(s.rows >= 1 and s.seconds > 0 for s in steps)
    assert [s.started for s in steps] == sorted(s.started for s in steps)
