"""SwapDraft (server/draft_swap.py): a draft-side release swapped into a running server between
two steps, under a steady stream of concurrent requests over real gRPC: none fails, every reply
equals its solo target-only reply, the server reports the new draft and drafts with it. The pause
between tokens around the swap is printed (a figure, not asserted). Refusals are by name."""

from __future__ import annotations

import json
import statistics
import threading
import time

import grpc
import pytest
from tiny_models import perturbed_copy, save_tiny

from serving_helpers import client_for, make_engine, reference, rpc_error, wait_for

from specpair._proto import engine_pb2 as pb
from specpair.config import GenerationParams
from specpair.contract import content_hash
from specpair.decoding import SpeculativeEngine
from specpair.drafters import ModelDrafter
from specpair.paged_cache import PAGED_ENV
from specpair.server.client import request
from specpair.server.draft_swap import (SwapRefused, drafter_refusal, load_release_drafter, read_release,
                                        target_refusal)

PROMPTS = ["def parse(self, text):\n    return", "import os\nimport sys\nimport", "hello world hello",
           "the cat sat on the mat and the", "for i in range(10):\n    print(", "a b c d e f g"]
NEW_TOKENS = 24
STREAMS = 4
# Odd streams send seeded sampled requests: a seeded reply is drawn by (seed, position), the same
# with any drafter or none (config.GenerationParams), so it too must not change across a swap.
TEMPERATURE, SEED = 0.8, 5


def release_json(target_source: str, version: str, *, draft_source: str | None = None,
                 drafter: str | None = None) -> str:
    draft = {"drafter": drafter} if drafter else {"source": draft_source}
    return json.dumps({"target": {"source": target_source}, "draft": draft, "speculation": {"k": 3},
                       "mlflow": {"version": version}})


def swap(client, text: str, reason: str = "test") -> pb.SwapDraftReply:
    return client.stub.SwapDraft(pb.SwapDraftRequest(release_json=text, reason=reason), timeout=60,
                                 metadata=client.metadata)


class SteadyStream:
    """STREAMS client threads, each sending the prompts one after another (streamed) until told
    to stop; every token message's arrival time kept, every reply and error kept."""

    def __init__(self, server):
        self.server, self.stop = server, threading.Event()
        self.replies: list[tuple[str, list[int], float, float, pb.AcceptanceStats]] = []
        self.arrivals: list[list[float]] = []      # per request: when each token message arrived
        self.errors: list[Exception] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(STREAMS)]

    def _run(self, index: int) -> None:
        with client_for(self.server) as client:
            n = index
            while not self.stop.is_set():
                prompt = PROMPTS[n % len(PROMPTS)]
                n += 1
                sampled = index % 2 == 1
                started, ids, times, final = time.perf_counter(), [], [], None
                options = {"temperature": TEMPERATURE, "seed": SEED} if sampled else {}
                try:
                    for msg in client.stream(request(prompt, max_new_tokens=NEW_TOKENS, **options), timeout=120):
                        times.append(time.perf_counter())
                        ids.extend(msg.token_ids)
                        if msg.finish_reason:
                            final = msg
                except Exception as exc:     # counted: the test asserts there are none
                    with self.lock:
                        self.errors.append(exc)
                    continue
                with self.lock:
                    self.replies.append(((prompt, sampled), ids, started, times[-1], final.stats))
                    self.arrivals.append(times)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


def swap_under_a_steady_stream(tiny_pair, server, text: str, new_source: str, label: str) -> None:
    """Swap `text` in while STREAMS clients stream requests; check and print what the swap did."""
    expected = {(p, False): reference(tiny_pair, p, NEW_TOKENS).token_ids for p in PROMPTS}
    target_only = SpeculativeEngine(tiny_pair[0])
    seeded = GenerationParams(max_new_tokens=NEW_TOKENS, temperature=TEMPERATURE, seed=SEED)
    expected.update({(p, True): target_only.generate([p], seeded, speculate=False)[0].token_ids for p in PROMPTS})
    with client_for(server) as client:
        before = client.model_info()
        assert before.draft_version == "1"
        with SteadyStream(server) as stream:
            wait_for(lambda: len(stream.replies) >= STREAMS, timeout=120)
            asked = time.perf_counter()
            reply = swap(client, text)
            swapped_at = time.perf_counter()
            done_before_swap = len(stream.replies)
            # Requests that began after the swap, several per stream, then stop.
            wait_for(lambda: sum(1 for r in stream.replies if r[2] > swapped_at) >= 2 * STREAMS, timeout=180)
        after = client.model_info()
        stats = client.stats()
    assert not stream.errors, stream.errors
    assert reply.swapped and reply.draft_version == "2" and reply.load_seconds > 0
    assert (reply.draft.kind, reply.draft.source) == ("model", new_source)
    assert (after.draft.kind, after.draft.source, after.draft_version) == ("model", new_source, "2")
    assert after.draft_content_hash == content_hash(json.loads(text))
    assert (after.version, after.content_hash) == (before.version, before.content_hash)   # the pod's release
    for prompt, ids, _s, _e, _st in stream.replies:
        assert ids == expected[prompt], prompt           # unchanged across the swap
    across = [r for r in stream.replies if r[2] < asked < r[3]]
    assert across, "no request was running across the swap"
    later = [r for r in stream.replies if r[2] > swapped_at]
    # The batch drafts with the new model: its rows' cache is the new draft's, and requests that
    # began after the swap drafted.
    assert isinstance(server.worker.batch.drafter, ModelDrafter)
    assert server.worker.batch.drafter.loaded.source == new_source
    assert all(r[4].num_draft_tokens > 0 for r in later)
    assert stats.overall.cumulative.num_draft_tokens > 0

    def rate(rows):
        drafted = sum(r[4].num_draft_tokens for r in rows)
        return sum(r[4].num_accepted_tokens for r in rows) / drafted if drafted else 0.0
    gaps = [b - a for times in stream.arrivals for a, b in zip(times, times[1:])]
    # The load runs beside the steps (the two compete for the cores); the install holds the worker
    # between two steps, and each row's first round after it rebuilds its draft cache.
    during_load = [b - a for times in stream.arrivals for a, b in zip(times, times[1:])
                   if a <= swapped_at and b >= asked]
    installed = swapped_at - reply.install_seconds
    at_install = [b - a for times in stream.arrivals for a, b in zip(times, times[1:])
                  if a <= swapped_at and b >= installed]
    print(f"\nswap {label} ({'paged' if server.engine.paged_space is not None else 'contiguous'} target cache): "
          f"load+warm {reply.load_seconds:.3f} s, install {reply.install_seconds * 1e3:.2f} ms between steps; "
          f"{len(stream.replies)} requests x {NEW_TOKENS} tokens, {STREAMS} streams ({done_before_swap} done before "
          f"the swap, {len(across)} across it, {len(later)} after; half seeded sampled), 0 failed, all equal to solo "
          f"target-only; "
          f"acceptance before {rate(stream.replies[:done_before_swap]):.2f}, after {rate(later):.2f}; token gaps: "
          f"median {statistics.median(gaps) * 1e3:.1f} ms, max {max(gaps) * 1e3:.1f} ms, largest spanning the install "
          f"and the first round after it {max(at_install, default=0) * 1e3:.1f} ms, largest overlapping the load "
          f"{max(during_load, default=0) * 1e3:.1f} ms")


def test_ngram_to_draft_model_under_a_steady_stream(tiny_pair, start_server, tmp_path):
    target, draft = tiny_pair
    draft_dir = save_tiny(draft, tmp_path / "draft")
    server = start_server(SpeculativeEngine(target, drafter="ngram"), max_batch_size=8)
    swap_under_a_steady_stream(tiny_pair, server, release_json(target.source, "2", draft_source=draft_dir),
                               draft_dir, "n-gram -> draft model")


def test_draft_model_a_to_b_under_a_steady_stream(tiny_pair, start_server, tmp_path, monkeypatch):
    # The contiguous cache (the paged pool's plane: test_draft_swap_paged.py).
    monkeypatch.setenv(PAGED_ENV, "off")
    target, draft = tiny_pair
    other_dir = save_tiny(perturbed_copy(target, seed=13, noise=0.05), tmp_path / "draft-b")
    server = start_server(SpeculativeEngine(target, draft=draft), max_batch_size=8)
    assert server.engine.paged_space is None
    swap_under_a_steady_stream(tiny_pair, server, release_json(target.source, "2", draft_source=other_dir),
                               other_dir, "draft model A -> B")


def test_the_same_release_again_changes_nothing(tiny_pair, start_server, tmp_path):
    target, _ = tiny_pair
    server = start_server(SpeculativeEngine(target, drafter="ngram"))
    text = release_json(target.source, "3", drafter="ngram")
    with client_for(server) as client:
        first, second = swap(client, text), swap(client, text)
        info = client.model_info()
    assert first.swapped and not second.swapped
    assert (second.draft_version, info.draft_version, info.draft.kind) == ("3", "3", "ngram")


def test_refused_by_name(tiny_pair, start_server, tmp_path):
    target, _ = tiny_pair
    server = start_server(SpeculativeEngine(target, drafter="ngram"))
    with client_for(server) as client:
        other = rpc_error(lambda: swap(client, release_json("another-target", "4", drafter="ngram")))
        assert other.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "a target change needs new pods" in other.details()
        none = rpc_error(lambda: swap(client, json.dumps({"target": {"source": target.source}})))
        assert none.code() == grpc.StatusCode.FAILED_PRECONDITION and "no draft" in none.details()
        bad = rpc_error(lambda: swap(client, "{not json"))
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "release_json" in bad.details()
        assert client.model_info().draft_version == "1"     # nothing changed


def test_a_serving_token_cannot_swap(tiny_pair, start_server):
    target, _ = tiny_pair
    server = start_server(SpeculativeEngine(target, drafter="ngram"), auth_token="serving-token")
    with client_for(server, token="serving-token") as client:
        error = rpc_error(lambda: swap(client, release_json(target.source, "5", drafter="ngram")))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "SwapDraft" in error.details()
        assert client.model_info().draft_version == "1"


def test_refusals_as_pure_decisions(tiny_pair):
    target, _ = tiny_pair
    release = read_release(release_json(target.source, "6", drafter="ngram"))
    assert target_refusal(release, target) is None
    assert "target change" in target_refusal(read_release(release_json("x", "6", drafter="ngram")), target)
    with pytest.raises(SwapRefused, match="no draft"):
        read_release(json.dumps({"target": {"source": target.source}}))
    engine = make_engine(tiny_pair)          # a draft model; its cache in the paged pool where paged
    ngram = SpeculativeEngine(target, drafter="ngram")
    why = drafter_refusal(engine, ngram.drafter)
    if engine.paged_space is not None:
        assert "paged pool" in why
    else:
        assert why is None
    assert drafter_refusal(ngram, engine.drafter) is None


def test_a_paged_draft_model_is_refused_before_the_new_draft_loads(tiny_pair):
    # The operator rolls the pods on this refusal: it must not cost a draft's load first. A draft
    # model's plane in the paged pool is replaced by another draft model's only
    # (test_draft_swap_paged.py); a lookup release is refused from the release alone.
    target, _ = tiny_pair
    engine = make_engine(tiny_pair)
    if engine.paged_space is None or engine.paged_space.draft is None:
        pytest.skip(f"the paged cache does not apply here: {engine.paged_unused}")

    def load_model(*_args, **_kwargs):
        raise AssertionError("the draft was loaded before the refusal")
    release = read_release(release_json(target.source, "9", drafter="ngram"))
    with pytest.raises(SwapRefused, match="paged pool's blocks, which another draft model's plane can replace"):
        load_release_drafter(engine, release, load_model=load_model)


def test_only_the_operator_certificate_swaps_on_the_control_port(tiny_pair, start_server, tmp_path):
    from pki import Authority, SecretVolume
    from test_server_control_tls import control_client

    target, draft = tiny_pair
    authority = Authority.new("specpair-ca-swap")
    volume = SecretVolume(tmp_path / "tls", authority.secret())
    server = start_server(SpeculativeEngine(target, drafter="ngram"), control_port=0, control_tls=volume.tls_files())
    text = release_json(target.source, "7", draft_source=save_tiny(draft, tmp_path / "draft"))
    with client_for(server) as main, \
            control_client(server, tmp_path / "other", authority.ca, authority.someone_else) as someone_else, \
            control_client(server, tmp_path / "operator", authority.ca, authority.operator) as operator:
        for caller in (main, someone_else):
            error = rpc_error(lambda: swap(caller, text))
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "SwapDraft" in error.details()
        assert main.model_info().draft_version == "1"
        assert server.metrics.control_denied.labels("tiny", "1", "specpair", "SwapDraft")._value.get() == 2
        reply = swap(operator, text)
        assert reply.swapped and reply.draft.kind == "model"
        assert main.model_info().draft_version == "7"
        assert main.generate(PROMPTS[0], max_new_tokens=8).last.stats.num_draft_tokens > 0


def test_a_target_only_server_takes_a_drafter(tiny_pair, start_server):
    target, _ = tiny_pair
    server = start_server(SpeculativeEngine(target))
    prompt = "hello world hello world hello world hello"
    with client_for(server) as client:
        assert client.model_info().draft.kind == "none"
        assert swap(client, release_json(target.source, "8", drafter="ngram")).swapped
        reply = client.generate(prompt, max_new_tokens=16)
        assert (client.model_info().draft.kind, client.model_info().draft_version) == ("ngram", "8")
    assert reply.token_ids == reference(tiny_pair, prompt, 16).token_ids
    assert reply.last.stats.num_draft_tokens > 0


def test_a_head_on_either_side_is_refused(tiny_pair):
    import torch

    from specpair.heads import build_eagle_head
    from specpair.models import wrap_model

    target, _ = tiny_pair
    head = wrap_model(build_eagle_head(target.model, torch.arange(target.embedding_rows), seed=0),
                      target.tokenizer, "head")
    with_head = SpeculativeEngine(target, draft=head)
    ngram = SpeculativeEngine(target, drafter="ngram")
    assert with_head.drafter.wants_features
    features = "drafts from the target's features"
    assert f"the serving drafter (eagle) {features}" in drafter_refusal(with_head, ngram.drafter)
    assert f"the release's drafter (eagle) {features}" in drafter_refusal(ngram, with_head.drafter)


def test_a_swapped_in_lookup_keeps_the_pods_ngram_lengths(tiny_pair):
    from specpair.server.draft_swap import ngram_lengths

    target, _ = tiny_pair
    assert ngram_lengths(SpeculativeEngine(target, drafter="ngram", ngram=(5, 2))) == (5, 2)
    loaded = load_release_drafter(SpeculativeEngine(target, drafter="ngram", ngram=(5, 2)),
                                  read_release(release_json(target.source, "9", drafter="ngram")))
    assert (loaded.choice.drafter.max_ngram, loaded.choice.drafter.min_ngram) == (5, 2)
