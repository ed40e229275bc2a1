"""Waiting in tests: poll a condition until it holds or its deadline passes, then fail the test
saying what was awaited (and, where given, the state that was seen instead). Never a fixed sleep:
a test waits as long as its condition takes, and no longer than its deadline."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

# SPECPAIR_LOG_WAITS=1: each wait that ends prints how long it took (run with -s), to see where
# a slow test's seconds go.
LOG_WAITS = bool(os.environ.get("SPECPAIR_LOG_WAITS"))


def wait_until(what: str, predicate: Callable[[], Any], timeout: float = 60.0, interval: float = 0.25,
               show: Callable[[], Any] | None = None) -> Any:
    """The first truthy value of predicate(), looked at every `interval` seconds; an
    AssertionError naming `what` (and show()'s state) when none comes within `timeout`."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        got = predicate()
        if got:
            if LOG_WAITS:
                print(f"[wait] {time.monotonic() - started:6.1f} s  {what}", file=sys.__stderr__, flush=True)  # not sys.stderr: KopfRunner swaps it
            return got
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    state = show() if show else None
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}"
                         + (f"; state: {json.dumps(state, indent=1, default=str)[-4000:]}" if state is not None else ""))
