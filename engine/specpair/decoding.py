"""The speculative decoding loop: draft k tokens, verify them in one target pass, keep what matches.

A `Batch` holds the running sequences; `step()` advances every row by one verification round
(each row accepts its own number of drafts) and reports what each row emitted. Rows join and
leave at step boundaries, which is all continuous batching needs. `SpeculativeEngine.generate`
runs a batch to completion for the CLI, the bench and the gate.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from dataclasses import dataclass, field, replace

import torch

from specpair.config import (KV_BUDGET_CUDA_FREE_FRACTION, KV_BUDGET_ENV, NGRAM_MAX, NGRAM_MIN,
                             PREFILL_IDLE_TOKEN_BUDGET, PREFILL_PROMPT_SHARE, PREFILL_TOKEN_BUDGET,
                             GenerationParams, SpeculationConfig, parse_kv_budget)
from specpair import cpu_kernels
from specpair.batch_observer import BatchObserver, VerifiedRound
from specpair.costs import (CostModel, DynamicK, RequestAudit, RowsDecision, StepTiming, k_for_rows,
                            measure_step_costs, sync)
from specpair.detokenize import IncrementalDetokenizer
from specpair.drafter_choice import build_drafter
from specpair.drafters import Drafter, RowSampling
from specpair.errors import SpecpairError
from specpair.grammar import GrammarCompiler, RowGrammar
from specpair.block_pool import RowNeed, blocks_for, plan_admission
from specpair.paged_cache import PagedKVModel, PagedSpace, feature_width, paged_applies
from specpair.prefix_cache import (PrefixStats, PrefixStore, block_keys, capacity_bytes,
                                   resolve_mode, reusable_blocks)
from specpair.kv.buckets import bucket
from specpair.kv.choice import check_static_step, kv_model, resolve_kv_kind, step_description
from specpair.kv.compiling import resolve_compile
from specpair.rejection_sampler import (DrawKeys, greedy_verify, keyed_verify, process_logits,
                                        rejection_sample, seed_key, verify_tree)
from specpair.stats import AcceptanceStats, AcceptanceWindow
from specpair.tokenizer_identity import fingerprint

log = logging.getLogger("specpair.engine")


class SpeculationController:
    """Engine-wide switch: fall back to target-only when windowed acceptance is too low.

    While speculating, acceptance over the last `fallback_window` draft tokens is tracked; once the
    window is full and below `fallback_threshold`, speculation stops. After `probe_interval`
    target-only tokens it is probed again with a fresh window, so speculation resumes when the
    traffic changes back.
    """

    def __init__(self, config: SpeculationConfig):
        self.config = config
        self.window = AcceptanceWindow(config.fallback_window)
        self.enabled = config.enabled
        self.k_override: int | None = None      # SetSpeculation at run time
        self.reset()

    def reset(self) -> None:
        self.window.clear()
        self.falling_back = False
        self.target_only_tokens = 0
        self.fallback_events = 0

    def should_speculate(self) -> bool:
        return self.enabled and not self.falling_back

    def record(self, drafted: int, accepted: int, emitted_target_only: int) -> bool:
        """Feed one round; returns True when this round triggered a fallback."""
        if self.falling_back:
            self.target_only_tokens += emitted_target_only
            if self.target_only_tokens >= self.config.probe_interval:
                self.falling_back = False
                self.window.clear()
            return False
        self.window.add(drafted, accepted)
        if self.window.full and (self.window.rate or 0.0) < self.config.fallback_threshold:
            self.falling_back = True
            self.target_only_tokens = 0
            self.fallback_events += 1
            return True
        return False


@dataclass
class StepOutput:
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    # Per token of token_ids when the request asked (params.logprobs): its log-probability and
    # the top alternatives [(token, log-probability)], from the target's distribution there.
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class Sequence:
    """One request's row in the batch."""

    request_id: str
    prompt_ids: list[int]
    params: GenerationParams
    generator: torch.Generator | None    # an unseeded sampled row's stream; a seeded row draws by
                                         # (seed, position) instead (Batch._sampling), greedy none
    dynamic_k: DynamicK
    # k for rounds that copy (LookupFirstDrafter): grown on runs as n-gram lookup's k is, apart
    # from the head's k, which its cost model keeps small
    copy_k: DynamicK | None = None
    tokens: list[int] = field(default_factory=list)      # prompt + generated
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    finished: bool = False
    finish_reason: str | None = None
    detokenizer: IncrementalDetokenizer | None = None   # the text not yet streamed
    grammar: RowGrammar | None = None   # params.structure's matcher, after the committed tokens
    memory: tuple[int, int] = (0, 0)    # KV bytes: its own, speculation's (engine.row_memory)
    memory_target_only: bool = False    # not drafting until the KV budget has room for it
    # Not drafting for the rest of its reply: a draft model swapped in mid-reply would have had to
    # catch up on more of the rows' sequences than a swap's pause allows (server/draft_swap.py).
    drafts_ended: bool = False
    cached_tokens: int = 0              # prompt tokens whose target keys came from the prefix store
    preemptions: int = 0                # times its blocks were given back and it was recomputed
    # Per cache of Batch.prefix_caches: the prompt's block names, and whether its blocks are
    # stored yet (once the cache holds the whole prompt).
    prefix_keys: list[list[bytes]] = field(default_factory=list)
    prefix_saved: list[bool] = field(default_factory=list)
    # The paged cache's head drafter's own keys and values over the prompt's full blocks:
    # whether they are kept in the pool yet (Batch._save_head_prefixes), and the head's
    # positions served from there (over a shared prefix, not computed again).
    head_saved: bool = False
    head_cached: int = 0
    # Streamed pieces, joined once at the end: appending to one string copies it every step.
    pieces: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def num_generated(self) -> int:
        """len(generated), without copying the reply (the step loop asks every step)."""
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def emitted_text(self) -> str:
        return "".join(self.pieces)


@dataclass
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    stats: AcceptanceStats
    seconds: float
    time_to_first_token: float
    cached_tokens: int = 0       # prompt tokens served from the prefix store

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "completion_tokens": len(self.token_ids), "seconds": round(self.seconds, 6),
                "time_to_first_token": round(self.time_to_first_token, 6),
                **self.stats.to_dict()}


def stop_prefix_length(text: str, stops) -> int:
    """Length of the longest end of `text` that is the beginning of a stop string (0: none)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def kv_bytes_per_token(model) -> int:
    """Bytes of keys and values one token takes in a model's cache, every layer."""
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    element = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * element


def drafter_cache_model(drafter: Drafter | None):
    """The model whose cache a drafter keeps per row (a draft model's, an EAGLE head's), or None
    (n-gram lookup, Medusa: nothing cached)."""
    return drafter.cached_model() if drafter is not None else None


class SpeculativeEngine:
    """A target model, an optional drafter, and the settings that pair them."""

    def __init__(self, target, drafter: Drafter | str | None = None, draft=None,
                 speculation: SpeculationConfig | None = None, *,
                 on_mismatch: str = "error", check_tokenizers: bool = True,
                 kv: str | None = None, compile: str | None = None,
                 kv_budget: str | int | None = None,
                 ngram: tuple[int, int] = (NGRAM_MAX, NGRAM_MIN),
                 prefix_cache: str | None = None):
        """target/draft: LoadedModel. drafter: a Drafter, or a model-free one by name ("ngram",
        matching `ngram` = (longest, shortest) tokens); built from `draft` when not given
        (drafter_choice.build_drafter).

        on_mismatch: "error" refuses an incompatible draft; "target-only" serves without
        speculation and says so in `self.warnings`. kv: "static" (preallocated, written in place;
        where the model is supported) or "dynamic" (the hole-masking cache); compile: "on" compiles
        the static step with torch.compile and warms it here. Defaults: SPECPAIR_KV,
        SPECPAIR_COMPILE (kv/choice.py, kv/compiling.py). kv_budget: the keys and values the engine may hold
        (config.parse_kv_budget; default SPECPAIR_KV_BUDGET, else on CUDA a share of the memory
        free now, else none): past it, rows stop drafting (Batch.add). prefix_cache: "on" keeps
        the keys and values of prompts' full blocks and serves the next prompt that begins with
        them (prefix_cache.py; default SPECPAIR_PREFIX_CACHE, else on).
        """
        self.kv_kind = resolve_kv_kind(kv)
        for loaded in (target, draft):     # a model the static step cannot run: refused or said
            if loaded is not None and not getattr(loaded.model, "is_drafting_head", False):
                check_static_step(loaded.model, kv)     # (a head's needs: drafter_choice)
        self.compile_mode = resolve_compile(compile, target.device)
        self.target = target
        self.config = speculation or SpeculationConfig()
        self.controller = SpeculationController(self.config)
        self.warnings: list[str] = []
        self.vocab_size = len(target.tokenizer)
        self.target_fingerprint = fingerprint(target.tokenizer, embedding_rows=target.embedding_rows)
        choice = build_drafter(target, draft, drafter, speculation=self.config, kv=self.kv_kind,
                               compile=self.compile_mode, on_mismatch=on_mismatch,
                               check_tokenizers=check_tokenizers,
                               target_fingerprint=self.target_fingerprint, ngram=ngram)
        drafter = self.drafter = choice.drafter
        self.draft = choice.draft
        self.draft_fingerprint, self.tokenizer_check = choice.draft_fingerprint, choice.tokenizer_check
        self.warnings.extend(choice.warnings)
        # Who watches every batch's rounds (batch_observer.BatchObserver: shadow scoring); they
        # only read. Declared with add_observer, before the first batch.
        self.observers: list[BatchObserver] = []
        eos = target.model.generation_config.eos_token_id if getattr(
            target.model, "generation_config", None) is not None else None
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if target.tokenizer.eos_token_id is not None:
            ids.add(target.tokenizer.eos_token_id)
        self.eos_ids = ids
        self._ids = itertools.count()
        self.cost_model: CostModel | None = None   # set by calibrate(); enables cost-aware k
        # Which requests draft every round and feed live acceptance (costs.RequestAudit), and
        # the k per batch size measured at start-up (costs.decide_speculation_by_rows) that
        # each round's k is held to (costs.k_for_rows).
        self.audit = RequestAudit(seed=0)
        self.speculation_by_rows: list[RowsDecision] = []
        # The rows decoded together, chosen at start-up by measured step costs
        # (costs.decide_decode_rows; the server's worker holds the rest queued); None: not measured.
        self.decode_rows: int | None = None
        # Prompt positions a paged step feeds (PREFILL_TOKEN_BUDGET; the server's --prefill-budget).
        self.prefill_budget: int | None = PREFILL_TOKEN_BUDGET
        self._target_kv = kv_bytes_per_token(target.model)
        cache_model = drafter_cache_model(drafter)
        self._draft_kv = kv_bytes_per_token(cache_model) if cache_model is not None else 0
        self.kv_budget = self.resolve_kv_budget(kv_budget)    # bytes; None: no budget
        self.memory_fallbacks = 0     # rows that stopped drafting to fit the budget, ever
        # One store for the target's and a draft model's blocks, named under each one's identity,
        # within one share of the KV budget (prefix_cache.capacity_bytes).
        self.prefix_store = (PrefixStore(capacity_bytes(self.kv_budget))
                             if resolve_mode(prefix_cache) == "on" else None)
        self.prefix_stats = PrefixStats()     # the target's prompt tokens: looked up, served
        # The target's paged cache on the CPU's C path (paged_cache.py): one pool, sized by the
        # KV budget, shared by this engine's batches; where it does not apply, why not.
        # A head's features, and its own keys and values over prompt prefixes, are kept per
        # position beside the target's keys and values (priced in).
        self.paged_unused = paged_applies(target.model, self.kv_kind, self.compile_mode, drafter,
                                          self.config.tree_width, k_max=self.config.k_max)
        self.paged_space = (PagedSpace.for_budget(
            target.model, self.kv_budget,
            draft_model=drafter.draft_model() if drafter is not None else None,
            features=feature_width(target.model) if drafter is not None and drafter.wants_features
            else 0,
            head_bytes=drafter.prefix_position_bytes()
            if drafter is not None and self.prefix_store is not None else 0)
            if self.paged_unused is None else None)
        self.grammars = GrammarCompiler(target.tokenizer, self.vocab_size, self.eos_ids)
        if self.kv_budget is not None:
            log.info("KV budget %d bytes (%d target tokens)", self.kv_budget,
                     self.kv_budget // self._target_kv)
        if self.compile_mode == "on":
            self.warm_up()

    def resolve_kv_budget(self, setting: str | int | None) -> int | None:
        """The KV budget in bytes: the setting (tokens count the target's), else
        SPECPAIR_KV_BUDGET, else on CUDA a share of the device memory free now, else None."""
        if setting is None:
            setting = os.environ.get(KV_BUDGET_ENV) or None
        if setting is not None:
            amount, unit = parse_kv_budget(setting)
            return amount * self._target_kv if unit == "tokens" else amount
        if self.target.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.target.device)
            return int(free * KV_BUDGET_CUDA_FREE_FRACTION)
        return None

    def row_memory(self, prompt_tokens: int, params: GenerationParams) -> tuple[int, int]:
        """(bytes of a request's own keys and values, bytes speculation adds for it): its prompt
        and reply in the target's cache; k drafted positions past them (each with its tree's
        siblings) and, where the drafter keeps one, its cache of the same tokens. Counted as a
        paged cache holds them, each row its own; a preallocated cache sizes every row as the
        longest (kv/static.py)."""
        tokens = prompt_tokens + params.max_new_tokens
        k = self.config.k_max if params.speculation_k is None else params.speculation_k
        if self.drafter is None or not self.config.enabled or k == 0:
            return tokens * self._target_kv, 0
        width = self.config.tree_width if self.drafter.tree_capable else 1
        return tokens * self._target_kv, k * width * self._target_kv + (tokens + k) * self._draft_kv

    def kv_model(self, model, token_bucket: int | None = None):
        """A fresh cache for one of this engine's models, of the engine's kind."""
        return kv_model(model, vocab_size=self.vocab_size, kind=self.kv_kind, compile=self.compile_mode,
                        token_bucket=token_bucket)

    def serving_cache(self, model):
        """A fresh cache shaped as a batch runs `model`: the target's steps padded to the engine's
        token bucket, a draft model's one token wide. What warm-up captures and what the cost
        model times must be this shape, or they price a step the batch never runs."""
        return self.kv_model(model, self.token_bucket if model is self.target.model else None)

    @property
    def token_bucket(self) -> int:
        """Tokens per row of every target step after a prompt (a fixed-step cache pads each step
        to it, kv/fixed_step.py): a bonus token and k_max drafts, with their siblings in a tree;
        1 with nothing to verify."""
        if self.drafter is None or not self.config.enabled:
            return 1
        return bucket(1 + self.config.k_max * (self.config.tree_width if self.drafter.tree_capable
                                               else 1))

    def step_bucket(self, rows: int) -> int:
        """Tokens a row of the target's fixed step in a batch of `rows` rows: the engine's bucket
        while the batch may speculate (`Batch._ks`), one past that, as a target-only engine
        steps: a bucket padded for drafts that nobody sends is paid for by every row (SmolLM2 on
        an H100: 1.2x a one-token step at 16 tokens). Only the batch size decides, not a
        request's own k, so a request run target-only beside speculating ones shares their
        bucket and equals them bitwise; rows alive while the batch crosses the size change
        bucket, and are exact to rounding (docs/gpu.md)."""
        return self.token_bucket if rows <= self.config.batch_size_threshold else 1

    def describe_step(self) -> dict:
        """Which cache and step the target runs (the server's start-up log, the bench): what a
        figure measured."""
        out = step_description(self.target.model, self.kv_kind, self.compile_mode,
                               self.token_bucket)
        if self.paged_space is not None:     # the Batch's target cache (paged_cache.py)
            pool = self.paged_space.pool
            out["paged"] = {"blocks": pool.blocks, "block_positions": pool.block}
        return out

    @torch.no_grad()
    def warm_up(self) -> float:
        """Run each model's step once per shape class torch.compile specialises (1 and more than 1
        rows, 1 and several tokens, one row left in a larger cache, a prompt past the C layer's
        MAX_TOKENS a call), so no request pays a compile
        (tests/engine/test_engine_compile_warm_up.py), and a drafting head's steps
        (EagleDrafter.warm_up, MedusaDrafter.warm_up; `captures["head"]`). Returns the seconds it
        took."""
        start = time.perf_counter()
        models = [self.target.model]
        if self.drafter is not None and self.drafter.draft_model() is not None:   # a draft model's steps too
            models.append(self.drafter.draft_model())
        self.captures = {}
        for model in models:
            kv = self.serving_cache(model)
            if kv.fixed:     # every (rows, capacity) bucket, captured once
                name = "target" if model is self.target.model else "draft"
                if model is self.target.model:
                    kv.token_bucket = self.step_bucket(1)    # 1 where speculation never runs
                speculating = bucket(self.config.batch_size_threshold)
                # At one token a step, at least two rows: their graph serves every larger batch.
                self.captures[name] = kv.warm_up(speculating if kv.token_bucket > 1
                                                 else max(2, speculating),
                                                 self.target.context_length)
                if kv.token_bucket > 1:
                    # Past the batch size where speculation stops, the target steps at one token
                    # (step_bucket): compiled here at the first such rows bucket; larger
                    # ones share its graph (rows are symbolic) and record their own on first use.
                    kv.token_bucket = 1
                    self.captures[name + "_past_speculation"] = kv.warm_up(
                        2 * speculating, self.target.context_length, rows_from=2 * speculating)
                continue
            for rows in (1, 2):
                for width in (1, 2, self.config.k_max + 1):
                    kv = self.kv_model(model)
                    kv.add_rows(rows)
                    kv.extend([[0] * 3] * rows)
                    kv.extend([[0] * width] * rows, last=width)
            for width in (1, 2, self.config.k_max + 1):
                # One row left in a cache of two (the others finished): graphs of their own (a
                # cache of one row is specialised in the ones above).
                kv = self.kv_model(model)
                kv.add_rows(2)
                kv.extend([[0] * 3] * 2)
                kv.select([0])
                kv.extend([[0] * width], last=width)
            # A prompt past the C layer's tokens a call (cpu_kernels.MAX_TOKENS, 128; its graph
            # guards on it): each longer prompt's step shares this graph.
            kv = self.kv_model(model)
            kv.add_rows(2)
            kv.extend([[0] * (max(cpu_kernels.MAX_TOKENS, 64) // 2 + 1)] * 2)
        report = None
        if self.drafter is not None and self.config.enabled and self.config.batch_size_threshold > 0:
            report = self.drafter.warm_up_steps(bucket(self.config.batch_size_threshold), self.target.context_length,
                                                self.config.tree_width, self.config.k_max)
        if report is not None:
            self.captures["head"] = report
        return time.perf_counter() - start

    def apply_k_policy(self, policy: str = "auto") -> dict | None:
        """Set how dynamic k is chosen; returns the measured costs when it calibrated.

        'cost': measure draft/verify costs here and pick the k with most tokens per second;
        'heuristic': grow on full acceptance, shrink on rejection; 'auto': cost for model drafts,
        heuristic for n-gram lookup, whose acceptance comes in runs (a copied span is accepted
        whole, then nothing) that the growth rule follows better (measured: extraction 2.17x vs
        1.86x; model draft QA 0.86x -> 1.01x with the cost model; README).
        """
        if policy not in ("auto", "cost", "heuristic"):
            raise SpecpairError(f"unknown k policy {policy!r}: auto, cost or heuristic")
        if policy == "auto":
            policy = "cost" if self.draft is not None else "heuristic"
        if self.drafter is None or not self.config.dynamic_k or policy != "cost":
            self.cost_model = None
            return None
        return self.calibrate()

    def calibrate(self, prompt: str = "The quick brown fox jumps over the lazy dog. " * 4) -> dict:
        """Measure draft and verification costs here and choose k by them from now on."""
        ids = self.encode(prompt)
        costs = measure_step_costs(self, ids, list(range(1, self.config.k_max + 1)), repeats=3)
        self.cost_model = CostModel.from_seconds(costs)
        return costs

    # -- prompts -----------------------------------------------------------------------------

    def encode(self, prompt: str | list[dict], chat: bool = False) -> list[int]:
        return encode_prompt(self.target.tokenizer, prompt, chat)

    def validate(self, prompt_ids: list[int], params: GenerationParams) -> None:
        if not prompt_ids:
            raise SpecpairError("empty prompt: at least one token is needed")
        limit = self.target.context_length
        if len(prompt_ids) >= limit:
            raise SpecpairError(f"prompt has {len(prompt_ids)} tokens; the model's context is {limit}")
        if len(prompt_ids) + params.max_new_tokens > limit:
            raise SpecpairError(
                f"max_new_tokens {params.max_new_tokens} + prompt {len(prompt_ids)} tokens exceeds "
                f"the model's context of {limit}")

    # -- running ------------------------------------------------------------------------------

    def new_batch(self) -> "Batch":
        return Batch(self)

    # -- observers of the batches' rounds (batch_observer.py) ------------------------------------

    def add_observer(self, observer: BatchObserver) -> None:
        """Declare an observer every batch made from now on calls after each round. One that
        wants the target's features (a head scored in shadow) is handed them as a head drafter
        is, a shared prefix's from the paged cache's feature plane (paged_cache.py); the memory
        it keeps (`cache_bytes`) is counted in the paged cache's admission."""
        self.observers.append(observer)

    def remove_observer(self, observer: BatchObserver) -> None:
        self.observers = [o for o in self.observers if o is not observer]

    @contextlib.contextmanager
    def observers_paused(self):
        """No observer sees the rounds run inside (a server's warm-up is not traffic)."""
        observers, self.observers = self.observers, []
        try:
            yield
        finally:
            self.observers = observers + self.observers

    @property
    def observers_want_features(self) -> bool:
        return any(o.wants_features for o in self.observers)

    @property
    def shadow(self):
        """The shadow scorer among the observers (shadow.ShadowScorer), or None: what GetStats
        and the metrics report."""
        from specpair.shadow import ShadowScorer

        return next((o for o in self.observers if isinstance(o, ShadowScorer)), None)

    def prefix_caches(self, target_kv, drafter: Drafter | None) -> list[tuple[str, object]]:
        """(identity, cache) of each of a batch's caches the prefix store serves: the target's,
        and a draft model's. None where a drafter wants features: a head must see the target's
        features of every prompt token, which a prompt served from the store never computes."""
        if (self.prefix_store is None or not target_kv.reuses_prefixes
                or (drafter is not None and drafter.wants_features) or self.observers_want_features):
            return []
        caches = [(f"target {sorted(self.target.identity().items())}", target_kv)]
        draft_cache = drafter.reusable_prefix_cache() if drafter is not None else None
        if draft_cache is not None:
            caches.append(draft_cache)
        return caches

    def generate(self, prompts: list, params: GenerationParams | list[GenerationParams] | None = None,
                 *, chat: bool = False, speculate: bool = True) -> list[GenerationResult]:
        """Run prompts as one batch to completion (greedy unless params say otherwise)."""
        params = params or GenerationParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        batch = self.new_batch()
        batch.speculate = speculate
        seqs = [batch.add(self.encode(prompt, chat=chat), p) for prompt, p in zip(prompts, plist)]
        while batch.active:
            batch.step()
        return [batch.result(seq) for seq in seqs]


class Batch:
    """The running rows of one engine. Not thread-safe: one owner calls add/cancel/step.

    A batch may live as long as its server: it keeps no row after the row is done. `done` holds
    the rows that finished in the last `step()` (and those cancelled since), for the caller to read
    their results; the next step forgets them.
    """

    def __init__(self, engine: SpeculativeEngine):
        self.engine = engine
        # The paged cache where it applies (SpeculativeEngine.paged_space): rows admitted by
        # free blocks, preempted and recomputed when they run out, prefixes shared by reference.
        self.paged = engine.paged_space is not None
        self.target = (PagedKVModel(engine.target.model, vocab_size=engine.vocab_size,
                                    space=engine.paged_space) if self.paged
                       else engine.serving_cache(engine.target.model))
        self.preempted: list[Sequence] = []   # rows waiting for blocks to be recomputed, oldest first
        self.preemptions = 0                  # rows given back for want of blocks, ever
        self.drafter = engine.drafter.for_batch() if engine.drafter is not None else None
        self.draft_kv = None
        self._draft_in_pool()
        self.copies = self.drafter is not None and self.drafter.copies   # two kinds of rounds, two ks
        self.rows: list[Sequence] = []
        self.done: list[Sequence] = []        # finished in the last step or cancelled since
        self.speculate = True
        self.device = engine.target.device
        self.last_k = 0
        self.timing = StepTiming()
        self._row_sampling: RowSampling | None = None     # for these rows; None once they change
        # (The paged cache shares prefix blocks itself: _share_prefix, not the copying store.)
        self.prefix_caches = [] if self.paged else engine.prefix_caches(self.target, self.drafter)
        self._paged_identity = f"target {sorted(engine.target.identity().items())}"
        # This round's: rows with a grammar, whether a row asked for log-probabilities, and the
        # logits that scored each such row's committed tokens (step, _keep_token_logits).
        self._grammar_rows: list[int] = []
        self._wants_logprobs = False
        self._token_logits: list = []
        # Prompt positions a step feeds (the engine's, at the batch's start; None: whole prompts),
        # and this step's rows whose prompt it feeds only in part (row -> positions fed).
        self.prefill_budget: int | None = engine.prefill_budget
        self._prefill_cap: dict[int, int] = {}

    def _draft_in_pool(self) -> None:
        """A draft model's rows in the same pool (PagedSpace.draft): its cache is swapped for one
        over the pool's blocks, so its blocks count in admission and give way first. Its block
        names carry the plane's generation: a plane swapped in never reads the old one's."""
        space = self.engine.paged_space
        if not self.paged or space.draft is None:
            return
        self.draft_kv = PagedKVModel(self.drafter.draft_model(), space=space,
                                     vocab_size=self.drafter.kv.vocab_size, draft=True)
        self.drafter.kv = self.draft_kv
        self._draft_identity = (f"draft {sorted(self.drafter.loaded.identity().items())} "
                                f"plane {space.draft_generation}")

    def replace_drafter(self, drafter: Drafter | None) -> None:
        """A drafter swapped in between two steps (server/draft_swap.py; on the paged pool the
        engine's draft plane already made for its model: PagedSpace.install_draft_plane). The old
        draft rows' blocks go back; the new drafter's rows start empty and catch up from each
        row's sequence on its next round (a draft model feeds what its cache has not seen), or
        stop drafting there when the pool cannot hold that (_fit_blocks). Verification is the
        target's alone, so no row's output changes. Each row's draft block names are made again
        under the new drafter's identity (a prefix block is saved and shared as the new draft's)."""
        if self.draft_kv is not None:
            self.draft_kv.select([])          # the old plane's rows: their blocks back to the pool
            self.draft_kv = None
        self.drafter = drafter.for_batch() if drafter is not None else None
        self._draft_in_pool()
        if self.drafter is not None:
            self.drafter.add_rows(self.active)
        self.copies = self.drafter is not None and self.drafter.copies
        if self.paged:
            for seq in self.rows + self.preempted:
                if seq.prefix_keys:
                    seq.prefix_keys, seq.prefix_saved = seq.prefix_keys[:1], seq.prefix_saved[:1]
                    if self.draft_kv is not None:
                        seq.prefix_keys.append(block_keys(self._draft_identity, seq.prompt_ids,
                                                          self.target.pool.block))
                        seq.prefix_saved.append(False)
            return
        # The contiguous caches the prefix store serves: a row's keys follow the caches' list
        # (a cache of the same identity keeps its row's keys, a new one starts unsaved).
        old = list(self.prefix_caches)
        self.prefix_caches = self.engine.prefix_caches(self.target, self.drafter)
        store = self.engine.prefix_store
        for seq in self.rows:
            keys, saved = [], []
            for identity, _kv in self.prefix_caches:
                at = next((n for n, (was, _) in enumerate(old) if was == identity and n < len(seq.prefix_keys)),
                          None)
                keys.append(seq.prefix_keys[at] if at is not None else store.keys(identity, seq.prompt_ids))
                saved.append(seq.prefix_saved[at] if at is not None else False)
            seq.prefix_keys, seq.prefix_saved = keys, saved

    @property
    def active(self) -> int:
        return len(self.rows)

    def add(self, prompt_ids: list[int], params: GenerationParams, request_id: str | None = None
            ) -> Sequence:
        self.engine.validate(prompt_ids, params)
        if self.paged:
            pool = self.target.pool
            need = blocks_for(len(prompt_ids) + params.max_new_tokens, pool.block)
            if need > pool.blocks:
                raise SpecpairError(
                    f"prompt {len(prompt_ids)} tokens + max_new_tokens {params.max_new_tokens} "
                    f"need {need} KV blocks; the pool holds {pool.blocks} (blocks of "
                    f"{pool.block} positions: raise the KV budget or send a shorter request)")
        generator = None
        if not params.greedy and params.seed is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(int(torch.randint(0, 2**62, (1,))))
        grammar = self.engine.grammars.row(params.structure) if params.structure else None
        # An audited request never backs off: its rounds are live acceptance's sample.
        audited = self.engine.audit.draw(self.engine.config)
        back_off = False if audited else None
        seq = Sequence(request_id=request_id or f"req-{next(self.engine._ids)}",
                       prompt_ids=list(prompt_ids), params=params, generator=generator,
                       grammar=grammar,
                       dynamic_k=DynamicK(self.engine.config, self.engine.cost_model, back_off=back_off),
                       copy_k=DynamicK(self.engine.config, back_off=back_off) if self.copies else None,
                       stats=AcceptanceStats(audited=audited), tokens=list(prompt_ids),
                       detokenizer=IncrementalDetokenizer(self.engine.target.tokenizer,
                                                          self.engine.eos_ids, len(prompt_ids)),
                       memory=self.engine.row_memory(len(prompt_ids), params))
        self.rows.append(seq)
        self._row_sampling = None
        self.target.add_rows(1)
        if self.drafter is not None:
            self.drafter.add_rows(1)
        if self.paged:
            self._share_prefix(seq, first=True)
            return seq
        self._load_prefix(seq)
        self._fit_kv_budget(seq)
        return seq

    # -- the paged cache: prefix blocks by reference, admission by blocks, preemption ----------

    @property
    def _wants_features(self) -> bool:
        """Whether the target hands its features over (a head drafter, an observer scoring one)."""
        return ((self.drafter is not None and self.drafter.wants_features)
                or self.engine.observers_want_features)

    @property
    def _names_identity(self) -> str:
        """What the target's block names hash first: the model, and where a head reads the
        target's features, their layout (a block's features are kept beside its keys: a row
        wanting other features, or any, must not share it)."""
        if not self._wants_features:
            return self._paged_identity
        return f"{self._paged_identity} features {self.target.runner.feature_layers}"

    def _prompt_names(self, seq: Sequence) -> list[bytes]:
        """The prompt's block names in the pool: the target's ([0]), a draft model's ([1])."""
        if not seq.prefix_keys:
            seq.prefix_keys = [block_keys(self._names_identity, seq.prompt_ids,
                                          self.target.pool.block)]
            seq.prefix_saved = [False]
            if self.draft_kv is not None:
                seq.prefix_keys.append(block_keys(self._draft_identity, seq.prompt_ids,
                                                  self.target.pool.block))
                seq.prefix_saved.append(False)
        return seq.prefix_keys[0]

    def _share_prefix(self, seq: Sequence, first: bool) -> None:
        """The new (last) row's table starts with the pool's blocks of its prompt's longest
        cached run of names, by reference; its prefill feeds only the rest. A head drafter (and
        an observer) wanting the target's features is handed the shared positions' from the
        pool's feature plane, as if the target had computed them now."""
        if self.engine.prefix_store is None:        # prefix reuse off
            return
        row = len(self.rows) - 1
        held = self.target.share_prefix(row, self._prompt_names(seq), len(seq.prompt_ids))
        if self.draft_kv is not None:
            self.draft_kv.share_prefix(row, seq.prefix_keys[1], len(seq.prompt_ids))
        if held and self._wants_features:
            features = self.target.stored_features(row, held)
            self._hand_features(row, 0, features, False)        # the observers', from 0
            if self.drafter is not None and self.drafter.wants_features:
                # The head's own keys and values over the prefix's blocks from the store where
                # a row computed them before; its features from there on.
                loaded = self._load_head_prefix(seq, row, held)
                self.drafter.observe(row, loaded, features[loaded:])
        if first:
            seq.cached_tokens = held
            self.engine.prefix_stats.looked_up += len(seq.prompt_ids)
            self.engine.prefix_stats.served += held

    def _publish_prefixes(self) -> None:
        """Name the full prompt blocks of each row that now holds its whole prompt."""
        if self.engine.prefix_store is None:
            return
        caches = [self.target] + ([self.draft_kv] if self.draft_kv is not None else [])
        for i, seq in enumerate(self.rows):
            for n, kv in enumerate(caches):
                if seq.prefix_saved and not seq.prefix_saved[n] and \
                        kv.lengths[i] >= len(seq.prompt_ids):
                    kv.publish(i, seq.prefix_keys[n])
                    seq.prefix_saved[n] = True

    @property
    def _shares_head_prefix(self) -> bool:
        """Whether the drafter's own cache over a prompt prefix is kept in the pool beside the
        target's blocks and served to later rows sharing them (a head's keys and values:
        Drafter.prefix_identity; paged_cache.PagedKVModel.store_head)."""
        return (self.paged and self.engine.prefix_store is not None and self.drafter is not None
                and self.drafter.prefix_identity() is not None)

    def _load_head_prefix(self, seq: Sequence, row: int, held: int) -> int:
        """The empty head row's keys and values over the pool's run of them within the `held`
        shared positions (their features are the pool's too). -> positions loaded."""
        if not self._shares_head_prefix:
            return 0
        span = self.target.stored_head(row, self.drafter.prefix_identity(), held)
        loaded = self.drafter.load_prefix(row, [span]) if span is not None else 0
        seq.head_cached = max(seq.head_cached, loaded)
        return loaded

    def _save_head_prefixes(self) -> None:
        """Keep the head's keys and values over each row's full prompt blocks in the pool,
        once the target has named them and the head has computed them (its catch-up reached
        the pair before the last full block's end)."""
        block, identity = self.target.pool.block, self.drafter.prefix_identity()
        for i, seq in enumerate(self.rows):
            if seq.head_saved or not seq.prefix_saved or not seq.prefix_saved[0]:
                continue
            full = len(seq.prefix_keys[0])
            if self.drafter.prefix_positions(i) < full * block - 1:
                continue
            self.target.store_head(i, identity, full, lambda start, width, i=i:
                                   self.drafter.read_prefix(i, [start], width)[0][0])
            seq.head_saved = True

    def blocks_to_admit(self, prompt_ids: list[int]) -> int:
        """Blocks the pool would give a new row for its prompt and first token (its cached
        prefix blocks held by no row count too: taking them leaves fewer to give)."""
        pool = self.target.pool
        names = []
        if self.engine.prefix_store is not None:
            names = block_keys(self._names_identity, prompt_ids, pool.block)
        return pool.blocks_to_admit(names, len(prompt_ids))

    def _blocks_reserved(self) -> int:
        """Blocks the rows will take from the pool for what they hold uncached (a row admitted
        but not yet stepped: its prompt) and one position more, at least one block a row; and
        the caches kept beside the pool (_shadow_blocks)."""
        pool, kv = self.target.pool, self.target
        return self._shadow_blocks() + sum(
            max(1, blocks_for(len(seq.tokens) + 1, pool.block) - pool.held(kv.keys[i]))
            for i, seq in enumerate(self.rows))

    def _shadow_blocks(self) -> int:
        """The caches kept apart from the pool for this batch's rows, counted in the pool's
        blocks: a head drafter's own (drafters.base.Drafter.cache_bytes) and a shadow
        candidate's (shadow.py). The KV budget holds them all, so the rows get that much less."""
        held = sum(o.cache_bytes(self) for o in self.engine.observers)
        if self.drafter is not None:
            held += self.drafter.cache_bytes()
        pool = self.target.pool
        return -(-held // (pool.block * self.engine._target_kv)) if held else 0

    def has_room(self, prompt_ids: list[int]) -> bool:
        """Admission by free blocks (the server's worker asks before add): no row waits to be
        recomputed, and the pool can give the new row its prompt's blocks beside what the rows
        in the batch will take (_blocks_reserved). Without a paged cache: always."""
        if not self.paged:
            return True
        if self.preempted:
            return False
        return self.blocks_to_admit(prompt_ids) <= self.target.pool.free - self._blocks_reserved()

    def _fit_blocks(self) -> None:
        """Before a step: each row's next positions (its uncached tokens, and its drafts, which
        are blocks too) against the pool's free blocks (block_pool.plan_admission): drafting
        stops first, newest row first; then the newest rows are preempted, to be recomputed
        from their tokens once blocks are free (their output does not change: a token's keys
        are the same whichever call computes them)."""
        for seq in self.rows:
            seq.memory_target_only = False
        ks = self._ks()
        if self.copies:      # a row may copy more than its head drafts (its own k)
            ks = [max(k, c) for k, c in zip(ks, self._ks(copying=True))]
        pool = self.target.pool
        order = sorted(range(len(self.rows)), key=lambda i: self.rows[i].started)
        draft = self.draft_kv
        # A draft model's row, when drafting, catches up to the row's tokens and feeds k-1 drafts.
        # A tree's drafts are each depth's candidates, every one a position this step feeds.
        width = (self.engine.config.tree_width if self.drafter is not None
                 and self.drafter.tree_capable else 1)
        needs = [pool.need(self.target.keys[i], self.target.lengths[i],
                           len(self.rows[i].tokens) - self.target.lengths[i], ks[i] * width,
                           draft.keys[i] if draft is not None else None,
                           len(self.rows[i].tokens) + ks[i] - 1)
                 for i in order]
        plan = plan_admission(needs, max(0, pool.free - self._shadow_blocks()), pool.block)
        if not plan.changes:
            return
        by_key = {key: seq for key, seq in zip(self.target.keys, self.rows)}
        row_of = {key: i for i, key in enumerate(self.target.keys)}
        for key in plan.target_only:
            by_key[key].memory_target_only = True
            self.engine.memory_fallbacks += 1
            if draft is not None:      # its draft row's blocks go back; it catches up later
                draft.rollback(row_of[key], 0)
        gone = {id(by_key[key]) for key in plan.preempt}
        if not gone:
            return
        keep = [i for i, s in enumerate(self.rows) if id(s) not in gone]
        for seq in (s for s in self.rows if id(s) in gone):
            seq.preemptions += 1
            self.preempted.append(seq)
            log.info("KV blocks: %s preempted (%d positions given back; %d blocks free)",
                     seq.request_id, len(seq.tokens), pool.free)
        self.preemptions += len(gone)
        self.engine.paged_space.preemptions += len(gone)
        self.preempted.sort(key=lambda s: s.started)
        self.rows = [self.rows[i] for i in keep]
        self._row_sampling = None
        self.target.select(keep)
        if self.drafter is not None:
            self.drafter.select(keep)

    def _resume_preempted(self) -> None:
        """Preempted rows join again, oldest first, while the pool can give each its tokens'
        blocks (a shared prefix from the cache) and a block for every running row's next step;
        their next step recomputes their prompt and what they emitted."""
        pool = self.target.pool
        while self.preempted:
            seq = self.preempted[0]
            names = self._prompt_names(seq) if self.engine.prefix_store is not None else []
            need = pool.blocks_to_admit(names, len(seq.tokens))
            if self.rows and need > pool.free - self._blocks_reserved():
                return
            self.preempted.pop(0)
            self.rows.append(seq)
            self._row_sampling = None
            self.target.add_rows(1)
            if self.drafter is not None:
                self.drafter.add_rows(1)
            self._share_prefix(seq, first=False)
            log.info("KV blocks: %s resumed, recomputing %d positions", seq.request_id,
                     len(seq.tokens) - self.target.lengths[-1])

    # -- prefix reuse (prefix_cache.py) ---------------------------------------------------------

    def _load_prefix(self, seq: Sequence) -> None:
        """The new (last) row's caches take the longest stored run of its prompt's blocks; the
        prefill then feeds only the rest (every feed starts at the cache's length)."""
        store, row = self.engine.prefix_store, len(self.rows) - 1
        for n, (identity, kv) in enumerate(self.prefix_caches):
            keys = store.keys(identity, seq.prompt_ids)
            held = kv.load_blocks(row, store.lookup(keys, len(seq.prompt_ids)))
            seq.prefix_keys.append(keys)
            seq.prefix_saved.append(False)
            if n == 0:
                seq.cached_tokens = held
                self.engine.prefix_stats.looked_up += len(seq.prompt_ids)
                self.engine.prefix_stats.served += held

    def prefix_pending(self, prompt_ids: list[int]) -> bool:
        """Whether a row here will store this prompt's first block the store lacks once it has
        stepped: a request that waits for that step prefills only what differs (the server's
        worker holds it back; prompts arriving together then share one prefill)."""
        if self.paged and self.engine.prefix_store is not None:
            pool = self.target.pool
            names = block_keys(self._names_identity, prompt_ids, pool.block)
            first = next((n for n in names[:reusable_blocks(len(prompt_ids), pool.block)]
                          if not pool.cached(n)), None)
            return first is not None and any(
                s.prefix_saved and not s.prefix_saved[0] and first in s.prefix_keys[0]
                for s in self.rows)
        if not self.prefix_caches:
            return False
        store = self.engine.prefix_store
        keys = store.keys(self.prefix_caches[0][0], prompt_ids)
        first = next((k for k in keys[:reusable_blocks(len(prompt_ids), store.block)]
                      if k not in store), None)
        return first is not None and any(
            not s.prefix_saved[0] and first in s.prefix_keys[0] for s in self.rows)

    def _save_prefixes(self) -> None:
        """Store the full prompt blocks the store lacks, of each cache that now holds a row's
        whole prompt (the target after the row's first step, a draft model after its first
        draft)."""
        store = self.engine.prefix_store
        for i, seq in enumerate(self.rows):
            for n, (_, kv) in enumerate(self.prefix_caches):
                if seq.prefix_saved[n] or kv.lengths[i] < len(seq.prompt_ids):
                    continue
                keys = seq.prefix_keys[n]
                missing = store.missing(keys)
                blocks = kv.read_blocks(i, [b * store.block for b in missing], store.block)
                store.insert(keys, {b: (block, block.nbytes) for b, block in zip(missing, blocks)})
                seq.prefix_saved[n] = True

    # -- the KV budget -------------------------------------------------------------------------

    def kv_in_use(self) -> int:
        """KV bytes the rows hold: their own, and speculation's for the rows that draft (the
        paged cache: its pool's blocks held by rows)."""
        if self.paged:
            pool = self.target.pool
            return (pool.blocks - pool.free) * pool.block * self.engine._target_kv
        return sum(s.memory[0] + (s.memory[1] if self.speculate and not s.memory_target_only else 0)
                   for s in self.rows)

    def _fit_kv_budget(self, newcomer: Sequence) -> None:
        """Speculation's memory goes first: past the budget the newcomer is admitted
        target-only, then the newest rows that still draft stop drafting, until the rows fit.
        A request is never refused for memory here: queueing is the server's admission's."""
        budget = self.engine.kv_budget
        if budget is None or self.kv_in_use() <= budget:
            return
        for seq in [newcomer] + [s for s in reversed(self.rows) if s is not newcomer]:
            if seq.memory_target_only or not seq.memory[1]:
                continue
            seq.memory_target_only = True
            self.engine.memory_fallbacks += 1
            log.warning("KV budget: %s %s target-only (%d of %d bytes in use; its drafts "
                        "would take %d more)", seq.request_id,
                        "admitted" if seq is newcomer else "continues", self.kv_in_use(), budget,
                        seq.memory[1])
            if self.kv_in_use() <= budget:
                return
        log.warning("KV budget: %d bytes in use without any drafting, past the budget of %d",
                    self.kv_in_use(), budget)

    def _resume_drafting(self) -> None:
        """Rows that stopped drafting for memory draft again, oldest first, once it is there."""
        budget = self.engine.kv_budget
        waiting = [s for s in self.rows if s.memory_target_only]
        if budget is None or not waiting:
            return
        used = self.kv_in_use()
        for seq in waiting:
            if used + seq.memory[1] <= budget:
                seq.memory_target_only = False
                used += seq.memory[1]
                log.info("KV budget: %s drafts again (%d of %d bytes in use)", seq.request_id,
                         used, budget)

    def release(self) -> None:
        """Give the cache's rows back now (a batch being replaced after a failed step): its paged
        blocks go back to the engine's pool at once, not when the batch is collected."""
        if self.paged:
            self.target.select([])
            if self.draft_kv is not None:
                self.draft_kv.select([])

    def cancel(self, request_id: str) -> None:
        for seq in self.rows:
            if seq.request_id == request_id:
                seq.finished, seq.finish_reason = True, "cancelled"
        for seq in [s for s in self.preempted if s.request_id == request_id]:
            seq.finished, seq.finish_reason = True, "cancelled"
            self.preempted.remove(seq)
            self.done.append(seq)
        self._drop_finished()

    # -- one round -----------------------------------------------------------------------------

    def _ks(self, copying: bool = False) -> list[int]:
        """Each row's k this round (for rounds that copy, with `copying`)."""
        eng = self.engine
        on = (self.speculate and self.drafter is not None and eng.controller.should_speculate()
              and self.active <= eng.config.batch_size_threshold)
        cap = k_for_rows(eng.speculation_by_rows, self.active)    # measured at this batch size
        ks = []
        # A head drafts from the target's features of the token before its drafts: a row whose
        # prompt the target has not fed to its end (a shared prefix's features are handed, the
        # rest not yet computed) waits for that step. A copy needs no features: the round at
        # the prompt's end copies (the verify feeds the prompt's tail and the copy in one step),
        # as on the contiguous cache, whose head has no features before that round either.
        heads = (self.paged and self.drafter is not None and self.drafter.wants_features
                 and not copying)
        for i, seq in enumerate(self.rows):
            if (heads and len(seq.tokens) - self.target.lengths[i] > 1) or i in self._prefill_cap:
                ks.append(0)       # (a row still prefilling drafts nothing: it emits nothing)
                continue
            k = (seq.copy_k if copying else seq.dynamic_k).k
            if eng.controller.k_override is not None:
                k = eng.controller.k_override
            if seq.params.speculation_k is not None:
                k = seq.params.speculation_k
            elif cap is not None and eng.controller.k_override is None:
                k = min(k, cap)
            remaining = seq.params.max_new_tokens - seq.num_generated - 1
            ks.append(max(0, min(k, remaining)) if on and not seq.memory_target_only
                      and not seq.drafts_ended else 0)
        return ks

    def _prefill_caps(self) -> dict[int, int]:
        """The rows whose uncached prompt (or a preempted row's tokens) this step feeds only in
        part, under the engine's prefill token budget -> the positions each is fed (0: it
        waits). The budget counts every position a step feeds, as vLLM's: the rows decoding (one
        uncached token each, always fed) take theirs first, so a step's tokens fill the C
        layer's calls of MAX_TOKENS (each call reads every weight once); the oldest rows prefilling
        share the rest, and never less than PREFILL_PROMPT_SHARE of the budget (one position at
        the least), so a batch of more rows decoding than the budget cannot starve a prompt (the
        step then feeds over the budget). With no row decoding there is no time between tokens
        to bound: the step feeds PREFILL_IDLE_TOKEN_BUDGET (a cold prompt alone in one step, not
        budget-sized chunks). Only on the paged cache: the C layer computes a
        token's keys and features the same in any call, so a head drafter (and an observer)
        handed a prompt's features chunk by chunk (step: _hand_features of each chunk) holds
        what one whole prefill hands it, and drafts the same after the last chunk (a row mid-
        prompt drafts nothing and a head's catch-up computes each pair alike in any call;
        tests/engine/test_engine_prefill_budget_heads.py). Trees too: a row mid-prompt feeds
        its chunk as a chain (_verify_tree); observers skip it until its prompt is whole
        (VerifiedRound.prefilling)."""
        budget = self.prefill_budget
        if not budget or not self.paged:
            return {}
        uncached = [len(s.tokens) - n for s, n in zip(self.rows, self.target.lengths)]
        decoding = sum(1 for n in uncached if n <= 1)
        if decoding:
            left = max(max(1, int(budget * PREFILL_PROMPT_SHARE)), budget - decoding)
        else:
            left = max(budget, PREFILL_IDLE_TOKEN_BUDGET)
        caps = {}
        for i in sorted(range(len(self.rows)), key=lambda i: self.rows[i].started):
            if uncached[i] <= 1:
                continue
            if uncached[i] <= left:
                left -= uncached[i]
            else:
                # Never the prompt's last token alone for the next step: the row would count as
                # decoding there, and a head would draft at its prompt's end from the features
                # of all but its last position, a round a whole prefill never drafts (a head
                # drafts first after the step that feeds a prompt's last token). Where one
                # position is left (a cap of 0 could leave a step nothing to feed), both are
                # fed: one position over the budget.
                if uncached[i] - left == 1:
                    if left == 1:
                        left = 0           # (not capped: fed whole)
                        continue
                    left -= 1
                caps[i], left = left, 0
        return caps

    def step(self) -> list[StepOutput]:
        self.done = []
        self._prefill_cap = {}
        if self.paged:
            self._resume_preempted()
        if not self.rows:
            return []
        started = time.perf_counter()
        if self.paged:
            self._fit_blocks()
            self._prefill_cap = self._prefill_caps()
        else:
            self._resume_drafting()
        eng = self.engine
        B = self.active
        sampling = self._sampling()
        ks = self._ks()
        copy_ks = self._ks(copying=True) if self.copies else None
        self.last_k = max(ks, default=0)
        if self.target.fixed:
            self.target.token_bucket = eng.step_bucket(B)
            self._prefill_apart()
        sequences = [s.tokens for s in self.rows]

        # Draft.
        t0 = time.perf_counter()
        siblings = None
        if self.drafter is not None and (any(ks) or (copy_ks is not None and any(copy_ks))):
            width = eng.config.tree_width if self.drafter.tree_capable else 1
            extra = {"copy_ks": copy_ks} if self.copies else {}
            # A drafter that can proposes within each row's grammar (drafters.base.Drafter.grammars).
            self.drafter.grammars = [s.grammar for s in self.rows] if any(s.grammar for s in self.rows) else None
            proposal = self._on_device(self.drafter.propose, sequences, ks, sampling, width, **extra)
            drafts, num, q = proposal.tokens, proposal.num, proposal.probs
            siblings, copied, drafted = proposal.siblings, proposal.copied, proposal.host
        else:
            drafts = torch.zeros(B, 0, dtype=torch.long, device=self.device)
            num = torch.zeros(B, dtype=torch.long, device=self.device)
            q = copied = None
            drafted = [[] for _ in range(B)]
        sync(self.device)
        t1 = time.perf_counter()

        # Verify: each row feeds what the target has not cached plus its drafts.
        committed = [len(s.tokens) for s in self.rows]
        if drafted is not None:
            nums = [len(d) for d in drafted]
        else:                      # drafted on the device: read once
            nums = num.tolist()
            if siblings is None:
                drafted = [d[:n] for d, n in zip(drafts.tolist(), nums)]
        proposed = list(nums)      # what each row drafted, counted whatever its grammar allows
        self._grammar_rows = [i for i, s in enumerate(self.rows) if s.grammar is not None]
        if self._grammar_rows:
            # Drafts the grammar refuses are not verified: each row's run (a tree's chain, its
            # siblings masked in _verify_tree) is cut at the first.
            chains = drafted if siblings is None else [d[:n] for d, n in zip(drafts.tolist(), nums)]
            for i in self._grammar_rows:
                nums[i] = self.rows[i].grammar.allowed(chains[i])
                chains[i] = chains[i][:nums[i]]
            num = torch.tensor(nums, dtype=torch.long, device=self.device)
        self._wants_logprobs = any(s.params.logprobs is not None for s in self.rows)
        self._token_logits = [None] * B
        drafter_features = self.drafter is not None and self.drafter.wants_features
        wants_features = drafter_features or eng.observers_want_features
        cached_before = list(self.target.lengths)
        if siblings is not None:
            accepted_l, next_l, kept, fed_kept, features = self._verify_tree(
                drafts, num, siblings, q, sampling, committed, wants_features, copied)
        else:
            accepted_l, next_l, features = self._verify_chain(drafts, num, q, sampling,
                                                              wants_features, drafted)
            kept = [drafted[i][:a] for i, a in enumerate(accepted_l)]
            fed_kept = [list(range(committed[i] + a - cached_before[i]))
                        for i, a in enumerate(accepted_l)]
        sync(self.device)
        t2 = time.perf_counter()

        outputs = []
        for i, seq in enumerate(self.rows):
            if i in self._prefill_cap:      # its prompt fed in part: nothing to emit yet
                if wants_features and self._prefill_cap[i]:
                    self._hand_features(i, cached_before[i], features[i, :self._prefill_cap[i]],
                                        drafter_features)
                continue
            a = accepted_l[i]
            self.target.rollback(i, committed[i] + a)
            if self.drafter is not None:
                self.drafter.accepted(i, committed[i], a)
            if wants_features:   # features of the tokens now committed (the fed ones accepted)
                self._hand_features(i, cached_before[i], features[i, fed_kept[i]],
                                    drafter_features)
            new = kept[i] + [next_l[i]]
            n = proposed[i]
            seq.stats.record_round(n, a, copied=bool(copied and copied[i]))
            seq.stats.num_target_steps += 1
            seq.stats.draft_seconds += (t1 - t0) if n else 0.0
            seq.stats.target_seconds += t2 - t1
            (seq.copy_k if copied and copied[i] else seq.dynamic_k).update(n, a)
            # The engine-wide fallback reads audited rows' rounds only (costs.RequestAudit).
            audited = seq.stats.audited
            if eng.controller.record(n if audited else 0, a if audited else 0,
                                     emitted_target_only=len(new) if not n else 0):
                seq.stats.fallback_events += 1
            if seq.grammar is not None:
                seq.grammar.advance(new)
            logprobs = (token_logprobs(self._token_logits[i], new, seq.params)
                        if seq.params.logprobs is not None else None)
            outputs.append(self._emit(seq, new, logprobs))
        if eng.observers:   # they only read (batch_observer.py): shadow scoring
            verified = VerifiedRound(committed, self.first_logits, sampling, drafts, num, q,
                                     accepted_l, prefilling=frozenset(self._prefill_cap))
            for observer in eng.observers:
                observer.after_round(self, verified)
        if self.prefix_caches:
            self._save_prefixes()
        if self.paged:
            self._publish_prefixes()
            if self._shares_head_prefix:
                self._save_head_prefixes()
        self.target.trim()
        if self.drafter is not None:
            self.drafter.trim()
        self._drop_finished()
        if self.paged and self.preempted:
            self._resume_preempted()      # a batch never idles while a preempted row waits
        self.timing.steps += 1
        self.timing.seconds += time.perf_counter() - started
        return outputs

    def _sampling(self) -> RowSampling:
        """The rows' sampling settings as device tensors, built again only when the rows change:
        three host-to-device copies every step were a visible share of a 2 ms GPU step, and
        whether every row is greedy is known here without asking the device (docs/gpu.md).

        Seeded sampled rows draw by (seed, position) (rejection_sampler.keyed_sample): their keys,
        with where each one's round starts this step, its next token's position. Its reply then
        depends on nothing but its prompt, settings and seed: not on its batch, on how many
        tokens a round drafts, or on whether it speculates."""
        if self._row_sampling is None:
            params = [s.params for s in self.rows]
            keyed = [i for i, p in enumerate(params) if p.seed is not None and not p.greedy]
            keys = DrawKeys(rows=keyed, seeds=torch.tensor([seed_key(params[i].seed) for i in keyed],
                                                           dtype=torch.long, device=self.device),
                            start=torch.zeros(len(keyed), dtype=torch.long, device=self.device))
            self._row_sampling = RowSampling(
                temperature=torch.tensor([p.temperature for p in params], device=self.device),
                top_k=torch.tensor([p.top_k for p in params], device=self.device),
                top_p=torch.tensor([p.top_p for p in params], device=self.device),
                generators=[s.generator for s in self.rows],
                greedy=all(p.temperature <= 0 for p in params), keys=keys if keyed else None)
        sampling = self._row_sampling
        if sampling.keys is not None:
            start = [len(self.rows[i].tokens) for i in sampling.keys.rows]
            sampling = replace(sampling, keys=replace(
                sampling.keys, start=torch.tensor(start, dtype=torch.long, device=self.device)))
        return sampling

    def _on_device(self, call, *args, **kwargs):
        """A model call, waited for, its time counted as the model's (StepTiming)."""
        start = time.perf_counter()
        out = call(*args, **kwargs)
        returned = time.perf_counter()
        sync(self.device)
        end = time.perf_counter()
        self.timing.model_seconds += end - start
        self.timing.wait_seconds += end - returned
        return out

    def _prefill_apart(self) -> None:
        """A fixed-step target (kv/fixed_step.py) takes each new row's prompt but its last token
        in a forward of its own, so every verification feeds only a bonus token and drafts, at
        the token bucket, and the prompt's keys are the same whether the round speculates or
        not: greedy speculation then equals target-only bitwise."""
        feed = [s.tokens[self.target.lengths[i]:-1] for i, s in enumerate(self.rows)]
        if not any(feed):
            return
        starts = list(self.target.lengths)
        drafter_features = self.drafter is not None and self.drafter.wants_features
        wants = drafter_features or self.engine.observers_want_features
        out = self._on_device(self.target.extend, feed, hidden=wants)
        for i, tokens in enumerate(feed if wants else []):
            if tokens:
                self._hand_features(i, starts[i], out[1][i, :len(tokens)], drafter_features)

    def _hand_features(self, row: int, start: int, features, drafter: bool) -> None:
        """The target's features of row's tokens from `start` to the drafter (where it wants
        them) and to the observers that do."""
        if drafter:
            self.drafter.observe(row, start, features)
        for observer in self.engine.observers:
            if observer.wants_features:
                observer.take_features(self, row, start, features)

    def _verify_chain(self, drafts, num, q, sampling, wants_features, drafted):
        """One target pass over each row's uncached tokens and drafts (`drafted`: each row's,
        on the host); -> per row (accepted, next token), and the features of every fed token
        when the drafter wants them."""
        B = self.active
        nums = [len(d) for d in drafted]
        caps = self._prefill_cap
        feed = [s.tokens[self.target.lengths[i]:] + drafted[i] if i not in caps
                else s.tokens[self.target.lengths[i]:self.target.lengths[i] + caps[i]]
                for i, s in enumerate(self.rows)]
        K = max(nums, default=0)
        features = None
        if wants_features:   # the head drafts from the target's features of what it verified
            logits, features = self._on_device(self.target.extend, feed, last=K + 1, hidden=True)
        else:
            logits = self._on_device(self.target.extend, feed, last=K + 1)  # [B, K+1, V] right-aligned
        # Row i's logits for its n_i drafts and the token after them: the last n_i + 1.
        logits = self._mask_grammar(logits, {i: K - n for i, n in enumerate(nums)}, drafted)
        if sampling.all_greedy:
            out = self._accept_greedy(logits, drafted, K)
            self._keep_token_logits(logits, {i: K - n for i, n in enumerate(nums)}, out[0])
            return out + (features,)
        # Left-align each row's K_i + 1 verification logits.
        offset = (K - num).view(B, 1) + torch.arange(K + 1, device=self.device).view(1, K + 1)
        offset = offset.clamp(max=K)
        logits = logits.gather(1, offset.unsqueeze(-1).expand(B, K + 1, logits.shape[-1]))
        drafts = drafts[:, :K]
        self.first_logits = logits[:, 0]     # each row's next-token logits: the shadow's p (shadow.py)
        left = {i: 0 for i in range(B)}

        accepted, next_token = greedy_verify(logits, drafts, num)
        # Greedy batches returned above: here some row samples.
        greedy_rows = sampling.temperature <= 0
        p = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        if any(g is not None for g in sampling.generators):    # unseeded sampled rows
            if q is None:   # deterministic drafter: point masses on its tokens
                q = torch.zeros(B, K, p.shape[-1], device=self.device, dtype=p.dtype)
                if K:
                    q.scatter_(-1, drafts.unsqueeze(-1), 1.0)
            q = q[:, :K].to(p.dtype)
            s_acc, s_next = rejection_sample(p, q, drafts, num, sampling.generators)
            accepted = torch.where(greedy_rows, accepted, s_acc)
            next_token = torch.where(greedy_rows, next_token, s_next)
        keys = sampling.keys
        if keys is not None:      # seeded rows: the target's keyed draws decide
            rows = keys.rows
            accepted[rows], next_token[rows] = keyed_verify(p[rows], drafts[rows], num[rows],
                                                            keys.seeds, keys.start)
        # One read of the device for both (each read waits for the stream).
        accepted_l, next_l = torch.stack((accepted, next_token)).tolist()
        self._keep_token_logits(logits, left, accepted_l)
        return accepted_l, next_l, features

    def _mask_grammar(self, logits, first: dict[int, int], drafted) -> torch.Tensor:
        """The target's logits [B, T, V] with each grammar row's positions first[i] ..
        first[i] + len(drafted[i]) masked by its grammar after the tokens before each (the
        drafts are ones it allows): -inf where the grammar refuses a token. A new tensor (the
        step's own buffer is left alone); `logits` itself when no row has a grammar."""
        rows = [i for i in self._grammar_rows if i in first]
        if not rows:
            return logits
        logits = logits.clone()
        V = logits.shape[-1]
        for i in rows:
            tokens = drafted[i] if drafted is not None else []
            allowed = self.rows[i].grammar.masks(tokens, V).to(logits.device)
            # A matcher with nothing left to allow (it cannot happen for a well-formed grammar)
            # still ends the reply rather than sampling from nothing.
            empty = ~allowed.any(-1)
            if bool(empty.any()):
                allowed[empty, sorted(self.engine.eos_ids)[0]] = True
            at = first[i]
            logits[i, at:at + len(tokens) + 1].masked_fill_(~allowed, float("-inf"))
        return logits

    def _mask_siblings(self, sibling_logits, chains, siblings, fed) -> torch.Tensor:
        """A tree's sibling logits [B, K, S, V] with each grammar row's node (depth j, sibling s)
        masked by its grammar after chains[i][:j] and that sibling (RowGrammar.sibling_masks);
        `sibling_logits` itself when no fed row has a grammar. A node the grammar leaves nothing
        (a refused sibling, never kept) allows EOS, as in _mask_grammar, so nothing samples from
        an empty distribution."""
        rows = [i for i in self._grammar_rows if fed[i] and chains[i]]
        if not rows:
            return sibling_logits
        out = sibling_logits.clone()
        V = out.shape[-1]
        eos = sorted(self.engine.eos_ids)[0]
        for i in rows:
            n = len(chains[i])
            allowed = self.rows[i].grammar.sibling_masks(chains[i], siblings[i][:n], V).to(out.device)
            empty = ~allowed.any(-1)
            if bool(empty.any()):
                allowed[empty, eos] = True
            out[i, :n].masked_fill_(~allowed, float("-inf"))
        return out

    def _keep_token_logits(self, logits, first: dict[int, int], accepted: list[int]) -> None:
        """Keep the logits [a_i + 1, V] that scored each row's committed tokens (its kept drafts
        and the token after them), for the rows that asked for log-probabilities."""
        if not self._wants_logprobs:
            return
        for i, seq in enumerate(self.rows):
            if seq.params.logprobs is not None:
                self._token_logits[i] = logits[i, first[i]:first[i] + accepted[i] + 1]

    def _accept_greedy(self, logits, drafted, K: int) -> tuple[list[int], list[int]]:
        """Greedy acceptance (rejection_sampler.greedy_verify's rule: the drafts that equal the
        target's argmax, in a leading run, then the target's own token) counted on the host, where
        the drafts already are: one argmax over the right-aligned logits [B, K+1, V] and one read,
        where the device rule took a dozen small launches, each a host cost the size of a
        small model's whole GPU step."""
        best = logits.argmax(-1).tolist()
        accepted_l, next_l = [], []
        for row, drafts in zip(best, drafted):
            row = row[K - len(drafts):]          # this row's len(drafts) + 1 logits, left-aligned
            a = 0
            while a < len(drafts) and drafts[a] == row[a]:
                a += 1
            accepted_l.append(a)
            next_l.append(row[a])
        if self.engine.observers:   # the shadow's p (shadow.py)
            B = len(drafted)
            first = torch.tensor([K - len(d) for d in drafted], device=self.device)
            self.first_logits = logits[torch.arange(B, device=self.device), first]
        return accepted_l, next_l

    def _verify_tree(self, drafts, num, siblings, q, sampling, committed, wants_features, copied):
        """One target pass over a chain with alternatives per row (rejection_sampler.verify_tree):
        the row's uncached tokens and chain are fed as usual, each depth's siblings after them as
        branches. A kept sibling's keys and values are then moved to where the chain would have
        put them. -> per row (accepted, next token, kept drafts, fed indices of the committed
        tokens), and the features of every fed token when the drafter wants them.

        A copied row (`copied[i]`) feeds its chain alone. Its siblings repeat its chain token
        under a point-mass q, so verify_tree never keeps one (greedy: the target's token there
        differs from the rejected chain token; sampled: the residual after that token is zero on
        it) and never reads their logits. Feeding them only widened the batch's one padded
        pass: a copy of 8 with one sibling a depth was 17 tokens, past the C layer's limit of
        the time (16; 64 now)."""
        B, S = self.active, siblings.shape[2]
        nums, sib_l, drafts_l = num.tolist(), siblings.tolist(), drafts.tolist()
        fed_siblings = [0 if copied and copied[i] else S for i in range(B)]
        feed, parents, pending = [], [], []
        caps = self._prefill_cap
        for i, seq in enumerate(self.rows):
            m, n = len(seq.tokens) - self.target.lengths[i], nums[i]
            if i in caps:        # its prompt's next chunk, a chain (it drafted nothing: n == 0)
                m = caps[i]
            tokens = seq.tokens[self.target.lengths[i]:self.target.lengths[i] + m] + drafts_l[i][:n]
            parent = [-1] * len(tokens)
            for j in range(n if fed_siblings[i] else 0):   # depth j's branch off the token before it
                tokens += sib_l[i][j]
                parent += [m - 1 + j] * S
            feed.append(tokens), parents.append(parent), pending.append(m)
        K = max(nums, default=0)
        tail = [1 + n * (f + 1) for n, f in zip(nums, fed_siblings)]   # last uncached, chain, siblings
        last = max(tail)
        out = self._on_device(self.target.extend, feed, last=last, hidden=wants_features,
                              parents=parents)
        logits, features = out if wants_features else (out, None)
        chain_at = torch.zeros(B, K + 1, dtype=torch.long)
        sibling_at = torch.zeros(B, max(K, 1), S, dtype=torch.long)
        for i, n in enumerate(nums):
            base = last - tail[i]
            chain_at[i] = base + torch.arange(K + 1).clamp(max=n)
            for j in range(n if fed_siblings[i] else 0):   # a copied row's stay 0: never read
                sibling_at[i, j] = base + 1 + n + j * S + torch.arange(S)
        V = logits.shape[-1]
        rows = torch.arange(B).view(B, 1)
        chain_logits = logits[rows, chain_at.to(self.device)]                    # [B, K+1, V]
        # A grammar row's chain (cut where the grammar refuses it, Batch.step) is masked at each
        # position after the drafts before it, each sibling's node after its depth's chain
        # prefix and itself: every token kept is what target-only constrained decoding picks.
        chains = [drafts_l[i][:n] for i, n in enumerate(nums)]
        chain_logits = self._mask_grammar(chain_logits, {i: 0 for i in range(B)}, chains)
        self.first_logits = chain_logits[:, 0]     # each row's next-token logits: the shadow's p
        sibling_logits = logits[rows.view(B, 1, 1), sibling_at.to(self.device)]  # [B, K, S, V]
        sibling_logits = self._mask_siblings(sibling_logits, chains, sib_l, fed_siblings)
        accepted, branches, nexts = verify_tree(
            chain_logits, sibling_logits.view(B, -1, S, V)[:, :K], drafts[:, :K], siblings[:, :K],
            num, sampling.temperature, sampling.top_k, sampling.top_p,
            None if q is None else q[:, :K], sampling.generators, sampling.keys)
        if self._wants_logprobs:
            for i, (a, b) in enumerate(zip(accepted, branches)):
                if self.rows[i].params.logprobs is not None:
                    # Depth j's token (chain or sibling) was scored at the chain's position j;
                    # the token after a kept sibling at that sibling.
                    after = sibling_logits[i, a - 1, b] if b >= 0 else chain_logits[i, a]
                    self._token_logits[i] = torch.cat([chain_logits[i, :a], after.unsqueeze(0)])
        kept, fed_kept, moves = [], [], []
        for i, (a, b) in enumerate(zip(accepted, branches)):
            m, n = pending[i], nums[i]
            fed = list(range(m + a))
            tokens = drafts_l[i][:a]
            if b >= 0:                  # the path ends in sibling b of depth a-1
                at = m + n + (a - 1) * S + b
                tokens = tokens[:a - 1] + [sib_l[i][a - 1][b]]
                fed[-1] = at
                start = committed[i] - m
                moves.append((i, start + at, committed[i] + a - 1))
            kept.append(tokens), fed_kept.append(fed)
        self.target.move(moves)
        return accepted, nexts, kept, fed_kept, features

    def _emit(self, seq: Sequence, new: list[int], logprobs: list | None = None) -> StepOutput:
        """Append tokens, apply stop rules, and return the text that is now final.

        Text that could still be the start of a stop string is held back until the next tokens
        settle it (as vLLM's detokenizer does), so streamed pieces always concatenate to the final
        text. A stop string ends the reply where it starts; the token ids end with the token that
        completed it, as if the tokens had been decoded one at a time, whatever this step emitted.
        Only the text after what was streamed is decoded (IncrementalDetokenizer): a step's work
        does not grow with the reply.
        """
        params = seq.params
        kept = []
        for tok in new:
            kept.append(tok)
            if tok in self.engine.eos_ids:
                seq.finish_reason = "stop"
                break
            if seq.num_generated + len(kept) >= params.max_new_tokens:
                seq.finish_reason = "length"
                break
        before = seq.num_generated
        seq.tokens.extend(kept)
        text = seq.detokenizer.unstreamed(seq.tokens, seq.num_generated)
        if params.stop:
            stopped = self._find_stop(seq, text, before)
            if stopped is not None:
                count, text = stopped
                del seq.tokens[len(seq.prompt_ids) + count:]
                kept = kept[:count - before]
                seq.finish_reason = "stop"
        seq.stats.num_emitted_tokens += len(kept)
        if seq.first_token_at is None and kept:
            seq.first_token_at = time.perf_counter()
        if seq.finish_reason is None:
            text = text.rstrip("\ufffd")   # half a UTF-8 character: hold it back until complete
            if params.stop:
                text = text[:len(text) - stop_prefix_length(text, params.stop)]
            seq.detokenizer.streamed(seq.tokens, seq.num_generated, len(text))
        if text:
            seq.pieces.append(text)
        if seq.finish_reason is not None:
            seq.finished = True
            seq.finished_at = time.perf_counter()
        return StepOutput(request_id=seq.request_id, token_ids=kept, text=text,
                          finished=seq.finished, finish_reason=seq.finish_reason,
                          logprobs=logprobs[:len(kept)] if logprobs is not None else None)

    def _find_stop(self, seq: Sequence, text: str, before: int) -> tuple[int, str] | None:
        """(tokens to keep, text up to the stop) when a stop string appeared in this step's tokens.

        `text` is what follows the streamed text after all of them. Nothing streamed can begin a
        stop string (it would have been held back), so the search looks only after it. Several
        tokens may have arrived at once: the first of them after which a stop string is complete
        ends the reply.
        """
        stops = seq.params.stop
        if not any(s in text for s in stops):
            return None
        generated = seq.num_generated
        for count in range(before + 1, generated + 1):
            prefix = text if count == generated else seq.detokenizer.unstreamed(seq.tokens, count)
            hits = [i for i in (prefix.find(s) for s in stops) if i >= 0]
            if hits:
                return count, prefix[:min(hits)]
        return None

    def _drop_finished(self) -> None:
        keep = [i for i, s in enumerate(self.rows) if not s.finished]
        if len(keep) == len(self.rows):
            return
        self.done.extend(s for s in self.rows if s.finished)
        self.rows = [self.rows[i] for i in keep]
        self._row_sampling = None
        self.target.select(keep)
        if self.drafter is not None:
            self.drafter.select(keep)

    def result(self, seq: Sequence) -> GenerationResult:
        end = seq.finished_at or time.perf_counter()
        return GenerationResult(
            request_id=seq.request_id, text=seq.emitted_text, token_ids=seq.generated,
            finish_reason=seq.finish_reason or "cancelled", prompt_tokens=len(seq.prompt_ids),
            stats=seq.stats, seconds=end - seq.started,
            time_to_first_token=(seq.first_token_at or end) - seq.started,
            cached_tokens=seq.cached_tokens)


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: GenerationParams
                   ) -> list[tuple[float, list[tuple[int, float]]]]:
    """Each token's log-probability and the top params.logprobs alternatives, from the logits
    [len(tokens), V] that scored it: the target's distribution after the request's processors
    (its grammar's mask, then its temperature; temperature 0 reads the logits as they are), before
    top-k and top-p cut its tail, so the alternatives stay visible. Row by row, so a token's
    figures do not depend on how many tokens its round committed."""
    out = []
    top = params.logprobs or 0
    for j, token in enumerate(tokens):
        row = logits[j].float()
        if params.temperature > 0:
            row = row / params.temperature
        logp = torch.log_softmax(row, -1)
        alternatives = []
        if top:
            values, ids = torch.topk(logp, top)
            alternatives = list(zip(ids.tolist(), values.tolist()))
        out.append((float(logp[token]), alternatives))
    return out


def encode_prompt(tok, prompt: str | list[dict], chat: bool = False) -> list[int]:
    """Prompt token ids as our engine decodes them (chat template when asked or given messages).
    One home: the engine, and the vLLM gate that sends vLLM the same ids (gate/vllm.py)."""
    if isinstance(prompt, list) or chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if not messages:
            raise SpecpairError("empty prompt: at least one chat message is needed")
        for m in messages:
            if m.get("role") not in ("system", "user", "assistant", "tool"):
                raise SpecpairError(f"unknown chat role {m.get('role')!r}")
        if not getattr(tok, "chat_template", None):
            raise SpecpairError("this tokenizer has no chat template; send plain text")
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = list(ids)
    else:
        if not prompt or not prompt.strip():
            raise SpecpairError("empty prompt")
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
    if not ids:
        raise SpecpairError("prompt encodes to no tokens")
    return ids
