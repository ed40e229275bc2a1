"""A draft-side release swapped into a running engine between two steps (issue 58, SwapDraft).

A drafter never changes what a row emits: verification is the target's alone (greedy argmax, or
rejection sampling whose output distribution is the target's). So the serving drafter can be
replaced while rows run, with no row restarted and no reply changed. The swap has three parts:
  1. read: the release (the JSON the shadow's --shadow-release file holds), refused by name
     when it does not change the draft side only (another target) or cannot be swapped here;
  2. load and warm: off the step loop (the gRPC call's executor thread), the draft model loaded
     and one forward pass run, its tokenizer checked against the target's as at start-up;
  3. install: in the worker thread between steps (EngineWorker.call), the engine's drafter and
     the batch's per-row drafter replaced (decoding.Batch.replace_drafter). The new drafter's
     rows start empty: a draft model feeds each row's whole sequence on its first round
     (ModelDrafter feeds what its cache has not seen), an n-gram index syncs from the sequence.
     That first round is the pause a swap costs in tokens, so the rows in flight catch up within
     CATCH_UP_POSITIONS all together and the others end drafting (rows_that_catch_up).

A serving draft model whose cache lives in the paged pool's blocks (PagedSpace.draft) is swapped
for another draft model: the new draft's plane over the same block ids is made beside the old
one off the step loop (lazily: its pages cost memory once written), held to the pool's KV
budget first (PagedSpace.draft_plane_refusal: layers, kv heads and head dimension may differ,
but every block priced at the new draft's bytes must stay within the budget), and put in at the
step boundary; the old draft rows' blocks go back and the old plane's arrays with them.

What is refused (SwapRefused, the reason in words): another target; a draft tokenizer that
differs from the target's; a drafting head (EAGLE, EAGLE-3, Medusa, lookup-first) on either
side (the batch hands target features only to the drafter it was built with, and the paged pool
keeps them per position); on the paged pool, a serving draft model's plane replaced by something
other than a draft model, or by a draft whose plane does not fit the pool's budget. Those need a
rolled pod; a refused swap leaves the serving draft serving.

Not swapped: the engine's speculation settings (k, dynamic k, thresholds) stay the started
release's; a cost-model k (calibrated on the old drafter's step cost) falls back to the
heuristic k until the pod restarts.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable

from specpair.config import Release
from specpair.decoding import kv_bytes_per_token
from specpair.errors import SpecpairError, TokenizerMismatch

log = logging.getLogger("specpair.server.draft_swap")

WARM_UP_TOKENS = 8     # one forward pass of this many tokens pages the draft's weights in
# Positions the rows in flight may feed a swapped-in draft model on the round after the swap, all
# together (each catching-up row feeds its whole sequence): that round is the swap's pause, so
# rows past it stop drafting for the rest of their reply instead (rows_that_catch_up). 2,048: a
# 2-layer SmolLM2 draft caught up 0.25-0.34 ms of CPU a position on one core (bench/
# draft_swap_paged.py, docs/measurements/2026-12-07c-draft-swap-paged-cpu.md), so ~0.7 s of one
# core for the pause at most (target: under 1 s), and a 1,500-token chat still catches up; a
# larger draft or a slower machine pays more for the same positions.
CATCH_UP_POSITIONS = 2048
# How long a SwapDraft call waits for the step running now to end (a step is well under this).
INSTALL_WAIT_SECONDS = 120.0


class SwapRefused(SpecpairError):
    """A release this engine cannot swap in; the reason names what a restart is needed for."""


@dataclass(frozen=True)
class ServingDraft:
    """Which draft-side release the engine drafts with since its last swap."""
    version: str
    content_hash: str


@dataclass
class Loaded:
    """A release's drafter built beside the running target, not yet serving."""
    release: Release
    choice: object           # drafter_choice.DrafterChoice
    load_seconds: float
    plane: object = None     # paged_cache.PagedLayers: the new draft's plane in the pool, if paged


@dataclass(frozen=True)
class SwapResult:
    serving: ServingDraft
    swapped: bool            # False: the release already served (nothing changed)
    load_seconds: float      # read, load and warm, off the step loop
    install_seconds: float   # the worker held between steps


def read_release(text: str) -> Release:
    """The release JSON a SwapDraft call carries, refused with the reason when it has no draft."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise SpecpairError(f"release_json: not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise SpecpairError("release_json: not a release (a JSON object)")
    release = Release.from_dict(raw)
    if not release.pair.speculates:
        raise SwapRefused("the release has no draft (a drafter or a draft source): nothing to swap in "
                          "(SetSpeculation turns speculation off)")
    return release


def target_refusal(release: Release, target) -> str | None:
    """Why this release cannot swap into an engine serving `target` (a LoadedModel): it must
    change the draft side only."""
    mine = (release.pair.target.source, release.pair.target.revision or "")
    serving = (target.source, target.revision or "")
    if mine != serving:
        return (f"the release targets {mine[0]}{'@' + mine[1] if mine[1] else ''}, the engine serves "
                f"{serving[0]}{'@' + serving[1] if serving[1] else ''}: a target change needs new pods")
    return None


def serving_refusal(engine) -> str | None:
    """Why the engine's serving drafter cannot be replaced at all (None: it can), asked before a
    release's draft is loaded, so a refused swap costs no load."""
    old = engine.drafter
    if old is not None and old.wants_features:
        return (f"the serving drafter ({old.name}) drafts from the target's features, which the batch "
                f"hands only to the drafter it was built with: a head swap needs new pods")
    return None


def release_refusal(engine, release: Release) -> str | None:
    """Why this release's drafter cannot replace the serving one here, read from the release
    alone (so asked before its draft loads): a draft model's plane in the paged pool is replaced
    by another draft model's only."""
    space = getattr(engine, "paged_space", None)
    if space is not None and space.draft is not None and release.pair.drafter is not None:
        return (f"the serving draft model's cache lives in the paged pool's blocks, which another draft "
                f"model's plane can replace but not a {release.pair.drafter} drafter: new pods size the "
                f"pool without it")
    return None


def drafter_refusal(engine, new_drafter) -> str | None:
    """Why `new_drafter` cannot replace the engine's serving drafter between steps (None: it can)."""
    why = serving_refusal(engine)
    if why:
        return why
    if new_drafter is not None and new_drafter.wants_features:
        return (f"the release's drafter ({new_drafter.name}) drafts from the target's features, which the "
                f"batch hands only to the drafter it was built with: a head swap needs new pods")
    space = getattr(engine, "paged_space", None)
    if space is not None and space.draft is not None:
        model = new_drafter.draft_model() if new_drafter is not None else None
        if model is None:
            return (f"the serving draft model's cache lives in the paged pool's blocks, which another draft "
                    f"model's plane can replace but not {new_drafter.name if new_drafter else 'no drafter'}: "
                    f"new pods size the pool without it")
        why = space.draft_plane_refusal(model)
        if why:
            return f"the new draft's plane does not fit the paged pool: {why}"
    return None


def load_release_drafter(engine, release: Release, load_model=None) -> Loaded:
    """Build the release's drafter beside the engine's target, as the engine builds its own
    (drafter_choice.build_drafter), and warm it. Runs off the step loop."""
    from specpair.drafter_choice import build_drafter

    started = time.perf_counter()
    why = target_refusal(release, engine.target) or serving_refusal(engine) or release_refusal(engine, release)
    if why:
        raise SwapRefused(why)
    pair, draft = release.pair, None
    if pair.drafter is None:
        if load_model is None:
            from specpair.models import load_model
        draft = load_model(pair.draft.source, device=str(engine.target.device), revision=pair.draft.revision,
                           progress=lambda _m: None)
    try:
        choice = build_drafter(engine.target, draft, pair.drafter, speculation=engine.config,
                               kv=engine.kv_kind, compile=engine.compile_mode,
                               target_fingerprint=engine.target_fingerprint, ngram=ngram_lengths(engine))
    except TokenizerMismatch as exc:
        raise SwapRefused(f"the release's draft tokenizer differs from the target's: {exc}") from exc
    why = drafter_refusal(engine, choice.drafter)
    if why:
        raise SwapRefused(why)
    if choice.draft is not None:
        warm(choice.draft)
    space = getattr(engine, "paged_space", None)
    plane = space.new_draft_plane(choice.drafter.draft_model()) if space is not None and space.draft else None
    return Loaded(release=release, choice=choice, load_seconds=time.perf_counter() - started, plane=plane)


def ngram_lengths(engine) -> tuple[int, int]:
    """The n-gram lengths a swapped-in lookup matches: the serving lookup's (the pod's --ngram-max
    and --ngram-min), else the defaults."""
    from specpair.config import NGRAM_MAX, NGRAM_MIN

    serving = engine.drafter
    if serving is not None and serving.name == "ngram":
        return serving.max_ngram, serving.min_ngram
    return NGRAM_MAX, NGRAM_MIN


def warm(loaded) -> None:
    """One forward pass, so the first round after the swap does not page the weights in."""
    import torch

    ids = torch.arange(WARM_UP_TOKENS, device=loaded.model.device).unsqueeze(0) % len(loaded.tokenizer)
    with torch.no_grad():
        loaded.model(input_ids=ids)


def rows_that_catch_up(rows: list[tuple[int, int]], budget: int = CATCH_UP_POSITIONS) -> list[int]:
    """Which rows in flight feed their whole sequence to a swapped-in draft model on their next
    round, within `budget` positions all together (indices, ascending); the others stop drafting
    for the rest of their reply (their output is the same either way: the target verifies).
    rows: (positions the row holds, tokens it has left) each. The rows with the most tokens left
    for each position caught up go first: where drafting still has the most to give for the
    pause it costs. A row with at most one token left drafts nothing more anyway."""
    order = sorted(range(len(rows)), key=lambda i: (-rows[i][1] / max(1, rows[i][0]), i))
    chosen, used = [], 0
    for i in order:
        positions, left = rows[i]
        if left > 1 and used + positions <= budget:
            chosen.append(i)
            used += positions
    return sorted(chosen)


def install(engine, batch, loaded: Loaded, catch_up_positions: int = CATCH_UP_POSITIONS) -> None:
    """Make the loaded drafter the serving one; run in the worker thread between steps. With a
    draft model, only the rows rows_that_catch_up picks draft on; the rest end their drafting."""
    choice = loaded.choice
    why = drafter_refusal(engine, choice.drafter)     # the engine may have changed since the load
    if why:
        raise SwapRefused(why)
    if choice.drafter is not None and choice.drafter.draft_model() is not None:
        rows = [(len(seq.tokens), seq.params.max_new_tokens - seq.num_generated) for seq in batch.rows]
        keep = set(rows_that_catch_up(rows, catch_up_positions))
        for i, seq in enumerate(batch.rows):
            seq.drafts_ended = seq.drafts_ended or i not in keep
    engine.drafter, engine.draft = choice.drafter, choice.draft
    engine.draft_fingerprint, engine.tokenizer_check = choice.draft_fingerprint, choice.tokenizer_check
    engine.cost_model = None      # calibrated on the old drafter's step cost: the heuristic k now
    cache_model = choice.drafter.cached_model() if choice.drafter is not None else None
    engine._draft_kv = kv_bytes_per_token(cache_model) if cache_model is not None else 0   # row_memory
    if loaded.plane is not None:       # the paged pool's draft plane, made for this draft at load
        engine.paged_space.install_draft_plane(loaded.plane)
    batch.replace_drafter(choice.drafter)   # empty rows: each catches up on its next round


def swap(engine, worker, release_json: str, serving: ServingDraft, *, installed: Callable[[ServingDraft], None],
         reason: str = "", load_model=None) -> SwapResult:
    """Read, load and warm here (the caller's thread), then install between two steps;
    `installed` is told the new serving draft in the worker thread, with the install itself, so
    what the server reports follows the drafter even if the caller stopped waiting."""
    release = read_release(release_json)
    if release.content_hash == serving.content_hash:
        return SwapResult(serving=serving, swapped=False, load_seconds=0.0, install_seconds=0.0)
    loaded = load_release_drafter(engine, release, load_model)
    now = ServingDraft(version=release.version or "0", content_hash=release.content_hash)

    def apply() -> float:
        held = time.perf_counter()
        install(engine, worker.batch, loaded)
        installed(now)
        return time.perf_counter() - held

    install_seconds = worker.call(apply, timeout=INSTALL_WAIT_SECONDS)
    log.warning("draft swapped to release v%s (%s, %s) in %.2f s load + %.4f s between steps%s", now.version,
                now.content_hash[:12], choice_name(loaded), loaded.load_seconds, install_seconds,
                f" ({reason})" if reason else "")
    return SwapResult(serving=now, swapped=True, load_seconds=loaded.load_seconds, install_seconds=install_seconds)


def choice_name(loaded: Loaded) -> str:
    return loaded.choice.drafter.name if loaded.choice.drafter is not None else "none"
