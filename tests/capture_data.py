"""Captured traffic for the training tests (issue 58): the target's own greedy replies to chat
requests, written by the engine's real CaptureWriter (engine/specpair/capture.py) as a serving
pod writes them, so `distill --from-capture` reads what serving writes."""

from __future__ import annotations

import inspect
import textwrap

from specpair.capture import CaptureSettings, CaptureWriter
from specpair.config import GenerationParams

EXTRACTION = ["List the names defined in this code, one per line:\n\n{}",
              "Extract every quoted string from this text:\n\n{}"]


def extraction_prompts(count: int) -> list[str]:
    lines = [ln for ln in inspect.getsource(textwrap).splitlines() if ln.strip()]
    return [EXTRACTION[i % 2].format("\n".join(lines[4 * i:4 * i + 4])) for i in range(count)]


def write_capture(directory, engine, by_category: dict[str, list[str]], release: str = "3",
                  max_new_tokens: int = 40, chat: bool = True) -> None:
    """Every request's greedy target-only reply, captured (sample rate 1) under `release`, with
    the clock at 1000 + i for the i-th request so the order is known; sent chat-formatted, or as
    plain completions (`chat` False)."""
    ticks = iter(range(1000, 10_000))
    now = [1000.0]

    def clock() -> float:
        return now[0]

    writer = CaptureWriter(CaptureSettings(str(directory), sample_rate=1.0, retention_seconds=366 * 24 * 3600),
                           release=release, tokenizer="tok-sha", pod="engine-0", clock=clock).start()
    for category, prompts in by_category.items():
        results = engine.generate(prompts, GenerationParams(max_new_tokens=max_new_tokens), chat=chat,
                                  speculate=False)
        for prompt, result in zip(prompts, results):
            now[0] = float(next(ticks))
            writer.offer(category, engine.encode(prompt, chat=chat), list(result.token_ids))
            writer.flush()
    writer.stop()
