"""Served traffic as distillation data: `specpair distill --from-capture DIR --category C`.

A pair with `spec.learning` captures served requests per category (docs/learning.md): the
chat-formatted prompt's token ids and the target's own reply's token ids, nothing else. That is
what a drafter must predict when serving, already written by the target, so training from it
needs no reply generation: each captured request is one conversation, `prompt_ids + reply_ids`,
and a head takes the target's features of it from one target pass (distill.conversation_features).

The format is capture.py's (docs/learning.md), read by its `read_records`: complete shards of
`DIR/<category>/`, one record a line `{v, category, prompt_ids, reply_ids, release, tokenizer,
time}`; a line cut short by a kill is skipped and counted.

The release's golden prompts of the category are not trained on: the gate measures the new
release on them (identity, acceptance, speedup), and a drafter trained on its exam would pass it
for the wrong reason (self_distill.file_requests refuses them for the same reason). They are what
the run measures its drafter on, before and after training (`golden_prompts`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specpair.config import read_release_file
from specpair.contract import DEFAULT_CATEGORY
from specpair.errors import SpecpairError


def _ids(value: Any, what: str, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and t >= 0 for t in value):
        raise SpecpairError(f"{where}: {what} must be a list of token ids (non-negative integers)")
    return value


def captured_conversations(directory: str, category: str) -> list[dict]:
    """The captured requests of one category as conversations: `read_capture` without its count."""
    return read_capture(directory, category)[0]


def read_capture(directory: str, category: str) -> tuple[list[dict], int]:
    """The captured requests of one category as conversations ({"kind", "prompt", "ids",
    "features", "release", "time", "tokenizer"}: ids the prompt's then the reply's token ids,
    features None so a head computes them), oldest first, and the lines skipped (cut by a kill).
    Refused by name: no capture directory, no requests of the category (naming the categories
    captured there), a record whose token ids are not token ids."""
    from specpair.capture import ReadCounts, categories, read_records

    if not category or category in (".", "..") or "/" in category:
        raise SpecpairError(f"--category {category!r} is not a category name")
    if not Path(directory).is_dir():
        raise SpecpairError(f"--from-capture {directory}: no such directory")
    counts = ReadCounts()
    conversations: list[dict] = []
    for n, row in enumerate(read_records(directory, category, counts), 1):
        where = f"{directory}: record {n} of category {category!r}"
        prompt = _ids(row.get("prompt_ids"), "prompt_ids", where)
        reply = _ids(row.get("reply_ids"), "reply_ids", where)
        if not prompt or not reply:
            continue     # nothing to learn from: no prompt, or a reply of no tokens
        conversations.append({"kind": category, "prompt": "", "ids": prompt + reply, "features": None,
                              "release": str(row.get("release") or ""), "time": row.get("time"),
                              "tokenizer": str(row.get("tokenizer") or "")})
    if not conversations:
        raise SpecpairError(f"no captured requests of category {category!r} in {directory} "
                            f"(categories captured there: {', '.join(categories(directory)) or 'none'})")
    conversations.sort(key=lambda c: (c["time"] if isinstance(c["time"], (int, float)) else 0.0))
    return conversations, counts.skipped


def check_vocabulary(conversations: list[dict], vocab_size: int) -> list[dict]:
    """The conversations, refused when a token id is outside the target's vocabulary (traffic
    captured from another target)."""
    for c in conversations:
        if max(c["ids"]) >= vocab_size:
            raise SpecpairError(f"a captured request of category {c['kind']!r} (release {c['release'] or '?'}) "
                                f"holds token id {max(c['ids'])}, outside the target's vocabulary of "
                                f"{vocab_size}: captured from another target?")
    return conversations


def capture_lineage(directory: str, category: str, conversations: list[dict], skipped: int = 0) -> dict:
    """What the run trained on, for the summary and the new release's lineage: where, which
    category, how many requests and tokens (and lines skipped), captured under which releases
    and target tokenizers, and when."""
    times = [c["time"] for c in conversations if isinstance(c["time"], (int, float))]
    return {"directory": str(directory), "category": category, "requests": len(conversations),
            "tokens": sum(len(c["ids"]) for c in conversations), "skipped": skipped,
            "tokenizers": sorted({c.get("tokenizer") or "" for c in conversations} - {""}),
            "releases": sorted({c["release"] for c in conversations if c["release"]}),
            "first": min(times) if times else None, "last": max(times) if times else None}


def chat_lead(tok) -> list[int]:
    """The token ids the chat template puts before a user's message (those two different messages
    share, less what their plain encodings share: a BOS is no sign of chat); [] when the
    tokenizer has no template, or one that adds nothing to tell the two formats apart."""
    from specpair.decoding import encode_prompt

    def shared(a: list[int], b: list[int]) -> list[int]:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return a[:n]
    if not getattr(tok, "chat_template", None):
        return []
    try:
        lead = shared(encode_prompt(tok, "alpha", chat=True), encode_prompt(tok, "Zulu 7 omega", chat=True))
    except Exception:      # a template that needs more than one user message: formats not told apart
        return []
    plain = shared(encode_prompt(tok, "alpha"), encode_prompt(tok, "Zulu 7 omega"))
    return lead if len(lead) > len(plain) else []


def chat_share(tok, conversations: list[dict]) -> float | None:
    """The share of captured requests whose prompt came chat-formatted (it starts with the chat
    template's lead): how the category was served. The gate then scores the learned draft's
    golden prompts of the category in that format (training_runner.learned_release): a draft
    trained on plain completions met chat-formatted golden prompts it never saw and scored 0.000.
    None when the formats cannot be told apart (no template, or one adding nothing before)."""
    lead = chat_lead(tok)
    if not lead or not conversations:
        return None
    return round(sum(c["ids"][:len(lead)] == lead for c in conversations) / len(conversations), 4)


def golden_prompts(release_file: str | None, category: str) -> tuple[list[str], bool]:
    """The golden prompts of `category` in a release document (its gating.prompts; none named:
    the engine's built-in set) and whether the gate sends them chat-formatted (gating.chat), for
    measuring the drafter, never training it."""
    if release_file is None:
        return [], True
    from specpair.bench import load_prompts

    gating = read_release_file(release_file, "--golden-release").get("gating") or {}
    given = gating.get("prompts")
    rows = given if isinstance(given, list) and given else load_prompts(None)
    return ([str(r["prompt"]) for r in rows
             if isinstance(r, dict) and str(r.get("category") or DEFAULT_CATEGORY) == category and r.get("prompt")],
            bool(gating.get("chat", True)))
