"""How the worker schedules joins and prefills against the running batch (issue 51's HTTP gap):
its step timeline, and replies under concurrent joins equal to target-only."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from serving_helpers import reference

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.server.worker import EngineWorker, Failed, Finished, Job, Tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/drafting_checks.py
from drafting_checks import assert_drafted_and_accepted  # noqa: E402

SYSTEM = "You are a careful assistant who answers briefly and never guesses. " * 6


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def run_jobs(worker: EngineWorker, prompts: list[list[int]], max_new_tokens: int,
             streamed: list | None = None, then: list[list[int]] = ()) -> list:
    """Submit every prompt at once (and `then`'s prompts once the first ones have streamed a
    token: rows joining a running batch); -> each one's last event (Finished or Failed), and
    into `streamed` each one's tokens as streamed."""
    everything = list(prompts) + list(then)
    done = threading.Semaphore(0)
    first_token = threading.Event()
    events: list = [None] * len(everything)
    tokens: list[list[int]] = [[] for _ in everything]

    def sink_for(i):
        def sink(event):
            if isinstance(event, (Tokens, Finished)):
                tokens[i].extend(event.token_ids)
                first_token.set()
            if isinstance(event, (Finished, Failed)):
                events[i] = event
                done.release()
        return sink

    def submit(i):
        worker.submit(Job(prompt_ids=everything[i], params=GenerationParams(max_new_tokens=max_new_tokens),
                          sink=sink_for(i)))
    for i in range(len(prompts)):
        submit(i)
    if then:
        assert first_token.wait(120), "no token streamed in 120 s"
        for i in range(len(prompts), len(everything)):
            submit(i)
    for _ in everything:
        assert done.acquire(timeout=120), "the jobs did not finish in 120 s"
    if streamed is not None:
        streamed.extend(tokens)
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
    # What each step cost the process and its worker thread (a thread's share of the process's)
    assert all(0 <= s.thread_cpu <= s.cpu + 1e-3 for s in steps) and sum(s.thread_cpu for s in steps) > 0
    assert [s.started for s in steps] == sorted(s.started for s in steps)


def test_the_timeline_shows_a_shared_prompts_joiners_held_one_step_then_their_first_tokens(tiny_pair):
    """Six requests sharing a system prompt, queued before the worker's first step: one is
    admitted and prefills it, the other five are held that step for its blocks (StepRecord.held)
    and join together at the next boundary; each request's first token is counted once
    (StepRecord.first), at the step that emitted it."""
    target, _ = tiny_pair
    engine = SpeculativeEngine(target, "ngram", speculation=SpeculationConfig(k=4, batch_size_threshold=64))
    assert engine.paged_space is not None and engine.prefix_store is not None
    worker = EngineWorker(engine, max_batch_size=64, max_queue=16, timeline=1000)
    prompts = [engine.encode(chat(f"Question {i}: what follows {i * 7}?"), chat=True) for i in range(6)]
    done = threading.Semaphore(0)
    events: list = [None] * len(prompts)

    def sink_for(i):
        def sink(event):
            if isinstance(event, (Finished, Failed)):
                events[i] = event
                done.release()
        return sink
    for i, ids in enumerate(prompts):       # all queued before the worker's first admission
        worker.submit(Job(prompt_ids=ids, params=GenerationParams(max_new_tokens=6), sink=sink_for(i)))
    worker.start()
    try:
        for _ in prompts:
            assert done.acquire(timeout=300), "the jobs did not finish in 300 s"
    finally:
        worker.stop()
    assert all(isinstance(e, Finished) for e in events), events
    steps = list(worker.timeline)
    assert (steps[0].joined, steps[0].held, steps[0].rows) == (1, 5, 1)
    assert (steps[1].joined, steps[1].held, steps[1].rows) == (5, 0, 6)
    assert all(s.held == 0 for s in steps[1:])
    assert steps[0].first == 1                 # the first prompt fed whole: its token at once
    assert sum(s.first for s in steps) == len(prompts)
    assert all(0 <= s.first <= s.rows for s in steps)
    assert sum(e.cached_tokens > 0 for e in events) == 5


def test_rows_joining_a_drafting_batch_reply_as_target_only(tiny_pair):
    """Greedy replies of requests arriving together and joining running rows (a shared system
    prompt: one prefill, then its blocks by reference) equal each one's target-only solo reply,
    and drafts were proposed and accepted."""
    target, draft = tiny_pair
    engine = SpeculativeEngine(target, draft=draft, speculation=SpeculationConfig(k=4, batch_size_threshold=64))
    assert engine.paged_space is not None
    worker = EngineWorker(engine, max_batch_size=64, max_queue=32, timeline=1000)
    questions = [f"Question {i}: what follows {i * 7}?" for i in range(12)]
    prompts = [engine.encode(chat(q), chat=True) for q in questions]
    streamed: list = []
    worker.start()
    try:
        events = run_jobs(worker, prompts[:6], 16, streamed, then=prompts[6:])
    finally:
        worker.stop()
    assert all(isinstance(e, Finished) for e in events), events
    for question, tokens in zip(questions, streamed, strict=True):
        assert tokens == reference(tiny_pair, chat(question), 16, chat=True).token_ids, question
    assert_drafted_and_accepted([e.stats for e in events], "rows joining a drafting batch")
    assert any(s.joined and s.rows > s.joined for s in worker.timeline)     # joined running rows
    assert sum(e.cached_tokens for e in events) > 0                         # the shared prompt
