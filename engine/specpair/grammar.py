"""Constrained decoding: a request's structure (JSON schema, regex, Lark grammar, choice) as a
token mask at every position, through llguidance.

Why llguidance (not xgrammar): it ships as one abi3 wheel with no torch pin (xgrammar's wheels
require a matching torch, and this engine runs torch 2.13 on the CPU and its CUDA lock's
version on GPUs), computes a mask in tens of microseconds without a per-schema compile step,
and its matcher checks a run of tokens and rolls back, which is what verifying drafts needs.

Under speculation (decoding.Batch): a row's drafts are cut at the first token its grammar
refuses before the target scores them (`RowGrammar.allowed`), and the target's logits at every
verified position are masked by the grammar in the state after the drafts before it
(`RowGrammar.masks`), so every committed token is what target-only constrained decoding picks
there. A draft the grammar refuses counts as drafted and not accepted.
"""

from __future__ import annotations

import json
import threading

import torch

from specpair.errors import SpecpairError

STRUCTURE_KINDS = ("json_object", "json_schema", "regex", "grammar", "choice")

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
        return RowGrammar(matcher, self.vocab_size)


class RowGrammar:
    """One row's matcher, in the state after the row's committed tokens."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self._words = (vocab_size + 31) // 32
        self._bits = torch.arange(32, dtype=torch.int32)

    def allowed(self, drafts: list[int]) -> int:
        """How many of `drafts`, in a leading run, the grammar accepts after the committed tokens."""
        if not drafts:
            return 0
        return self.matcher.validate_tokens(drafts)

    def masks(self, drafts: list[int], width: int) -> torch.Tensor:
        """[len(drafts) + 1, width] bool, True where a token is allowed: the grammar's mask after
        the committed tokens and each prefix of `drafts` (which it must accept: `allowed`).
        Tokens past the tokenizer's vocabulary (padded embedding rows) are never allowed."""
        words = torch.zeros(len(drafts) + 1, self._words, dtype=torch.int32)
        consumed = 0
        for j in range(len(drafts) + 1):
            if j:
                if not self.matcher.consume_token(drafts[j - 1]):
                    raise SpecpairError(f"grammar refused draft {drafts[j - 1]} it had allowed")
                consumed += 1
            row = words[j]
            self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        if consumed:
            self.matcher.rollback(consumed)
        allowed = ((words.unsqueeze(-1) >> self._bits) & 1).view(len(drafts) + 1, -1).bool()
        allowed = allowed[:, :min(width, self.vocab_size)]
        if allowed.shape[1] < width:
            allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], width - allowed.shape[1])], 1)
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
