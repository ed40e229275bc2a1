"""What an identity test must also show: that speculation ran. Greedy output equal to the
target's own proves nothing about the speculative path when nothing was drafted (speculation off,
the fallback tripped, a cost model that chose target-only): the output is then the target's by
construction. So each identity test also checks that drafts were proposed and some accepted, on
the stats of the replies it compared (an engine's RequestStats or a gRPC reply's stats, which
carry the same counters)."""

from __future__ import annotations

from typing import Any, Iterable


def assert_drafted_and_accepted(stats: Iterable[Any], what: str = "", *, accepted: bool = True) -> tuple[int, int]:
    """Drafts were proposed over `stats` and, unless accepted=False, some accepted (so some target
    passes verified more than one token); returns (drafted, accepted). accepted=False is for a
    pair whose drafts the target rejects every time (a random target never continues the
    prompt's patterns, so n-gram lookup is always wrong there): the drafts were still proposed,
    verified and cut back, which is the path such a test proves."""
    stats = list(stats)
    where = f": {what}" if what else ""
    assert stats, f"no replies to check{where}"
    n_drafted = sum(s.num_draft_tokens for s in stats)
    n_accepted = sum(s.num_accepted_tokens for s in stats)
    assert n_drafted > 0, f"nothing was drafted{where}: the identity shown is target-only's"
    assert n_accepted > 0 or not accepted, f"{n_drafted} drafted, none accepted{where}"
    return n_drafted, n_accepted
