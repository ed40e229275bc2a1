"""The vLLM gate's tokenizer check for an EAGLE-3 head, which carries no tokenizer of its own.

A head drafts the target's tokens: it embeds with the target's table and maps each of its draft
vocabulary's ids to a target id through `d2t` (eagle3.py). `specpair distill --method eagle3` and
PyPI's `speculators` write no tokenizer files beside it, so comparing two tokenizers (what the
gate does for a draft model) would refuse every such head with "cannot load tokenizer". What must
agree instead, read from the files without loading weights (and before any vLLM server starts,
which would fail minutes in):

- the head's vocabulary (its layer config's `vocab_size`, the embedding table it reads) is the
  target's (`config.json`'s `vocab_size`);
- every draft id maps to an id below it (`d2t`: draft id i is target id i + d2t[i]; without a
  map the draft vocabulary is the target's first `draft_vocab_size` ids);
- the hidden states the head reads are the target's width (`target_hidden_size`, else the layer's).

A head that does ship tokenizer files is compared as any draft is (gate.verdict.tokenizer_check).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def head_config(directory: str | Path) -> dict[str, Any] | None:
    """The config.json of an EAGLE-3 head in the speculators layout without tokenizer files (None:
    not such a head)."""
    path = Path(directory)
    if not (path / "config.json").is_file() or any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    raw = json.loads((path / "config.json").read_text())
    return raw if raw.get("speculators_model_type") == "eagle3" else None


def draft_to_target_ids(directory: str | Path, draft_vocab: int) -> list[int]:
    """Each draft id's target id, from the head's `d2t` (read alone from the safetensors file)."""
    from safetensors import safe_open

    offsets = None
    for weights in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(weights), framework="pt") as f:
            if "d2t" in f.keys():
                offsets = f.get_tensor("d2t").tolist()
                break
    if offsets is None:
        return list(range(draft_vocab))
    return [i + int(d) for i, d in enumerate(offsets)]


def vocabulary_differences(head: dict[str, Any], target: dict[str, Any], target_ids: list[int]) -> list[str]:
    """What keeps the head from drafting this target's tokens (empty: nothing). Pure."""
    layer = head.get("transformer_layer_config") or {}
    vocab, target_vocab = layer.get("vocab_size"), target.get("vocab_size")
    out = []
    if vocab != target_vocab:
        out.append(f"the head embeds a vocabulary of {vocab} ids, the target's has {target_vocab}")
    if target_ids and isinstance(target_vocab, int) and (max(target_ids) >= target_vocab or min(target_ids) < 0):
        out.append(f"the head's draft vocabulary maps to target ids {min(target_ids)}..{max(target_ids)}, outside "
                   f"the target's 0..{target_vocab - 1}")
    if len(set(target_ids)) != len(target_ids):
        out.append("the head's draft vocabulary maps two draft ids to one target id")
    width = head.get("target_hidden_size") or layer.get("hidden_size")
    if width != target.get("hidden_size"):
        out.append(f"the head reads hidden states {width} wide, the target's are {target.get('hidden_size')}")
    return out


def head_tokenizer_check(release: dict, progress=print) -> dict | None:
    """The tokenizer verdict (gate.verdict.tokenizer_check's shape) of a release drafting with an
    EAGLE-3 head that has no tokenizer files; None for any other draft (compared as usual)."""
    from specpair.models import resolve_source

    draft = release.get("draft") or {}
    if draft.get("drafter") or not draft.get("source"):
        return None
    head_dir = resolve_source(draft["source"], progress)
    head = head_config(head_dir) if Path(str(head_dir)).is_dir() else None
    if head is None:
        return None
    target_dir = Path(str(resolve_source((release.get("target") or {}).get("source") or "default", progress)))
    target = json.loads((target_dir / "config.json").read_text()) if (target_dir / "config.json").is_file() else {}
    draft_vocab = int(head.get("draft_vocab_size") or (head.get("transformer_layer_config") or {}).get("vocab_size")
                      or 0)
    target_ids = draft_to_target_ids(head_dir, draft_vocab)
    differences = vocabulary_differences(head, target, target_ids)
    note = (f"EAGLE-3 head: no tokenizer of its own (it drafts with the target's); its draft vocabulary of "
            f"{len(target_ids)} ids maps into the target's {target.get('vocab_size')}")
    from transformers import AutoTokenizer

    from specpair.tokenizer_identity import fingerprint
    target_fp = fingerprint(AutoTokenizer.from_pretrained(str(target_dir)))["sha256"]
    return {"compatible": not differences, "differences": differences, "notes": [note],
            "draftFingerprint": None, "targetFingerprint": target_fp}
