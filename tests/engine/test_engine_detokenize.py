"""Streamed text is decoded incrementally and is exactly what decoding the whole reply gave.

The reference is the engine's earlier rule, written out here: after every step decode the whole
reply, hold back a trailing half character ("\ufffd") and any start of a stop string, stream what
is new. The engine now decodes only a window of tokens a step (IncrementalDetokenizer); each
step's piece, token ids and finish reason must equal the reference's, over long replies of
multi-byte characters, byte-level and byte-fallback tokens, special tokens mid-reply and random
token soup, for three tokenizers: the tiny byte-level BPE, a tiny SentencePiece-style one with byte
fallback (the decoder strips the text's first space), and the real SmolLM2 tokenizer.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import PreTrainedTokenizerFast

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine, stop_prefix_length
from specpair.detokenize import CHARACTER_TAIL

from tiny_models import corpus_text, make_model, perturbed_copy

TEXT = ("Grüße aus Köln — naïve café, “quotes” and ∑∫∂ maths; 日本語のテキスト, 世界 🦊🐍🎉 "
        "emoji ZWJ 👩‍💻, Ελληνικά, русский, עברית, हिन्दी. def f(x):\n    return x ** 2\n")
MAX_STEP = 9           # tokens a step in these tests


def sentencepiece_tokenizer():
    """A Llama-2-style tokenizer: '▁' for spaces, bytes as <0xNN> tokens where a character is not
    in the vocabulary, and a decoder that strips the text's first space."""
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"])
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base.train_from_iterator([t.encode("ascii", "ignore").decode() for t in corpus_text()], trainer=trainer)
    vocab = base.get_vocab()
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in __import__("json").loads(base.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = base.normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>", unk_token="<unk>")


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from specpair.models import smollm2_gguf_path
    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module", params=["tiny-bytelevel", "tiny-sentencepiece", "smollm2"])
def engine(request, tiny_tokenizer):
    tok = {"tiny-bytelevel": lambda: tiny_tokenizer, "tiny-sentencepiece": sentencepiece_tokenizer,
           "smollm2": smollm2_tokenizer}[request.param]()
    # The model only gives the engine a vocabulary; the tests feed the tokens themselves.
    loaded = make_model(tok, seed=0, layers=1, hidden=16, heads=2)
    loaded.model.config.max_position_embeddings = 2048     # room for the long replies
    return SpeculativeEngine(loaded, speculation=SpeculationConfig(enabled=False))


def replies(engine, rng: random.Random) -> list[list[int]]:
    """Long replies: real text (multi-byte characters split into byte tokens), the same with
    special tokens strewn in, and random tokens (bytes that never complete a character)."""
    tok = engine.target.tokenizer
    text = tok.encode(TEXT * 6, add_special_tokens=False)[:600]
    specials = [i for i in tok.all_special_ids if i not in engine.eos_ids]
    strewn = list(text)
    for at in sorted(rng.sample(range(len(strewn)), 12), reverse=True):
        strewn.insert(at, rng.choice(specials))
    soup = [rng.randrange(len(tok)) for _ in range(400)]
    soup = [t for t in soup if t not in engine.eos_ids]
    assert len(text) > 300
    return [text, strewn, soup]


def byte_run(engine, reply: list[int]) -> int:
    """The longest run of byte-fallback tokens (<0xNN>) in the reply: a byte-fallback decoder
    shows such a run as "\ufffd"s until it ends on a whole character, so it settles whole."""
    longest = run = 0
    for name in engine.target.tokenizer.convert_ids_to_tokens(reply):
        run = run + 1 if name.startswith("<0x") and name.endswith(">") else 0
        longest = max(longest, run)
    return longest


def whole_text_stream(engine, prompt_len: int, reply: list[int], sizes: list[int],
                      max_new: int, stops: tuple[str, ...]) -> list[tuple]:
    """The earlier rule: decode the whole reply every step. -> (token ids, piece, finish reason)
    per step."""
    tok, eos = engine.target.tokenizer, engine.eos_ids

    def text(g):
        if g and g[-1] in eos:
            g = g[:-1]
        return tok.decode(g, skip_special_tokens=True)

    generated, emitted, steps = [], "", []
    for size in sizes:
        kept, reason = [], None
        for t in reply[len(generated):len(generated) + size]:
            kept.append(t)
            if t in eos:
                reason = "stop"
                break
            if len(generated) + len(kept) >= max_new:
                reason = "length"
                break
        before = len(generated)
        generated += kept
        full = text(generated)
        if stops:
            start = len(emitted) if full.startswith(emitted) else 0
            if any(s in full[start:] for s in stops):
                for count in range(before + 1, len(generated) + 1):
                    prefix = text(generated[:count])
                    hits = [i for i in (prefix.find(s, start) for s in stops) if i >= 0]
                    if hits:
                        del generated[count:]
                        kept, full, reason = kept[:count - before], prefix[:min(hits)], "stop"
                        break
        if reason is None:
            full = full.rstrip("\ufffd")
            if stops:
                full = full[:len(full) - stop_prefix_length(full, stops)]
        piece = ""
        if full.startswith(emitted):
            piece, emitted = full[len(emitted):], full
        steps.append((kept, piece, reason))
        if reason:
            break
    return steps


def incremental_stream(engine, prompt: list[int], reply: list[int], sizes: list[int], max_new: int,
                       stops: tuple[str, ...]):
    """The engine's emission path fed `reply` in steps of `sizes` tokens. -> steps as above, the
    result, and the tokens handed to tokenizer.decode in each step."""
    batch = engine.new_batch()
    seq = batch.add(prompt, GenerationParams(max_new_tokens=max_new, stop=stops))
    steps, work = [], []
    for size in sizes:
        before = seq.detokenizer.decoded_tokens
        at = seq.num_generated
        out = batch._emit(seq, reply[at:at + size])
        work.append(seq.detokenizer.decoded_tokens - before)
        steps.append((out.token_ids, out.text, out.finish_reason))
        if out.finished:
            break
    return steps, batch.result(seq), work


def stop_strings(engine, reply: list[int], rng: random.Random) -> list[tuple[str, ...]]:
    """Stop strings cut from the reply's text (multi-byte ones among them), and one that only
    ever begins (held back, then flushed at the end)."""
    full = engine.target.tokenizer.decode(reply, skip_special_tokens=True)
    cases = []
    while len(cases) < 8:
        at, length = rng.randrange(len(full)), rng.randint(1, 4)
        s = full[at:at + length]
        if s and "\ufffd" not in s:
            cases.append((s,))
    cases.append((full[-3:] + "\x07",))
    cases.append(tuple(c[0] for c in cases[:3]))
    return cases


def test_streamed_pieces_equal_the_whole_reply_decode(engine):
    rng = random.Random(7)
    prompt = engine.target.tokenizer.encode("Say something:", add_special_tokens=False) or [5]
    *_, soup = all_replies = replies(engine, rng)
    byte_fallback = byte_run(engine, list(range(len(engine.target.tokenizer)))) > 0
    for reply in all_replies:
        sizes = [rng.randint(1, MAX_STEP) for _ in range(len(reply))]
        for stops in [()] + stop_strings(engine, reply, rng):
            want = whole_text_stream(engine, len(prompt), reply, sizes, len(reply), stops)
            got, result, work = incremental_stream(engine, prompt, reply, sizes, len(reply), stops)
            assert result.text == "".join(piece for _, piece, _ in got)
            if reply is soup and byte_fallback:
                # Byte tokens that never form UTF-8: the decoder replaces the whole run, also
                # characters streamed before it, so no stream matches the whole decode (the
                # earlier rule stopped streaming there, for the rest of the reply).
                assert result.token_ids == reply[:len(result.token_ids)]
                continue
            assert got == want, (stops, next(i for i, (g, w) in enumerate(zip(got, want)) if g != w))
            if not stops:
                whole = engine.target.tokenizer.decode(reply, skip_special_tokens=True)
                assert result.text == whole and result.token_ids == reply
            if reply is not soup:
                # A step decodes its window (its own tokens, the last settled step's, a cut
                # character's, a byte-fallback run until it completes) a few times; never the
                # reply so far (600 tokens by its end). The step that meets a stop string
                # decodes it once more for each of its tokens.
                window = 2 * MAX_STEP + CHARACTER_TAIL + byte_run(engine, reply)
                assert max(work[:-1], default=0) <= (2 + CHARACTER_TAIL) * window < len(reply), (work, window)
                assert work[-1] <= (2 + MAX_STEP) * window, (work[-1], window)


def test_decode_work_per_step_stays_bounded_as_the_reply_grows(tiny_target, tiny_draft, monkeypatch):
    """A long speculative reply: the tokens handed to tokenizer.decode in any step stay under a
    constant (the earlier engine decoded the whole reply every step: 400 tokens by its end)."""
    tok = tiny_target.tokenizer
    calls = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: calls.append(len(ids)) or decode(ids, **kw))
    config = SpeculationConfig(k=4, fallback_threshold=0)
    engine = SpeculativeEngine(tiny_target, draft=perturbed_copy(tiny_target, seed=5, noise=0.03),
                               speculation=config)
    engine.eos_ids = set()        # every reply runs its full length
    batch = engine.new_batch()
    params = GenerationParams(max_new_tokens=400, temperature=1.0, seed=3, stop=("\x07never",))
    seqs = [batch.add(engine.encode("The quick brown fox"), params),
            batch.add(engine.encode("import os\n"), GenerationParams(max_new_tokens=400, temperature=1.0, seed=4))]
    per_step, pieces = [], {s.request_id: [] for s in seqs}
    while batch.active:
        del calls[:]
        for out in batch.step():
            pieces[out.request_id].append(out.text)
        per_step.append(sum(calls))
    for seq in seqs:
        assert seq.finish_reason == "length" and len(seq.generated) == 400, seq.finish_reason
        assert "".join(pieces[seq.request_id]) == decode(seq.generated, skip_special_tokens=True)
    assert sum(s.stats.num_accepted_tokens for s in seqs) > 0, "no step emitted several tokens"
    bound = 2 * 2 * (2 * (config.k_max + 1) + 8)      # two rows, two decodes of one window each
    assert max(per_step) <= bound, (max(per_step), per_step[-10:])
    # ... and nowhere near the reply's length, which the whole-reply decode paid every step.
    assert max(per_step[len(per_step) // 2:]) < 400 // 2
