"""Tokenizer fingerprints: identical tokenizers match; each kind of change is named."""

from __future__ import annotations

import json

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from specpair.tokenizer_identity import compare, fingerprint
from tiny_models import make_tokenizer


def _edited(tok, edit):
    spec = json.loads(tok.backend_tokenizer.to_str())
    edit(spec)
    new = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                  eos_token=tok.eos_token, bos_token=tok.bos_token,
                                  pad_token=tok.pad_token)
    new.chat_template = tok.chat_template
    return new


def test_identical_tokenizers_match():
    a, b = make_tokenizer(), make_tokenizer()
    fa, fb = fingerprint(a), fingerprint(b)
    assert fa["sha256"] == fb["sha256"]
    result = compare(fa, fb)
    assert result.compatible and not result.differences


def test_changed_vocab_entry_names_the_id():
    tok = make_tokenizer()

    def swap(spec):
        vocab = spec["model"]["vocab"]
        by_id = {i: t for t, i in vocab.items()}
        a, b = by_id[300], by_id[301]
        vocab[a], vocab[b] = 301, 300
    result = compare(fingerprint(_edited(tok, swap)), fingerprint(tok))
    assert not result.compatible
    assert any(d.startswith("2 ids differ, first: id 300") for d in result.differences), result.differences


def test_changed_merge_special_token_and_template():
    tok = make_tokenizer()

    def drop_merge(spec):
        spec["model"]["merges"] = spec["model"]["merges"][:-1]
    assert any("merge" in d for d in compare(fingerprint(_edited(tok, drop_merge)),
                                             fingerprint(tok)).differences)

    other_special = make_tokenizer()
    other_special.eos_token = "<|endoftext|>"
    diffs = compare(fingerprint(other_special), fingerprint(tok)).differences
    assert any("special tokens differ" in d and "eos_token" in d for d in diffs), diffs

    other_template = make_tokenizer(chat_template="{{ messages[0]['content'] }}")
    diffs = compare(fingerprint(other_template), fingerprint(tok)).differences
    assert diffs == ["chat templates differ: chat prompts would be encoded differently"]


def test_different_vocab_size_and_padding_rows():
    small, big = make_tokenizer(vocab_size=350), make_tokenizer()
    result = compare(fingerprint(small), fingerprint(big))
    assert not result.compatible
    assert any("vocabulary sizes differ: draft 350 vs target 400" in d for d in result.differences)
    padded = compare(fingerprint(big, embedding_rows=448), fingerprint(big, embedding_rows=400))
    assert padded.compatible
    assert padded.notes == ["draft embedding has 448 rows for a 400-token vocabulary: padding, compatible"]


def test_fingerprint_module_is_torch_free():
    import subprocess
    import sys
    code = ("import sys, specpair.tokenizer_identity, specpair.config, specpair.stats; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_head_without_a_tokenizer_is_held_to_the_targets_vocabulary_size():
    """A published EAGLE-3 head carries no tokenizer: it drafts the target's ids, so the check
    holds the vocabulary it was built for against the target's (size or padded embedding rows)."""
    target = fingerprint(make_tokenizer(), embedding_rows=416)
    size = target["vocab_size"]
    for rows in (size, 416):
        result = compare(fingerprint(None, embedding_rows=rows), target)
        assert result.compatible and "no tokenizer" in result.notes[0]
    result = compare(fingerprint(None, embedding_rows=size + 1), target)
    assert not result.compatible
    assert result.differences == [f"the head was built for a {size + 1}-token vocabulary; the "
                                  f"target's has {size} or 416 (vocabulary size, embedding rows)"]
