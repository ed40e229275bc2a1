"""The identity tests' proof that speculation ran (tests/drafting_checks.py) fails where it must:
with drafting forced off, a pair's greedy output still equals the target's (so an identity check
alone passes) and the helper refuses it; with drafting on, the same prompts pass it. Real tiny
models, one engine each way."""

from __future__ import annotations

import pytest
from drafting_checks import assert_drafted_and_accepted

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine

PROMPTS = ["def foo(x):\n    return", "The quick brown fox", "x = [1, 2, 3]\nfor i in x:\n"]
PARAMS = GenerationParams(max_new_tokens=24)


def test_an_identity_shown_with_drafting_forced_off_fails_the_check(tiny_target, tiny_draft):
    target_only = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    reference = [target_only.generate([p], PARAMS)[0].token_ids for p in PROMPTS]

    forced_off = SpeculativeEngine(tiny_target, draft=tiny_draft, speculation=SpeculationConfig(enabled=False))
    off = forced_off.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in off] == reference          # the identity alone cannot tell
    with pytest.raises(AssertionError, match="nothing was drafted: forced off"):
        assert_drafted_and_accepted([r.stats for r in off], "forced off")
    # Without drafts nothing can be accepted either: accepted=False does not let it through.
    with pytest.raises(AssertionError, match="nothing was drafted"):
        assert_drafted_and_accepted([r.stats for r in off], accepted=False)
    with pytest.raises(AssertionError, match="no replies to check"):
        assert_drafted_and_accepted([], "an empty loop")

    drafting = SpeculativeEngine(tiny_target, draft=tiny_draft,
                                 speculation=SpeculationConfig(k=3, dynamic_k=False, fallback_threshold=0))
    on = drafting.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in on] == reference
    drafted, accepted = assert_drafted_and_accepted([r.stats for r in on], "drafting on")
    assert drafted >= accepted > 0
