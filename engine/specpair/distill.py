"""`specpair distill`: train a small draft on the target's own distributions.

A draft pays only if it is both far cheaper than the target and well aligned with it. Layer
truncation keeps the cost high and the alignment low, so we train a small student from scratch
(embeddings initialised from a random projection of the target's, which gives it the target's
token geometry for free) to minimise KL(target || student) over every position of real text:
code and docstrings of the Python standard library on this machine, plus instruction prompts
built from them in the target's chat format, and optionally continuations the target generated
itself (what a draft must predict at serving time).

Seeded and reproducible; checkpoints (model, optimiser, data position) let a killed run resume
exactly where it stopped. The output directory loads as a draft with `--draft DIR`.
"""

from __future__ import annotations

import json
import math
import random
import sysconfig
import time
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from specpair.errors import SpecpairError


METHODS = ("draft", "eagle", "medusa", "eagle3")
HEAD_METHODS = ("eagle", "medusa", "eagle3")


@dataclass
class DistillConfig:
    out: str
    target: str | None = None
    steps: int = 300
    batch_size: int = 4
    seq_len: int = 128
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    lr: float = 1e-3
    seed: int = 0
    checkpoint_every: int = 50
    device: str | None = None
    corpus: str = "stdlib"
    corpus_chars: int = 3_000_000
    generated_fraction: float = 0.0
    eval_prompts: int = 4
    eval_tokens: int = 32
    max_seconds: float | None = None   # stop early (and save) when training takes longer
    init: str = "projection"   # "projection": fresh student, projected embeddings;
                               # "truncate": the target's first `layers` layers (hidden = target's)
    method: str = "draft"      # "draft": a small causal LM; "eagle" / "medusa": heads over the
                               # target's features (heads.py; layers/hidden/heads/init do not apply)
    medusa_heads: int = 4      # medusa: how many heads (the most tokens a round drafts)
    draft_vocab: int = 8192    # heads: their vocabulary, the corpus's most frequent tokens
                               # (0: the target's whole vocabulary)
    replies: int = 0           # chat requests the target answers itself before training
                               # (self_distill.py); their conversations join the corpus
    reply_tokens: int = 160    # the longest reply generated
    requests: str | None = None   # JSON Lines of chat requests ({"prompt", "category"}, the bench's
                                  # format) the target answers instead of ones built from the
                                  # corpus: a platform's own traffic; `replies` > 0 takes the first N
    ttt_depth: int = 1         # eagle: draft steps unrolled in training (EAGLE-3's training-time
                               # test); 1 trains on the target's real features only
    from_capture: str | None = None   # a capture directory (docs/learning.md): train on the served
                                      # requests of `category` there instead of the corpus
    category: str | None = None       # with from_capture: the category whose requests train
    golden_release: str | None = None  # with from_capture: a release file whose golden prompts of
                                       # `category` measure the drafter (never train it)

    def __post_init__(self):
        if self.steps <= 0 or self.batch_size <= 0 or self.seq_len < 8:
            raise SpecpairError("steps and batch size must be > 0 and seq_len >= 8")
        if self.hidden % self.heads:
            raise SpecpairError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if not 0.0 <= self.generated_fraction <= 1.0:
            raise SpecpairError("generated_fraction must be in [0, 1]")
        if self.init not in ("projection", "truncate"):
            raise SpecpairError(f"init must be 'projection' or 'truncate', got {self.init!r}")
        if self.method not in METHODS:
            raise SpecpairError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.medusa_heads < 1:
            raise SpecpairError("medusa_heads must be >= 1")
        if self.draft_vocab < 0:
            raise SpecpairError("draft_vocab must be >= 0 (0: the whole vocabulary)")
        if self.generated_fraction and self.method != "draft":
            raise SpecpairError("generated_fraction applies to --method draft only (heads train "
                                "on features computed once, up front)")
        if self.replies < 0 or self.reply_tokens <= 0:
            raise SpecpairError("replies must be >= 0 and reply_tokens > 0")
        if self.ttt_depth < 1 or self.ttt_depth >= self.seq_len:
            raise SpecpairError(f"ttt_depth must be in [1, seq_len), got {self.ttt_depth}")
        if self.ttt_depth > 1 and self.method not in ("eagle", "eagle3"):
            raise SpecpairError("ttt_depth applies to --method eagle and eagle3 only")
        if bool(self.from_capture) != bool(self.category):
            raise SpecpairError("--from-capture and --category go together (the captured requests of "
                                "one category train the drafter)")
        if self.from_capture and (self.replies or self.requests):
            raise SpecpairError("--from-capture trains on the target's captured replies: --replies and "
                                "--requests do not apply")
        if self.golden_release and not self.from_capture:
            raise SpecpairError("--golden-release applies to --from-capture only")
        if self.requests:   # refused before the target loads, not after
            from specpair.self_distill import file_requests
            file_requests(self.requests, self.replies)


def corpus_texts(corpus: str, max_chars: int, seed: int) -> list[str]:
    """Real, varied text without a hub: stdlib sources and instruction prompts built from them."""
    if corpus == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.glob("*.py"))
    else:
        root = Path(corpus)
        if not root.exists():
            raise SpecpairError(f"corpus not found: {corpus}")
        files = sorted(root.rglob("*")) if root.is_dir() else [root]
        files = [f for f in files if f.is_file()]
    rng = random.Random(seed)
    rng.shuffle(files)
    texts, total = [], 0
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not texts:
        raise SpecpairError(f"corpus {corpus} holds no readable text")
    return texts


def instruction_prompts(texts: list[str], tokenizer, limit: int = 400) -> list[str]:
    """Chat-formatted requests about real code, so the student also sees the chat format."""
    import ast

    prompts = []
    asks = ["Explain what this Python function does:\n\n{}", "Write a docstring for:\n\n{}",
            "Summarise this code in one sentence:\n\n{}", "Find a bug in this function:\n\n{}"]
    for text in texts:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                src = ast.get_source_segment(text, node) or ""
                ask = asks[len(prompts) % len(asks)].format(src[:600])
                messages = [{"role": "user", "content": ask},
                            {"role": "assistant", "content": ast.get_docstring(node)[:400]}]
                if getattr(tokenizer, "chat_template", None):
                    prompts.append(tokenizer.apply_chat_template(messages, tokenize=False))
                else:
                    prompts.append(ask + "\n" + messages[1]["content"])
                if len(prompts) >= limit:
                    return prompts
    return prompts


def build_student(teacher, config: DistillConfig):
    """A small Llama sharing the teacher's vocabulary; embeddings projected from the teacher's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if config.init == "truncate":
        import copy
        student = copy.deepcopy(teacher.model).float().cpu()
        student.model.layers = student.model.layers[: config.layers]
        student.config.num_hidden_layers = config.layers
        if hasattr(student.config, "layer_types") and student.config.layer_types:
            student.config.layer_types = student.config.layer_types[: config.layers]
        return student

    vocab = teacher.model.get_input_embeddings().weight.shape[0]
    tcfg = teacher.model.config
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=config.hidden, intermediate_size=config.hidden * 3,
                      num_hidden_layers=config.layers, num_attention_heads=config.heads,
                      num_key_value_heads=config.heads,
                      max_position_embeddings=getattr(tcfg, "max_position_embeddings", 2048),
                      rope_theta=getattr(tcfg, "rope_theta", 10000.0), tie_word_embeddings=True,
                      bos_token_id=getattr(tcfg, "bos_token_id", None),
                      eos_token_id=getattr(tcfg, "eos_token_id", None),
                      pad_token_id=getattr(tcfg, "pad_token_id", None))
    torch.manual_seed(config.seed)
    student = LlamaForCausalLM(cfg)
    with torch.no_grad():
        t_emb = teacher.model.get_input_embeddings().weight.float().cpu()
        # Orthonormal columns when the student is narrower than the teacher, orthonormal rows
        # when it is wider (a tiny teacher: QR of a tall matrix only gives its narrow side).
        width = t_emb.shape[1]
        if width >= config.hidden:
            projection = torch.linalg.qr(torch.randn(width, config.hidden))[0]
        else:
            projection = torch.linalg.qr(torch.randn(config.hidden, width))[0].T
        emb = t_emb @ projection
        emb *= 0.02 / emb.std().clamp_min(1e-8)     # the scale a fresh embedding would have
        student.get_input_embeddings().weight.copy_(emb)
    if getattr(teacher.model, "generation_config", None) is not None:
        student.generation_config.eos_token_id = teacher.model.generation_config.eos_token_id
    return student


class TokenStream:
    """Seeded random windows over the tokenised corpus; its position is part of a checkpoint."""

    def __init__(self, ids: torch.Tensor, seq_len: int, seed: int):
        if ids.numel() <= seq_len + 1:
            raise SpecpairError(f"corpus too small: {ids.numel()} tokens for windows of {seq_len}")
        self.ids, self.seq_len = ids, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def starts(self, size: int) -> list[int]:
        return torch.randint(0, self.ids.numel() - self.seq_len, (size,),
                             generator=self.generator).tolist()

    def batch(self, size: int) -> torch.Tensor:
        return torch.stack([self.ids[s:s + self.seq_len] for s in self.starts(size)])


FEATURE_CHUNK = 512      # corpus tokens per target pass when features are computed up front
FEATURE_BATCH = 4        # such chunks per pass


@torch.no_grad()
def target_states(teacher, batch: torch.Tensor, layers: tuple[int, ...] | None) -> torch.Tensor:
    """One target pass over [B, L] ids: the normed last states [B, L, D], then with `layers`
    those layers' inputs, [B, L, (1 + len) * D]."""
    result = teacher.model.model(input_ids=batch.to(teacher.device),
                                 output_hidden_states=layers is not None)
    if layers is None:
        return result.last_hidden_state.float().cpu()
    # hidden_states[L]: layer L's input (the embeddings for 0), as vLLM numbers them.
    return torch.cat([result.last_hidden_state] + [result.hidden_states[L] for L in layers],
                     dim=-1).float().cpu()


@torch.no_grad()
def target_features(teacher, ids: torch.Tensor, progress=print,
                    layers: tuple[int, ...] | None = None) -> torch.Tensor:
    """The target's features (normed last hidden states, [n, D]) of a token stream, computed
    once in chunks of FEATURE_CHUNK tokens: a head trains on them for as many steps as it likes
    without a target pass per step (which cost most of a step: 1.0 s of 1.1 on this CPU). Each
    chunk sees only itself as context, as a training window used to. With `layers` (an EAGLE-3
    head's), each token's normed last state then those layers' inputs, [n, (1 + len) * D]."""
    chunks = list(ids.split(FEATURE_CHUNK))
    out, started = [], time.perf_counter()

    def states(batch: torch.Tensor) -> torch.Tensor:
        return target_states(teacher, batch, layers)

    for i in range(0, len(chunks), FEATURE_BATCH):
        group = chunks[i:i + FEATURE_BATCH]
        if len({c.numel() for c in group}) > 1:       # the short last chunk goes alone
            out.extend(states(c.view(1, -1))[0] for c in group)
        else:
            out.extend(states(torch.stack(group)))
        done = min(len(chunks), i + FEATURE_BATCH)
        if done % (FEATURE_BATCH * 25) == 0 or done == len(chunks):
            progress(f"features: {sum(c.numel() for c in chunks[:done])}/{ids.numel()} tokens "
                     f"({time.perf_counter() - started:.0f} s)")
    width = (1 + len(layers or ())) * teacher.model.config.hidden_size
    return torch.cat(out) if out else torch.zeros(0, width)


def conversation_features(teacher, conversation: dict, layers: tuple[int, ...] | None) -> torch.Tensor:
    """A conversation's features for every token but its last. An EAGLE/Medusa head reads the
    normed last states the target recorded while writing the reply; an EAGLE-3 head (`layers`)
    reads three layers' inputs besides, which serving never recorded: one target pass over the
    whole conversation gives them (whole, not in FEATURE_CHUNKs: the reply's context as served)."""
    recorded = conversation["features"]
    if recorded is not None and layers is None:
        return recorded
    ids = torch.tensor([conversation["ids"][:-1]], dtype=torch.long)
    return target_states(teacher, ids, layers)[0]


class FeatureStream(TokenStream):
    """TokenStream's windows (same generator, same starts) with the target's feature of every
    token: what a head trains on."""

    def __init__(self, ids: torch.Tensor, features: torch.Tensor, seq_len: int, seed: int):
        super().__init__(ids, seq_len, seed)
        if features.shape[0] != ids.numel():
            raise SpecpairError(f"{features.shape[0]} features for {ids.numel()} tokens")
        self.features = features

    def feature_batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.starts(size)
        return (torch.stack([self.ids[s:s + self.seq_len] for s in starts]),
                torch.stack([self.features[s:s + self.seq_len] for s in starts]))


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student) on the full vocabulary."""
    V = min(student_logits.shape[-1], teacher_logits.shape[-1])
    s = F.log_softmax(student_logits[..., :V].float(), dim=-1)
    t = F.log_softmax(teacher_logits[..., :V].float(), dim=-1)
    return F.kl_div(s.flatten(0, 1), t.flatten(0, 1), log_target=True, reduction="batchmean")


FEATURE_NOISE = 0.1   # EAGLE's robustness trick: train on slightly wrong features, as drafting
                      # feeds the head its own predictions (uniform, relative to the features' RMS)
CLASSIFICATION_WEIGHT = 1.0   # the token loss against the feature loss: EAGLE-1 used 0.1, EAGLE-3
                              # dropped the feature loss; here 1.0 measured a little ahead of 0.1
                              # (SmolLM2, 150 steps: 18.1% vs 16.7% teacher-forced top-1)


VOCAB_SAMPLE_WINDOWS = 32   # windows the target predicts over to choose the draft vocabulary


MEDUSA_DECAY = 0.8   # Medusa's weighting of head m's loss (0.8^m): later heads are weaker anyway


@torch.no_grad()
def build_head(teacher, train_ids: torch.Tensor, config: DistillConfig):
    """An EAGLE head or Medusa heads for this teacher. The vocabulary: the tokens most frequent
    in the corpus and in the target's own greedy predictions over it, weighed equally (what a
    head must draft is what the target would say)."""
    from specpair.heads import build_eagle_head, build_medusa_heads, draft_vocabulary

    rows = teacher.embedding_rows
    if config.draft_vocab == 0 or config.draft_vocab >= rows:
        vocab = torch.arange(rows)
    else:
        tok = teacher.tokenizer
        always = [i for i in {tok.eos_token_id, tok.bos_token_id} if i is not None and i < rows]
        windows = TokenStream(train_ids, config.seq_len, config.seed + 1).batch(VOCAB_SAMPLE_WINDOWS)
        predicted = torch.cat([teacher.model(input_ids=w.unsqueeze(0).to(teacher.device)).logits[0]
                               .argmax(-1).cpu() for w in windows])
        vocab = draft_vocabulary([train_ids, predicted], config.draft_vocab, always)
    if config.method == "medusa":
        return build_medusa_heads(teacher.model, vocab, config.medusa_heads, seed=config.seed)
    if config.method == "eagle3":
        from specpair.eagle3 import build_eagle3_head
        return build_eagle3_head(teacher.model, vocab, eagle3_layers(teacher), seed=config.seed)
    return build_eagle_head(teacher.model, vocab, seed=config.seed)


def eagle3_layers(teacher) -> tuple[int, ...]:
    """The layers an EAGLE-3 head trained here reads: vLLM's default (2, n/2, n-3) where those
    are three distinct layers, else the inputs of the last three (a target of under 6 layers).
    Both name layer inputs, never the last output (Hugging Face hands that over only normed)."""
    from specpair.eagle3 import default_aux_layers

    n = int(teacher.model.config.num_hidden_layers)
    chosen = default_aux_layers(n)
    if len(set(chosen)) < 3 or min(chosen) < 0:
        chosen = tuple(range(max(0, n - 3), n))
    if len(set(chosen)) < 3:
        raise SpecpairError(f"an EAGLE-3 head reads three layers; the target has {n}")
    return chosen


def eagle3_loss(head, embeds: torch.Tensor, features: torch.Tensor, depth: int = 1) -> torch.Tensor:
    """EAGLE-3's loss: pairs (embedding of x[j+1], the target's layers at j) and the head's
    drafts after them (depth > 1: `Eagle3Head.unroll`) against the target's distribution for the
    token each predicts, on the draft vocabulary (its LM-head rows applied to its normed last
    state), weighed TTT_DECAY^(d-1); no feature loss. features: [B, L, D + 3D] as
    target_features(layers=...) gives them."""
    D = head.config.hidden_size
    last, aux = features[..., :D], features[..., D:]
    scale = aux.pow(2).mean().sqrt()
    noisy = aux + (torch.rand_like(aux) * 2 - 1) * FEATURE_NOISE * scale
    with torch.no_grad():
        target_logits = head.lm_head(last[:, 1:])
    if depth == 1:
        steps = [head(embeds[:, 1:], noisy[:, :-1])]
    else:
        steps = head.unroll(embeds, noisy, depth)
    total = features.new_zeros(())
    for d, predicted in enumerate(steps, start=1):
        n = predicted.shape[1]
        total = total + TTT_DECAY ** (d - 1) * kl_loss(
            head.lm_head(head.norm(predicted)), target_logits[:, d - 1:d - 1 + n])
    return total


def medusa_loss(heads, features: torch.Tensor) -> torch.Tensor:
    """Head m, from feature f[j], learns the target's distribution for the token at j+m+2 (its
    LM-head rows applied to f[j+m+1]), weighed 0.8^m."""
    L = features.shape[1]
    total = features.new_zeros(())
    for m, block in enumerate(heads.blocks):
        if L - m - 1 < 1:
            break
        with torch.no_grad():
            target_logits = heads.lm_head(features[:, m + 1:])
        total = total + MEDUSA_DECAY ** m * kl_loss(heads.lm_head(block(features[:, :L - m - 1])),
                                                    target_logits)
    return total


TTT_DECAY = 0.8   # the weight of unrolled step d's loss: 0.8^(d-1), as EAGLE-3 weighs them


def eagle_loss(head, embeds: torch.Tensor, features: torch.Tensor, depth: int = 1) -> torch.Tensor:
    """Pairs (embedding of x[j+1], feature f[j]) predict f[j+1]: a feature loss (smooth L1) plus
    the KL between the target's and the head's distributions on the draft vocabulary (the
    target's, restricted: its LM-head rows applied to its own next feature). With depth > 1 the
    head also drafts on from its own predictions (`EagleHead.unroll`), and step d is scored
    against f[j+d]: what it meets when drafting the 2nd..depth-th token of a round."""
    inputs = features[:, :-1]
    scale = inputs.pow(2).mean().sqrt()
    noisy = inputs + (torch.rand_like(inputs) * 2 - 1) * FEATURE_NOISE * scale
    with torch.no_grad():
        target_logits = head.lm_head(features[:, 1:])
    if depth == 1:
        steps = [head(embeds[:, 1:], noisy)]
    else:
        steps = head.unroll(embeds, torch.cat([noisy, features[:, -1:]], dim=1), depth)
    total = features.new_zeros(())
    for d, predicted in enumerate(steps, start=1):
        n = predicted.shape[1]
        total = total + TTT_DECAY ** (d - 1) * (
            F.smooth_l1_loss(predicted, features[:, d:d + n])
            + CLASSIFICATION_WEIGHT * kl_loss(head.lm_head(predicted), target_logits[:, d - 1:d - 1 + n]))
    return total


def greedy_acceptance(teacher, student_model, prompts: list[str], max_new_tokens: int, chat: bool = False) -> float:
    """Acceptance of the student as a draft for the teacher (greedy, k=4) on held-out prompts."""
    from specpair.config import GenerationParams, SpeculationConfig
    from specpair.decoding import SpeculativeEngine
    from specpair.models import wrap_model

    student_model.eval()
    draft = wrap_model(student_model, teacher.tokenizer, source="student")
    engine = SpeculativeEngine(teacher, draft=draft, speculation=SpeculationConfig(
        k=4, dynamic_k=False, fallback_threshold=0.0), check_tokenizers=False)
    results = engine.generate(prompts, GenerationParams(max_new_tokens=max_new_tokens), chat=chat)
    drafted = sum(r.stats.num_draft_tokens for r in results)
    accepted = sum(r.stats.num_accepted_tokens for r in results)
    student_model.train()
    return accepted / drafted if drafted else 0.0


def _checkpoints(out: Path) -> list[Path]:
    return sorted((out / "checkpoints").glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))


def distill(config: DistillConfig, teacher=None, progress=print, stop_after: int | None = None) -> dict:
    """Train (or resume) and save the draft. stop_after simulates a killed run (tests)."""
    from tqdm import tqdm

    from specpair.models import load_model

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    captured = None
    if config.from_capture:   # read before the target loads: no data is said at once
        from specpair.distill_capture import read_capture
        captured = read_capture(config.from_capture, str(config.category))
    if teacher is None:
        teacher = load_model(config.target, device=config.device, dtype="float32", progress=progress)
    device = teacher.device
    tok = teacher.tokenizer
    is_head = config.method in HEAD_METHODS
    conversations, reply_seconds, capture, eval_chat = [], 0.0, None, False
    if config.from_capture:
        # Served traffic of one category, the target's replies already in it: no corpus.
        from specpair.distill_capture import capture_lineage, chat_share, check_vocabulary, golden_prompts

        conversations = check_vocabulary(captured[0] if captured else [], teacher.embedding_rows)
        capture = capture_lineage(config.from_capture, config.category, conversations,
                                  captured[1] if captured else 0)
        golden, eval_chat = golden_prompts(config.golden_release, config.category)
        # How the category was served (chat or plain completions): the learned release's gate
        # scores its golden prompts of the category so, and so are they measured here.
        capture["chat"] = chat_share(tok, conversations)
        if capture["chat"] is not None:
            eval_chat = capture["chat"] >= 0.5
        # A head is not measured here (greedy_acceptance drafts with a model); the gate measures it.
        texts, eval_docs, train_docs = [], [] if is_head else golden[:config.eval_prompts], []
        if sum(len(c["ids"]) for c in conversations) <= config.seq_len + 1:
            raise SpecpairError(f"the captured requests of category {config.category!r} hold "
                                f"{capture['tokens']} tokens: training windows need more than "
                                f"{config.seq_len + 1} (capture longer, or lower --seq-len)")
        progress(f"capture: {capture['requests']} requests, {capture['tokens']} tokens of category "
                 f"{config.category!r}; {len(eval_docs)} golden prompts measure the drafter")
    else:
        texts = corpus_texts(config.corpus, config.corpus_chars, config.seed)
        prompts = instruction_prompts(texts, tok)
        docs = texts + prompts
        eval_docs = docs[-config.eval_prompts:] if config.eval_prompts else []
        train_docs = docs[:-config.eval_prompts] if config.eval_prompts else docs
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    ids = []
    for doc in train_docs:
        ids.extend(tok(doc, add_special_tokens=False)["input_ids"] + [eos])
    if config.replies or config.requests:   # the target's own answers: what a drafter meets serving
        from specpair.self_distill import chat_replies, chat_requests, file_requests

        started = time.perf_counter()
        requests = (file_requests(config.requests, config.replies) if config.requests else
                    chat_requests(texts, tok, config.replies, config.seed))
        conversations = chat_replies(teacher, requests, out, config.reply_tokens, progress)
        reply_seconds = time.perf_counter() - started
    feature_seconds = 0.0
    if is_head:
        # Features once, up front: the corpus's by a target pass, the conversations' as the
        # target recorded them while writing them (their last token, never fed, is left out).
        started = time.perf_counter()
        layers = eagle3_layers(teacher) if config.method == "eagle3" else None
        # --from-capture has no corpus (ids empty): a target pass over no tokens fails to reshape.
        parts = [target_features(teacher, torch.tensor(ids, dtype=torch.long), progress, layers)] if ids else []
        for c in conversations:
            ids.extend(c["ids"][:-1])
            parts.append(conversation_features(teacher, c, layers))
        features = torch.cat(parts)
        feature_seconds = time.perf_counter() - started
        stream = FeatureStream(torch.tensor(ids, dtype=torch.long), features, config.seq_len,
                               config.seed)
    else:
        for c in conversations:
            ids.extend(c["ids"])
        stream = TokenStream(torch.tensor(ids, dtype=torch.long), config.seq_len, config.seed)
    ids = stream.ids
    progress(f"corpus: {ids.numel()} tokens")
    eval_prompts = (list(eval_docs) if capture else   # golden prompts whole, as the gate sends them
                    [tok.decode(tok(d, add_special_tokens=False)["input_ids"][:48]) for d in eval_docs])

    student = (build_head(teacher, ids, config) if is_head else build_student(teacher, config)).to(device)
    trainable = [p for p in student.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=0.01)

    def lr_at(step: int) -> float:     # linear warm-up then cosine decay
        warm = max(1, config.steps // 20)
        if step < warm:
            return config.lr * (step + 1) / warm
        return config.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, config.steps - warm)))

    start_step, history = 0, []
    checkpoints = _checkpoints(out)
    if checkpoints:
        state = torch.load(checkpoints[-1], map_location=device, weights_only=False)
        # A setting added since the checkpoint was made counts as its default.
        saved = {f.name: f.default for f in fields(DistillConfig) if f.default is not MISSING}
        if saved | state["config"] != asdict(config) | {"steps": state["config"]["steps"]}:
            raise SpecpairError(f"checkpoint {checkpoints[-1]} was made with other settings; "
                                "use a new --out directory")
        student.load_state_dict(state["model"])
        optimiser.load_state_dict(state["optimiser"])
        stream.generator.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
        start_step, history = state["step"], state["history"]
        progress(f"resuming from {checkpoints[-1].name}")
    acceptance_before = None
    if start_step == 0 and eval_prompts:
        acceptance_before = greedy_acceptance(teacher, student, eval_prompts, config.eval_tokens, eval_chat)
    elif history:
        acceptance_before = history[0].get("acceptance_before")

    student.train()
    teacher.model.eval()
    started = time.perf_counter()
    bar = tqdm(range(start_step, config.steps), initial=start_step, total=config.steps,
               desc="distill", unit="step")
    for step in bar:
        if stop_after is not None and step >= stop_after:
            bar.close()
            return {"stopped_at": step}
        if config.max_seconds and time.perf_counter() - started > config.max_seconds:
            progress(f"time budget of {config.max_seconds:.0f} s reached at step {step}")
            _save_checkpoint(out, step, student, optimiser, stream, history, config)
            break
        for group in optimiser.param_groups:
            group["lr"] = lr_at(step)
        if is_head:   # the target's features (what its LM head reads) and token embeddings
            batch, features = stream.feature_batch(config.batch_size)
            batch, features = batch.to(device), features.to(device)
            with torch.no_grad():
                embeds = teacher.model.get_input_embeddings()(batch)
        else:
            batch = stream.batch(config.batch_size)
            if config.generated_fraction and torch.rand(1, generator=stream.generator).item() < \
                    config.generated_fraction:
                batch = _teacher_continuations(teacher, batch, config.seq_len)
            batch = batch.to(device)
            with torch.no_grad():
                teacher_logits = teacher.model(input_ids=batch).logits
        if config.method == "eagle":
            loss = eagle_loss(student, embeds, features, config.ttt_depth)
        elif config.method == "eagle3":
            loss = eagle3_loss(student, embeds, features, config.ttt_depth)
        elif config.method == "medusa":
            loss = medusa_loss(student, features)
        else:
            loss = kl_loss(student(input_ids=batch).logits, teacher_logits)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimiser.step()
        history.append({"step": step + 1, "loss": round(loss.item(), 5)})
        if step == 0 and acceptance_before is not None:
            history[0]["acceptance_before"] = acceptance_before
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
            _save_checkpoint(out, step + 1, student, optimiser, stream, history, config)
    bar.close()

    acceptance_after = (greedy_acceptance(teacher, student, eval_prompts, config.eval_tokens, eval_chat)
                        if eval_prompts else None)
    student.eval()
    if config.method == "eagle3":     # the speculators layout: vLLM serves it as it is
        from specpair.eagle3 import save_eagle3_head
        save_eagle3_head(student, out, verifier=config.target or teacher.source or "default",
                         about={"steps": len(history), "seed": config.seed})
    elif is_head:
        from specpair.heads import save_head
        save_head(student, out, tok, {"target": config.target or teacher.source or "default",
                                      "steps": len(history), "seed": config.seed})
    else:
        student.save_pretrained(out)
        tok.save_pretrained(out)
    first = [h["loss"] for h in history[:10]]
    last = [h["loss"] for h in history[-10:]]
    summary = {"out": str(out), "method": config.method, "steps": len(history), "parameters": sum(p.numel() for p in student.parameters()),
               "loss_first10": round(sum(first) / len(first), 5) if first else None,
               "loss_last10": round(sum(last) / len(last), 5) if last else None,
               "acceptance_before": acceptance_before, "acceptance_after": acceptance_after,
               "seconds": round(time.perf_counter() - started, 2),
               "reply_seconds": round(reply_seconds, 2),
               "feature_seconds": round(feature_seconds, 2), "device": str(device),
               "capture": capture, "config": asdict(config)}
    (out / "distill_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


@torch.no_grad()
def _teacher_continuations(teacher, batch: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Half a window of real text, then what the teacher itself would write next (sampled)."""
    half = seq_len // 2
    out = teacher.model.generate(batch[:, :half].to(teacher.device), max_new_tokens=seq_len - half,
                                 min_new_tokens=seq_len - half, do_sample=True, temperature=0.8,
                                 attention_mask=torch.ones_like(batch[:, :half]).to(teacher.device),
                                 pad_token_id=teacher.tokenizer.pad_token_id or 0)
    return out[:, :seq_len].cpu()


def _save_checkpoint(out: Path, step: int, student, optimiser, stream, history, config) -> None:
    folder = out / "checkpoints"
    folder.mkdir(exist_ok=True)
    tmp = folder / f".step-{step}.pt.tmp"
    torch.save({"step": step, "model": student.state_dict(), "optimiser": optimiser.state_dict(),
                "data_rng": stream.generator.get_state(), "torch_rng": torch.get_rng_state(),
                "history": history, "config": asdict(config)}, tmp)
    tmp.replace(folder / f"step-{step}.pt")
    for old in _checkpoints(out)[:-2]:     # keep the last two: enough to resume, bounded disk
        old.unlink()
