"""Waiting in tests: poll a condition until it holds or its deadline passes, then fail the test
saying what was awaited (and, where given, the state that was seen instead). Never a fixed sleep:
a test waits as long as its condition takes, and no longer than its deadline."""

from __future__ import annotations

import json
import time
from typing import Any, Callable


def wait_until(what: str, predicate: Callable[[], Any], timeout: float = 60.0, interval: float = 0.25,
               show: Callable[[], Any] | None = None) -> Any:
    """The first truthy value of predicate(), looked at every `interval` seconds; an
    AssertionError naming `what` (and show()'s state) when none comes within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    state = show() if show else None
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}"
                         + (f"; state: {json.dumps(state, indent=1, default=str)[-4000:]}" if state is not None else ""))
