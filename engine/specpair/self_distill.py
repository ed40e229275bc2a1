"""The target's own chat replies as training data for drafting heads (self-distillation).

A head must predict what the target says when serving: chat replies to users' requests. Source
code and docstrings teach it the target's view of code, but not the target's own answers, so a
head trained on them alone agreed with the target on 52.6% of held-out stdlib tokens and on only
21% of the first draft positions of the bench's chat replies. Here the target answers requests
itself, greedily (what greedy serving verifies), and the head trains on those conversations.

The requests are built offline from what every machine has: functions, docstrings and prose of
the Python standard library (code, summarisation, extraction), and the target's own vocabulary
for open topics (questions, explanations, short creative pieces). They are ours, not the bench's
prompts; the bench's golden prompts are never used for training.

`--requests FILE` (`file_requests`) takes the requests from a file instead, in the bench's prompt
format: a platform's own traffic, which a head should learn to answer like the target. The
shipped golden prompts are refused there too; a release's own golden prompts should be kept out
of that file as well, or the gate measures the head on its training data.

Replies are written to `replies.jsonl` in the output directory as they finish, so a killed run
resumes without generating them again.
"""

from __future__ import annotations

import ast
import json
import random
import time
from pathlib import Path

import torch

from specpair.drafters import NgramDrafter
from specpair.errors import SpecpairError

CODE_ASKS = ["Write a Python function `{name}({args})` that {summary}",
             "Explain what this Python function does:\n\n{src}",
             "Write a short Python example that uses a function which {summary}",
             "Rewrite this function to be easier to read:\n\n{src}"]
PROSE_ASKS = {"summarisation": ["Summarise this text in one sentence:\n\n{text}",
                                "Give a two-sentence summary of the following.\n\n{text}"],
              "extraction": ["List the technical terms in this text, one per line.\n\n{text}",
                             "Extract every name written in backquotes or quotes from this text "
                             "as a list.\n\n{text}"]}
TOPIC_ASKS = {"qa": ["What is {w}?", "Explain {w} to a ten-year-old.",
                     "How does {w} work, in a few sentences?", "What are three facts about {w}?",
                     "Why does {w} matter?"],
              "creative": ["Write four lines of verse about {w}.",
                           "Write a very short story in which {w} plays a part.",
                           "Describe {w} as if you saw it for the first time."]}
# Shares of the requests by kind: code and questions first, as serving sees most of them.
KIND_SHARES = {"code": 0.35, "qa": 0.3, "summarisation": 0.12, "extraction": 0.08, "creative": 0.15}

GENERATION_BATCH = 16    # rows decoded together: the engine's continuous batch amortises weights


def _documented(texts: list[str]):
    """(source text, node, docstring) for every module, class and function with a docstring."""
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    yield text, node, doc


def _functions(texts: list[str]) -> list[dict]:
    """Public functions small enough to quote, with a one-sentence summary from their docstring."""
    found = []
    for text, node, doc in _documented(texts):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        src = ast.get_source_segment(text, node) or ""
        first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
        if not 80 <= len(src) <= 900 or not 15 <= len(first) <= 200:
            continue
        summary = first[0].lower() + first[1:]
        args = ", ".join(a.arg for a in node.args.args if a.arg != "self")
        found.append({"name": node.name, "args": args, "summary": summary.rstrip(".") + ".",
                      "src": src})
    return found


def _paragraphs(texts: list[str]) -> list[str]:
    """Prose paragraphs of docstrings: several sentences, little code."""
    found = []
    for _, _, doc in _documented(texts):
        for para in doc.split("\n\n"):
            para = " ".join(para.split())
            if 200 <= len(para) <= 900 and para.count(". ") >= 2 and ">>>" not in para:
                found.append(para)
    return found


def _topic_words(tokenizer) -> list[str]:
    """Whole lowercase English words of the target's vocabulary (its BPE merges learned them
    from text, so they are common words): open topics for questions and creative requests."""
    words = set()
    for piece in tokenizer.get_vocab():
        if piece.startswith("Ġ"):
            word = piece[1:]
            if word.isalpha() and word.islower() and word.isascii() and 5 <= len(word) <= 12:
                words.add(word)
    return sorted(words)


def chat_requests(texts: list[str], tokenizer, count: int, seed: int) -> list[dict]:
    """`count` requests ({"kind", "prompt"}), seeded, in KIND_SHARES proportions."""
    rng = random.Random(seed)
    functions, paragraphs, words = _functions(texts), _paragraphs(texts), _topic_words(tokenizer)
    if not functions or not paragraphs:
        raise SpecpairError("the corpus holds too little Python with docstrings to build chat "
                            "requests from (use --corpus stdlib or a folder of Python sources)")
    if not words:
        raise SpecpairError("the tokenizer's vocabulary has no whole English words to ask about")
    # Whole counts per kind summing to `count`: floors, then the largest remainders.
    quota = {kind: int(count * share) for kind, share in KIND_SHARES.items()}
    by_remainder = sorted(KIND_SHARES, key=lambda k: count * KIND_SHARES[k] - quota[k], reverse=True)
    for kind in by_remainder[:count - sum(quota.values())]:
        quota[kind] += 1
    requests = []
    for kind in KIND_SHARES:
        for _ in range(quota[kind]):
            if kind == "code":
                ask = rng.choice(CODE_ASKS).format(**rng.choice(functions))
            elif kind in PROSE_ASKS:
                ask = rng.choice(PROSE_ASKS[kind]).format(text=rng.choice(paragraphs))
            else:
                ask = rng.choice(TOPIC_ASKS[kind]).format(w=rng.choice(words))
            requests.append({"kind": kind, "prompt": ask})
    rng.shuffle(requests)
    return requests


def file_requests(path: str, count: int = 0) -> list[dict]:
    """Requests ({"kind", "prompt"}) from a JSON Lines file in the bench's prompt format (kind: its
    category), in file order, each prompt once; the first `count` (0: all). The shipped golden
    prompts are refused: the bench and the default gate measure a head on them."""
    from specpair.bench import load_prompts

    rows, seen = [], set()
    for row in load_prompts(path):
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append({"kind": row["category"], "prompt": row["prompt"]})
    golden = {row["prompt"] for row in load_prompts(None)}
    leaked = [r["prompt"] for r in rows if r["prompt"] in golden]
    if leaked:
        raise SpecpairError(f"{path} holds {len(leaked)} of the shipped golden prompts (first: "
                            f"{leaked[0][:60]!r}); a head trained on them would be measured on its "
                            f"own training data by the bench and the default gate")
    if count > len(rows):
        raise SpecpairError(f"--replies {count}: {path} holds {len(rows)} distinct requests")
    return rows[:count] if count else rows


class FeatureRecorder(NgramDrafter):
    """Prompt lookup that also keeps the target's features of every token it commits, per row in
    the order rows were added. A head trains on exactly these vectors (what the target's LM head
    read while it wrote the reply), so training needs no second target pass over the
    conversations: on this CPU that pass would cost about as much as generating them."""

    wants_features = True

    def __init__(self):
        super().__init__()
        self.recorded: list[list[torch.Tensor]] = []   # every row added since for_batch
        self._live: list[int] = []                      # index into `recorded` of each live row
        self._count: list[int] = []                     # positions recorded per added row

    def for_batch(self) -> "FeatureRecorder":
        self.recorded, self._live, self._count = [], [], []
        return self

    def add_rows(self, count: int) -> None:
        for _ in range(count):
            self._live.append(len(self.recorded))
            self.recorded.append([])
            self._count.append(0)

    def select(self, rows: list[int]) -> None:
        self._live = [self._live[i] for i in rows]

    def observe(self, row: int, start: int, features: torch.Tensor) -> None:
        index = self._live[row]
        if start != self._count[index]:
            raise SpecpairError(f"row {row}: features from position {start}, expected "
                                f"{self._count[index]}")
        self.recorded[index].append(features.detach().to("cpu", torch.float32))
        self._count[index] += int(features.shape[0])

    def features(self) -> list[torch.Tensor]:
        """[n_i, D] per added row: the features of its prompt and of all generated tokens but
        the last (which was never fed back)."""
        return [torch.cat(parts) for parts in self.recorded]


def _own_features(features: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """A conversation's features: one per token but the last. A round can accept drafts past the
    end-of-turn token; the reply stops there, and so do its features."""
    if features.shape[0] < len(ids) - 1:
        raise SpecpairError(f"recorded {features.shape[0]} features for a conversation of "
                            f"{len(ids)} tokens")
    return features[:len(ids) - 1]


def _load_features(folder: Path, count: int) -> list[torch.Tensor | None]:
    """Features saved by earlier runs for the first `count` replies (None where there are none:
    replies of a run from before features were kept, or cut by a kill)."""
    found: list[torch.Tensor | None] = [None] * count
    for path in sorted(folder.glob("*.pt")) if folder.exists() else []:
        first = int(path.stem)
        for j, tensor in enumerate(torch.load(path, weights_only=True)):
            if first + j < count:
                found[first + j] = tensor
    return found


def chat_replies(teacher, requests: list[dict], out: Path, max_new_tokens: int,
                 progress=print) -> list[dict]:
    """The conversations, as {"kind", "prompt", "ids", "features"}: ids are the chat-formatted
    request then the target's greedy reply; features [len(ids) - 1, D] are the target's for every
    token but the last, recorded as it wrote them. Generated with our engine (n-gram drafting:
    greedy output identical to target-only) in batches of requests of similar length, since a
    batch's prefill pads every prompt to its longest; so they come back in that order, not in
    `requests`'. Finished replies are kept in out/replies.jsonl and their features in
    out/checkpoints/reply-features/; a rerun generates only the rest."""
    from specpair.kv.families import supports
    from specpair.kv.runner import StaticLlama

    # The recorder keeps the normed last states, which the target hands over unless an EAGLE-3
    # drafter on this model asked for its layers instead (StaticLlama.feature_layers, set per
    # model): cleared while the replies are written, put back after.
    runner = None if supports(teacher.model) else StaticLlama.of(teacher.model)
    handed = runner.feature_layers if runner is not None else None
    if runner is not None:
        runner.feature_layers = None
    try:
        return _chat_replies(teacher, requests, out, max_new_tokens, progress)
    finally:
        if runner is not None:
            runner.feature_layers = handed


def _chat_replies(teacher, requests, out: Path, max_new_tokens: int, progress) -> list[dict]:
    from specpair.config import GenerationParams, SpeculationConfig
    from specpair.decoding import SpeculativeEngine

    path = out / "replies.jsonl"
    feature_dir = out / "checkpoints" / "reply-features"
    recorder = FeatureRecorder()
    engine = SpeculativeEngine(teacher, drafter=recorder,
                               speculation=SpeculationConfig(k=4), check_tokenizers=False)
    prompts = {r["prompt"]: engine.encode(r["prompt"], chat=True) for r in requests}
    requests = sorted(requests, key=lambda r: len(prompts[r["prompt"]]))   # stable: seeded order
    done = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                done.append(json.loads(line))
            except json.JSONDecodeError:     # a line cut by a kill: generated again below
                break
        if [d["prompt"] for d in done] != [r["prompt"] for r in requests[:len(done)]]:
            raise SpecpairError(f"{path} holds replies to other requests; use a new --out")
    for d, features in zip(done, _load_features(feature_dir, len(done))):
        d["features"] = None if features is None else _own_features(features, d["ids"])
    feature_dir.mkdir(parents=True, exist_ok=True)
    params = GenerationParams(max_new_tokens=max_new_tokens)
    started, tokens = time.perf_counter(), 0
    with path.open("w") as f:
        for d in done:
            f.write(json.dumps({k: v for k, v in d.items() if k != "features"}) + "\n")
        for i in range(len(done), len(requests), GENERATION_BATCH):
            chunk = requests[i:i + GENERATION_BATCH]
            results = engine.generate([r["prompt"] for r in chunk], params, chat=True)
            records, features = [], []
            for r, res, feats in zip(chunk, results, recorder.features()):
                # the reply's ids end with the target's end-of-turn token when it finished
                records.append({**r, "ids": prompts[r["prompt"]] + res.token_ids})
                features.append(_own_features(feats, records[-1]["ids"]))
                tokens += len(res.token_ids)
            # Features first, then the lines: a line on disk always has its features.
            tmp = feature_dir / f".{i:06d}.pt.tmp"
            torch.save(features, tmp)
            tmp.replace(feature_dir / f"{i:06d}.pt")
            for record, feats in zip(records, features):
                f.write(json.dumps(record) + "\n")
                done.append({**record, "features": feats})
            f.flush()
            elapsed = time.perf_counter() - started
            progress(f"replies: {len(done)}/{len(requests)} ({tokens / max(elapsed, 1e-9):.0f} "
                     f"tokens/s)")
    return done
