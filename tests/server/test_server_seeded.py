"""A seeded request through the real server over loopback (gRPC and the OpenAI HTTP API): the same
reply alone, among other requests, and with speculation off for it, under the server's default
speculation settings (dynamic k, the acceptance fallback, the batch-size threshold), for a
draft-model pair and an n-gram pair; and the reply is the engine's target-only reply."""

from __future__ import annotations

import pytest
from serving_helpers import PacedBatch, client_for, openai_client, run_threads
from tiny_models import make_model

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.drafters import NgramDrafter

MAX_NEW = 32


@pytest.fixture(scope="module")
def looping_target(tiny_pair):
    """A one-layer target with small weights, whose greedy text loops: a prompt ending in it
    makes n-gram lookup draft what the target goes on to sample."""
    return make_model(tiny_pair[0].tokenizer, seed=11, layers=1, init_std=0.05)


def _case(kind: str, tiny_pair, looping_target):
    """(target, speculative engine paced so requests overlap, prompt, sampling settings)."""
    if kind == "draft model":
        target, draft = tiny_pair
        engine = SpeculativeEngine(target, draft=draft)
        prompt, sampling = "x = [1, 2, 3]; y = [1, 2, 3]; z = [1, 2,", dict(temperature=0.9, top_p=0.95)
    else:
        target = looping_target
        engine = SpeculativeEngine(target, drafter=NgramDrafter())
        text = "Hello world, hello world, hello world, hello"
        greedy = engine.generate([text], GenerationParams(max_new_tokens=13), speculate=False)[0]
        prompt, sampling = text + greedy.text, dict(temperature=1.0, top_k=2)
    engine.step_delay = 0.005
    engine.new_batch = lambda: PacedBatch(engine, [])
    return target, engine, prompt, sampling


def _grpc(server, prompt, **options):
    with client_for(server) as c:
        return c.generate(prompt, **options)


def _http(server, prompt, *, seed=None, temperature=0.0, top_p=1.0, top_k=0, **specpair):
    """/v1/completions through the official client; `specpair`: the extension field."""
    return openai_client(server).completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_NEW, seed=seed, temperature=temperature,
        top_p=top_p, extra_body={"top_k": top_k, **({"specpair": specpair} if specpair else {})})


def _neighbours(server):
    """Other requests at once: unseeded sampled, greedy, another seed with its own k, and an
    HTTP one; they join and leave while the seeded ones run."""
    return [lambda: _grpc(server, "import os\nimport sys\n", max_new_tokens=40, temperature=1.0),
            lambda: _grpc(server, "def foo(x):", max_new_tokens=20),
            lambda: _grpc(server, "class Path:", max_new_tokens=40, temperature=0.7, seed=3, speculation_k=8),
            lambda: _http(server, "hello world", temperature=1.2, seed=77)]


@pytest.mark.parametrize("kind", ["draft model", "ngram"])
def test_a_seeded_request_gets_one_reply_alone_under_load_and_without_speculation(
        tiny_pair, looping_target, start_server, kind):
    target, engine, prompt, sampling = _case(kind, tiny_pair, looping_target)
    server = start_server(engine=engine, http_port=0, max_batch_size=8)
    drafted = {"alone": [0, 0], "load": [0, 0]}            # draft tokens, accepted
    for seed in (5, 6, 7):
        options = dict(max_new_tokens=MAX_NEW, seed=seed, **sampling)
        expected = SpeculativeEngine(target).generate(
            [prompt], GenerationParams(**options), speculate=False)[0]
        alone = _grpc(server, prompt, **options)
        off = _grpc(server, prompt, speculation_k=0, **options)
        http_alone, http_off = _http(server, prompt, seed=seed, **sampling), \
            _http(server, prompt, seed=seed, **sampling, k=0)
        together = run_threads([lambda: _grpc(server, prompt, **options),
                                lambda: _http(server, prompt, seed=seed, **sampling)] + _neighbours(server))
        assert not any(isinstance(r, Exception) for r in together), together
        grpc_load, http_load = together[0], together[1]

        assert alone.token_ids == off.token_ids == grpc_load.token_ids == expected.token_ids, seed
        texts = [r.choices[0].text for r in (http_alone, http_off, http_load)]
        assert texts == [expected.text] * 3, seed
        assert off.last.stats.num_draft_tokens == 0
        assert http_off.model_extra["specpair"]["drafted_tokens"] == 0
        for how, reply in (("alone", alone), ("load", grpc_load)):
            drafted[how][0] += reply.last.stats.num_draft_tokens
            drafted[how][1] += reply.last.stats.num_accepted_tokens
        drafted["load"][0] += http_load.model_extra["specpair"]["drafted_tokens"]
        drafted["load"][1] += http_load.model_extra["specpair"]["accepted_tokens"]
    # Speculation ran, kept drafts and rejected some, alone and under load: the equalities above
    # are not target-only decoding passing for speculation.
    for how, (tokens, kept) in drafted.items():
        assert 0 < kept < tokens, (kind, how, tokens, kept)
