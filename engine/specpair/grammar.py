"""Constrained decoding: a request's structure (JSON schema, regex, Lark grammar, choice) as a
token mask at every position, through llguidance.

Why llguidance (not xgrammar): it ships as one abi3 wheel with no torch pin (xgrammar's wheels
require a matching torch, and this engine runs torch 2.13 on the CPU and its CUDA lock's
version on GPUs), computes a mask in tens of microseconds without a per-schema compile step,
and its matcher checks a run of tokens and rolls back, which is what verifying drafts needs.

Under speculation (decoding.Batch): drafters propose within the grammar where they can (a draft
model's logits masked, `DraftGrammar`; a lookup's proposals cut at the first refused token and
filled with the tokens the grammar forces, `RowGrammar.guided_drafts`); any other drafter's
drafts are cut at the first token the grammar refuses before the target scores them
(`RowGrammar.allowed`), and the target's logits at every
verified position are masked by the grammar in the state after the drafts before it
(`RowGrammar.masks`), so every committed token is what target-only constrained decoding picks
there. A draft the grammar refuses counts as drafted and not accepted.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from specpair.errors import SpecpairError

if TYPE_CHECKING:
    import torch

STRUCTURE_KINDS = ("json_object", "json_schema", "regex", "grammar", "choice")
# vLLM's structured_outputs keys taken (grammar: Lark, as llguidance reads it).
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar")

# Any JSON object: what `response_format: {"type": "json_object"}` asks for.
JSON_OBJECT_SCHEMA = {"type": "object"}


def grammar_source(structure: tuple[str, str]) -> str:
    """(kind, text) -> an llguidance grammar. Raises SpecpairError on text that is no such thing."""
    import llguidance

    kind, text = structure
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA)
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise SpecpairError(f"the JSON schema is not JSON: {exc}") from None
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False})
        except ValueError as exc:
            raise SpecpairError(f"the JSON schema: {exc}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(text)
    if kind == "choice":
        choices = json.loads(text)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))
    raise SpecpairError(f"unknown structure kind {kind!r}: one of {', '.join(STRUCTURE_KINDS)}")


class StructureError(ValueError):
    """A `response_format` or `structured_outputs` refused: (field, reason), the field in the
    request's own names (the API answers it as a 400, the gate as a bad golden prompt)."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


def request_structure(response_format: dict | None, structured_outputs: dict | None) -> tuple[str, str] | None:
    """A reply's constraint as a request or golden prompt asks for it: OpenAI's `response_format`
    (`json_object`, `json_schema`) or vLLM's `structured_outputs` extension (one of `json`,
    `regex`, `choice`, `grammar` (Lark)) -> (kind, text) as grammar_source reads it; None: free
    text. Checked to compile, so a bad schema is refused naming its field (StructureError)."""
    fmt, ext = response_format or {}, structured_outputs or {}
    structure, param = None, "response_format"
    kind = fmt.get("type", "text")
    if kind == "json_object":
        structure = ("json_object", "")
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise StructureError("response_format.json_schema", "required: an object with name and schema")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise StructureError("response_format.json_schema.schema", "must be a JSON schema object")
        structure, param = ("json_schema", json.dumps(schema)), "response_format.json_schema.schema"
    elif kind != "text":
        raise StructureError("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    if ext:
        given = [name for name in STRUCTURED_OUTPUT_KINDS if ext.get(name) is not None]
        if len(given) != 1 or structure is not None:
            raise StructureError("structured_outputs", "set exactly one of json, regex, choice, grammar "
                                                       "(and no response_format beside it)")
        name = given[0]
        value, param = ext[name], f"structured_outputs.{name}"
        if name == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise StructureError(param, f"not JSON: {exc}") from None
            if not isinstance(value, dict):
                raise StructureError(param, "must be a JSON schema object")
            structure = ("json_schema", json.dumps(value))
        elif name == "choice":
            if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
                raise StructureError(param, "must be a non-empty array of non-empty strings")
            structure = ("choice", json.dumps(value))
        else:
            if not isinstance(value, str) or not value:
                raise StructureError(param, "must be a non-empty string")
            structure = (name, value)
    if structure is not None:
        try:
            check_structure(structure)
        except SpecpairError as exc:
            raise StructureError(param, f"does not compile: {str(exc)[:500]}") from None
    return structure


def reply_valid(structure: tuple[str, str], text: str) -> bool | None:
    """Whether a whole reply is what its structure asks for, judged apart from the grammar that
    constrained it (the gate's schema validity): JSON parsed and checked by `jsonschema`, a
    choice by equality, a regex by Python's `re` (the common syntax both dialects share). None for
    a Lark grammar: nothing but the grammar itself reads one."""
    import re

    kind, source = structure
    if kind in ("json_object", "json_schema"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if kind == "json_object":
            return isinstance(value, dict)
        import jsonschema

        schema = json.loads(source)
        validator = jsonschema.validators.validator_for(schema)(schema)
        return validator.is_valid(value)
    if kind == "choice":
        return text in json.loads(source)
    if kind == "regex":
        try:
            return re.fullmatch(source, text) is not None
        except re.error:
            return None
    return None


def check_structure(structure: tuple[str, str]) -> None:
    """Whether a structure compiles, without a tokenizer (the API checks it before admitting the
    request, so the refusal names the field). Raises SpecpairError with the library's words."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_source(structure))
    if error:
        raise SpecpairError(error)


class GrammarCompiler:
    """One tokenizer's grammars: the tokenizer wrapped once (about a second), matchers per row."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids):
        self._hf, self.vocab_size, self._eos = hf_tokenizer, vocab_size, sorted(eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._eos or None)
            return self._tokenizer

    def row(self, structure: tuple[str, str]) -> "RowGrammar":
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), grammar_source(structure), log_level=0)
        if matcher.is_error():
            raise SpecpairError(f"the {structure[0]} does not compile: {matcher.get_error()}")
        return RowGrammar(matcher, self.vocab_size, self.tokenizer())


def unpack_bits(words: "torch.Tensor") -> "torch.Tensor":
    """llguidance's mask words [..., W] int32 (bit j of word i: token 32 i + j) -> [..., 32 W]
    bool. Through numpy's unpackbits, one pass over the bytes: torch's shift-and-mask over every
    bit cost ten times more, and more again on a loaded machine (three full-size ops, each
    split over threads), every verified position of every grammar row."""
    import numpy as np
    import torch

    as_bytes = words.contiguous().numpy().view(np.uint8)     # little-endian: bit order is token order
    return torch.from_numpy(np.unpackbits(as_bytes, axis=-1, bitorder="little").view(np.bool_))


class RowGrammar:
    """One row's matcher, in the state after the row's committed tokens (`tokenizer`: its
    llguidance tokenizer, which spells out forced bytes for jump-forward drafts)."""

    def __init__(self, matcher, vocab_size: int, tokenizer=None):
        self.matcher, self.vocab_size, self.tokenizer = matcher, vocab_size, tokenizer
        self._words = (vocab_size + 31) // 32

    def allowed(self, drafts: list[int]) -> int:
        """How many of `drafts`, in a leading run, the grammar accepts after the committed tokens."""
        if not drafts:
            return 0
        return self.matcher.validate_tokens(drafts)

    def masks(self, drafts: list[int], width: int) -> torch.Tensor:
        """[len(drafts) + 1, width] bool, True where a token is allowed: the grammar's mask after
        the committed tokens and each prefix of `drafts` (which it must accept: `allowed`).
        Tokens past the tokenizer's vocabulary (padded embedding rows) are never allowed."""
        import torch

        words = torch.zeros(len(drafts) + 1, self._words, dtype=torch.int32)
        consumed = 0
        for j in range(len(drafts) + 1):
            # A stopped matcher (the grammar complete: EOS next) takes a token without recording
            # it, so a rollback counting it would undo a committed token: nothing is consumed
            # past the stop (its mask, EOS only, stands for the positions after it).
            if j and not self.matcher.is_stopped():
                if not self.matcher.consume_token(drafts[j - 1]):
                    raise SpecpairError(f"grammar refused draft {drafts[j - 1]} it had allowed")
                consumed += 1
            row = words[j]
            self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        if consumed:
            self.matcher.rollback(consumed)
        allowed = unpack_bits(words)[:, :min(width, self.vocab_size)]
        if allowed.shape[1] < width:
            allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], width - allowed.shape[1])], 1)
        return allowed

    def sibling_masks(self, chain: list[int], siblings: list[list[int]], width: int) -> torch.Tensor:
        """[len(chain), S, width] bool: for a token tree's sibling s at depth j (an alternative to
        chain[j], after chain[:j]), the grammar's mask after chain[:j] and that sibling: what the
        target may emit after a kept sibling. The chain must be one the grammar accepts
        (`allowed`). A sibling the grammar refuses is never kept (the mask at depth j gives it no
        probability): its row is all False. The committed state is restored."""
        import torch

        S = len(siblings[0]) if siblings else 0
        words = torch.zeros(len(chain), max(S, 1), self._words, dtype=torch.int32)
        consumed = 0
        try:
            for j in range(len(chain)):
                if j and not self.matcher.is_stopped():
                    if not self.matcher.consume_token(chain[j - 1]):
                        raise SpecpairError(f"grammar refused draft {chain[j - 1]} it had allowed")
                    consumed += 1
                for s, token in enumerate(siblings[j][:S]):
                    row = words[j, s]
                    if self.matcher.is_stopped():
                        # Complete: EOS is its only sibling; nothing may follow it.
                        continue
                    if self.matcher.validate_tokens([int(token)]) != 1:
                        continue
                    self.matcher.consume_token(int(token))    # EOS included: it stops, recorded
                    self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
                    self.matcher.rollback(1)
        finally:
            if consumed:
                self.matcher.rollback(consumed)
        allowed = unpack_bits(words)[..., :min(width, self.vocab_size)]
        if allowed.shape[-1] < width:
            allowed = torch.cat([allowed, allowed.new_zeros(*allowed.shape[:-1], width - allowed.shape[-1])], -1)
        return allowed[:, :S]

    def guided_drafts(self, proposed: list[int], k: int,
                      propose_more: Callable[[list[int]], list[int]] | None = None) -> list[int]:
        """Up to k drafts this grammar allows after the committed tokens, for a drafter that
        proposes without it (n-gram lookup, a copy): the leading run of `proposed` it accepts;
        where it refuses one, or `proposed` ends, what it forces next (jump-forward drafting:
        the tokens of its forced bytes such as a key name, `": "` or closing braces, a lone
        allowed token, EOS once the grammar is complete); after each run
        `propose_more(drafts so far)` may propose again (the lookup continued past the forced
        tokens). Refused proposals are never drafts; forced ones are drafts like any other: the
        target verifies them under its mask, so output stays target-only constrained decoding's
        (a forced token is the only one the mask leaves, or the grammar's own tokenization of
        its forced bytes, which the target may still tokenize otherwise and reject).
        The committed state is restored before returning."""
        matcher = self.matcher
        drafts: list[int] = []
        queue, taken = list(proposed), 0
        try:
            while len(drafts) < k:
                room = k - len(drafts)
                run = queue[:matcher.validate_tokens(queue[:room])] if queue else []
                queue = []
                if not run:
                    run = self.forced()[:room]
                    if not run:
                        break
                for token in run:
                    if matcher.is_stopped():
                        # Complete: EOS (the run's only allowed token) ends the reply; the matcher
                        # would take it without recording it, so it is not consumed.
                        drafts.append(token)
                        return drafts
                    if not matcher.consume_token(token):
                        raise SpecpairError(f"grammar refused draft {token} it had allowed")
                    taken += 1
                    drafts.append(token)
                if propose_more is not None and len(drafts) < k:
                    queue = propose_more(drafts)
            return drafts
        finally:
            if taken:
                matcher.rollback(taken)

    def forced(self) -> list[int]:
        """What the grammar forces next in its current state: the tokens of its forced bytes,
        else the mask's one allowed token (EOS once complete); [] where it allows a choice.
        The forced bytes are spelled by the tokenizer whole: llguidance's fast-forward tokens
        leave out a last token that the free bytes after it could extend (`":` before a string's
        `"`), which, as a draft, is a likely guess the target verifies like any other."""
        matcher = self.matcher
        if not matcher.is_stopped():
            tokens = list(matcher.compute_ff_tokens())
            data = matcher.compute_ff_bytes() if self.tokenizer is not None else b""
            if data:
                whole = self.tokenizer.tokenize_bytes(data)
                take = matcher.validate_tokens(whole) if whole else 0
                if take > len(tokens):
                    return whole[:take]
            if tokens:
                return tokens
        import numpy as np

        words = self._mask_words().numpy()
        nonzero = np.flatnonzero(words)
        if nonzero.shape[0] != 1:
            return []
        index = int(nonzero[0])
        word = int(words[index]) & 0xFFFFFFFF
        if word & (word - 1):
            return []
        token = index * 32 + word.bit_length() - 1
        return [token] if token < self.vocab_size else []

    def drafting(self) -> "DraftGrammar":
        """This row's grammar for one round's drafting: the mask for the draft's next proposal,
        step by step (DraftGrammar), the committed state restored when the round's drafts end."""
        return DraftGrammar(self)

    def _mask_words(self):
        import torch

        words = torch.zeros(self._words, dtype=torch.int32)
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        return words

    def _allowed(self, words, width: int) -> torch.Tensor:
        import torch

        allowed = unpack_bits(words)[:min(width, self.vocab_size)]
        if allowed.shape[0] < width:
            allowed = torch.cat([allowed, allowed.new_zeros(width - allowed.shape[0])])
        return allowed

    def advance(self, tokens: list[int]) -> None:
        """Commit the row's new tokens (each one the masks allowed). Once the grammar is complete
        it allows only EOS, which ends the reply; the matcher takes nothing after it stopped."""
        for token in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(token):
                raise SpecpairError(f"grammar refused committed token {token}: {self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar allows nothing more (the reply is complete: only EOS may follow)."""
        return self.matcher.is_stopped()


class DraftGrammar:
    """A row's grammar while its draft proposes one round: `mask(width)` is what the grammar allows
    next after the committed tokens and the drafts `take`n so far, so a draft model proposes
    within the grammar (its argmax, or its distribution q renormalised to the allowed tokens:
    the q the verifier reads is the one drafted from, so sampling stays exact). `close()` rolls
    the drafts back: the committed state is the Batch's to advance. A draft the grammar refuses
    (the grammar complete, or a token outside the mask) ends the row's guidance: no mask after it.
    """

    def __init__(self, row: RowGrammar):
        self.row, self.taken, self.open = row, 0, not row.matcher.is_stopped()

    def mask(self, width: int) -> torch.Tensor | None:
        """[width] bool of the allowed next tokens; None where the grammar guides no more (it is
        complete, or allows nothing: masking every token would leave no proposal)."""
        if not self.open:
            return None
        allowed = self.row._allowed(self.row._mask_words(), width)
        return allowed if bool(allowed.any()) else None

    def take(self, token: int) -> None:
        matcher = self.row.matcher
        # validate first: a refused consume_token leaves the matcher in its error state.
        if self.open and not matcher.is_stopped() and matcher.validate_tokens([int(token)]) == 1:
            matcher.consume_token(int(token))
            self.taken += 1
        else:
            self.open = False

    def close(self) -> None:
        if self.taken:
            self.row.matcher.rollback(self.taken)
        self.taken, self.open = 0, False


def within_grammars(logits: torch.Tensor, guides: list) -> torch.Tensor:
    """Draft logits [B, V] with -inf where each guided row's grammar refuses the token (a new
    tensor; rows whose guide is None, or whose grammar guides no more, as they were)."""
    import torch

    out = None
    for i, guide in enumerate(guides):
        allowed = guide.mask(logits.shape[-1]) if guide is not None else None
        if allowed is None:
            continue
        if out is None:
            out = logits.clone()
        out[i] = out[i].masked_fill(~allowed.to(logits.device), float("-inf"))
    return logits if out is None else out
