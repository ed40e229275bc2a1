"""Which rollout strategy a gated candidate gets (specpair_operator.policy.rollout_strategy.choose_strategy),
as a table over real releases built by release.build_release. Pure: no servers."""

from __future__ import annotations

import pytest

from specpair_operator.release.content import build_release
from specpair_operator.policy.rollout_strategy import CANARY, REPLACE, SHADOW, choose_strategy

PROMPTS = [{"prompt": "hi", "category": "chat"}]
BASE = {
    "target": {"source": "default"},
    "draft": {"drafter": "ngram"},
    "speculation": {"k": 4},
}


def release(**changes) -> dict:
    spec = {key: dict(value) for key, value in BASE.items()}
    for dotted, value in changes.items():
        block, _, key = dotted.partition("__")
        if key:
            spec.setdefault(block, {})[key] = value
        else:
            spec[block] = value
    return build_release("p", "ns", spec, PROMPTS, default_image="img:1")


def spec(strategy: str | None = None) -> dict:
    return {"rollout": {"strategy": {"type": strategy}}} if strategy else {"rollout": {}}


CHAMPION = release()


@pytest.mark.parametrize("asked, candidate, expected, refused", [
    # Left out: Shadow exactly when only the draft side differs.
    (None, release(speculation__k=6), SHADOW, False),
    (None, release(speculation__dynamicK=False), SHADOW, False),
    (None, release(speculation__lookupMinMatch=2), SHADOW, False),
    (None, release(speculation__treeWidth=2), SHADOW, False),
    (None, release(draft={"source": "tiny-draft"}), SHADOW, False),
    (None, release(draft={"source": "tiny-draft", "method": "draft-model"}), SHADOW, False),
    # ... a head is scored in shadow (the engine hands it the target's features), an MTP head
    # is not (the specpair engine does not draft with one): Replace.
    (None, release(draft={"source": "head", "method": "eagle"}), SHADOW, False),
    (None, release(draft={"source": "head", "method": "eagle3"}), SHADOW, False),
    (None, release(draft={"source": "head", "method": "mtp"}), REPLACE, False),
    # ... the target, the image or the engine changed: Canary (issue 57; tests/operator/test_gateway_canary.py).
    (None, release(target={"source": "default", "revision": "r2"}), CANARY, False),
    (None, release(target={"source": "default"}, rollout={"image": "img:2"}), CANARY, False),
    (None, release(engine="vllm", draft={"source": "tiny-draft"}), CANARY, False),
    # ... a serving setting changed: Replace.
    (None, release(speculation__k=6, speculation__batchSizeThreshold=2), REPLACE, False),
    (None, release(speculation__fallbackThreshold=0.5), REPLACE, False),
    # ... the golden prompts alone changed: nothing to score.
    (None, build_release("p", "ns", BASE, [{"prompt": "other"}], default_image="img:1"), REPLACE, False),
    # Asked for.
    (REPLACE, release(speculation__k=6), REPLACE, False),
    (CANARY, release(target={"source": "other"}), CANARY, False),
    (CANARY, release(speculation__k=6), CANARY, False),
    (SHADOW, release(speculation__k=6), SHADOW, False),
    (SHADOW, release(target={"source": "other"}), SHADOW, True),
    (SHADOW, release(draft={"source": "head", "method": "medusa"}), SHADOW, False),
    (SHADOW, release(draft={"source": "head", "method": "mtp"}), SHADOW, True),
    (SHADOW, build_release("p", "ns", BASE, [{"prompt": "other"}], default_image="img:1"), REPLACE, False),
])
def test_choose_strategy(asked, candidate, expected, refused):
    chosen = choose_strategy(spec(asked), CHAMPION, candidate)
    assert chosen.type == expected, chosen
    assert bool(chosen.refused) == refused, chosen
    assert chosen.reason


@pytest.mark.parametrize("asked", [None, REPLACE, SHADOW, CANARY])
def test_no_champion_is_always_replace(asked):
    chosen = choose_strategy(spec(asked), None, release(speculation__k=6))
    assert (chosen.type, chosen.refused) == (REPLACE, None)


@pytest.mark.parametrize("champion, candidate, refused", [
    ("eagle", "eagle3", True), ("medusa", "eagle3", True), ("eagle3", "eagle", True),
    ("eagle", "medusa", False), ("eagle3", "eagle3", False),
])
def test_a_head_is_shadowed_beside_a_champion_reading_the_same_features(champion, candidate,
                                                                       refused):
    """One target step hands one kind of features (the last normed state: EAGLE, Medusa; an
    EAGLE-3 head's layers): the engine refuses to score a head of the other kind in shadow
    (drafters.head.read_features), so the operator does not ask it to."""
    chosen = choose_strategy(spec(None), release(draft={"source": "h1", "method": champion}),
                             release(draft={"source": "h2", "method": candidate}))
    assert chosen.type == (REPLACE if refused else SHADOW), chosen
    if refused:
        assert "one kind of features" in chosen.reason and candidate in chosen.reason


def test_refusal_names_what_differs():
    chosen = choose_strategy(spec(SHADOW), CHAMPION, release(target={"source": "other"}, speculation__k=6))
    assert "target" in chosen.refused
    chosen = choose_strategy(spec(None), CHAMPION, release(speculation__k=6, speculation__batchSizeThreshold=2))
    assert "speculation.batchSizeThreshold" in chosen.reason


def test_keys_the_serving_never_reads_are_not_compared():
    stored = {**release(speculation__k=6), "mlflow": {"version": "3"}, "version": "3", "pair": "other"}
    assert choose_strategy(spec(None), CHAMPION, stored).type == SHADOW


def test_the_shadow_defaults_agree_with_the_engine_and_the_verdict():
    """The CRD holds rollout.shadow's defaults; the engine's --shadow-share and the verdict's
    minimum requests default to the same."""
    from specpair.shadow_flags import DEFAULT_SHARE

    from specpair_operator.policy.shadow_verdict import ShadowPolicy
    from specpair_operator.crd.validation import shadow_defaults

    defaults = shadow_defaults()
    assert defaults["share"] == DEFAULT_SHARE
    assert defaults["minRequests"] == ShadowPolicy().min_requests
