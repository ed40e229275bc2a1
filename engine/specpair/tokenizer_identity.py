"""Tokenizer identity: a stable fingerprint and a comparison a person can act on.

Speculation is only exact if draft and target map the same ids to the same text. Checking the
vocabulary size (as vLLM does) misses swapped ids, a different chat template or a changed merge
list, so the fingerprint covers each part separately and all of them together. Torch-free: the
operator compares fingerprints it reads from the registry and from engine pods.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

PARTS = ("vocab", "merges", "special_tokens", "added_tokens", "normalizer", "pre_tokenizer",
         "decoder", "chat_template")


def _digest(value) -> str:
    blob = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def tokenizer_parts(tokenizer) -> dict:
    """The parts of a tokenizer that decide which text an id stands for, as plain JSON values."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    model = spec.get("model") or {}
    vocab = dict(tokenizer.get_vocab())
    merges = model.get("merges") or []
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    special = {name: str(value) for name, value in sorted(
        (getattr(tokenizer, "special_tokens_map", None) or {}).items())}
    added = sorted(
        [[int(i), str(t.content if hasattr(t, "content") else t)]
         for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()])
    return {
        "vocab": vocab,
        "merges": merges,
        "special_tokens": special,
        "added_tokens": added,
        "normalizer": spec.get("normalizer"),
        "pre_tokenizer": spec.get("pre_tokenizer"),
        "decoder": spec.get("decoder"),
        "chat_template": getattr(tokenizer, "chat_template", None) or "",
    }


def fingerprint(tokenizer, *, embedding_rows: int | None = None, keep_vocab: bool = True) -> dict:
    """Hashes of each part and of the whole. keep_vocab keeps the id table for precise diffs.
    No tokenizer (None): a drafting head published without one (an EAGLE-3 head), which embeds
    with its target's table and drafts its ids: `embedding_rows` is the vocabulary it was
    built for, which `compare` holds against the target's."""
    if tokenizer is None:
        return {"sha256": "", "head": True, "parts": {}, "vocab_size": None,
                "embedding_rows": embedding_rows, "special_tokens": {}}
    parts = tokenizer_parts(tokenizer)
    hashes = {name: _digest(parts[name]) for name in PARTS}
    result = {
        "sha256": _digest(hashes),
        "parts": hashes,
        "vocab_size": len(parts["vocab"]),
        "embedding_rows": embedding_rows,
        "special_tokens": parts["special_tokens"],
    }
    if keep_vocab:
        result["vocab"] = parts["vocab"]
    return result


def short(fp: dict | None) -> str:
    return (fp or {}).get("sha256", "")[:12]


@dataclass
class Comparison:
    compatible: bool
    differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"compatible": self.compatible, "differences": self.differences, "notes": self.notes}


def _vocab_difference(draft_vocab: dict, target_vocab: dict) -> str | None:
    draft_by_id = {i: t for t, i in draft_vocab.items()}
    target_by_id = {i: t for t, i in target_vocab.items()}
    ids = sorted(set(draft_by_id) | set(target_by_id))
    differing = [i for i in ids if draft_by_id.get(i) != target_by_id.get(i)]
    if not differing:
        return None
    first = differing[0]
    return (f"{len(differing)} ids differ, first: id {first} "
            f"{draft_by_id.get(first, '<missing>')!r} vs {target_by_id.get(first, '<missing>')!r}")


def compare(draft: dict, target: dict) -> Comparison:
    """Compare two fingerprints (draft first). Differences make speculation unsafe; notes do not."""
    differences: list[str] = []
    notes: list[str] = []
    if draft.get("head"):
        return _compare_head(draft, target)
    if draft.get("sha256") != target.get("sha256"):
        dparts, tparts = draft.get("parts", {}), target.get("parts", {})
        if dparts.get("vocab") != tparts.get("vocab"):
            detail = None
            if "vocab" in draft and "vocab" in target:
                detail = _vocab_difference(draft["vocab"], target["vocab"])
            if draft.get("vocab_size") != target.get("vocab_size"):
                differences.append(f"vocabulary sizes differ: draft {draft.get('vocab_size')} "
                                   f"vs target {target.get('vocab_size')}")
            differences.append(detail or "vocabularies differ (token -> id tables)")
        if dparts.get("merges") != tparts.get("merges"):
            differences.append("BPE merge lists differ: the same text splits into different tokens")
        if dparts.get("special_tokens") != tparts.get("special_tokens"):
            changed = sorted(
                k for k in set(draft.get("special_tokens", {})) | set(target.get("special_tokens", {}))
                if draft.get("special_tokens", {}).get(k) != target.get("special_tokens", {}).get(k))
            what = ", ".join(
                f"{k}: {draft.get('special_tokens', {}).get(k)!r} vs "
                f"{target.get('special_tokens', {}).get(k)!r}" for k in changed) or "values"
            differences.append(f"special tokens differ ({what})")
        if dparts.get("added_tokens") != tparts.get("added_tokens"):
            differences.append("added tokens differ")
        for part, words in (("normalizer", "normalizers"), ("pre_tokenizer", "pre-tokenizers"),
                            ("decoder", "decoders")):
            if dparts.get(part) != tparts.get(part):
                differences.append(f"{words} differ")
        if dparts.get("chat_template") != tparts.get("chat_template"):
            differences.append("chat templates differ: chat prompts would be encoded differently")
        if not differences:
            differences.append("tokenizer fingerprints differ")
    for who, fp in (("draft", draft), ("target", target)):
        rows, size = fp.get("embedding_rows"), fp.get("vocab_size")
        if rows is not None and size is not None:
            if rows > size:
                notes.append(f"{who} embedding has {rows} rows for a {size}-token vocabulary: "
                             "padding, compatible")
            elif rows < size:
                differences.append(f"{who} embedding has {rows} rows but the vocabulary has "
                                   f"{size} tokens: some ids have no embedding")
    return Comparison(compatible=not differences, differences=differences, notes=notes)


def _compare_head(head: dict, target: dict) -> Comparison:
    """A head without a tokenizer drafts the target's ids: compatible when it was built for the
    target's vocabulary (its size, or the target's embedding rows where those are padded)."""
    rows = head.get("embedding_rows")
    sizes = {target.get("vocab_size"), target.get("embedding_rows")} - {None}
    if rows not in sizes:
        return Comparison(False, [f"the head was built for a {rows}-token vocabulary; the "
                                  f"target's has {' or '.join(str(s) for s in sorted(sizes))} "
                                  "(vocabulary size, embedding rows)"])
    return Comparison(True, [], ["the head carries no tokenizer: it embeds with the target's "
                                 "table and drafts target ids through its draft vocabulary"])
