"""Incremental detokenization: a reply's text, step by step, for work that does not grow with it.

Decoding a whole reply after every step costs O(length) a step, O(length^2) a reply. As vLLM's
detokenizer does, each sequence keeps two offsets into its generated tokens: `read_offset`, up to
which the text is settled (final, and ending on a whole character), and `prefix_offset`, where
the decode window starts. A step decodes only the window twice, without and with the tokens after
`read_offset`; the difference is the new text. The window starts a step's worth of tokens before
the read offset so that tokenizers whose text depends on the token before (a SentencePiece word
start) see it. Text ending in "\ufffd" (half a UTF-8 character) settles up to the step's last
token before that character, and the next step decodes the character's bytes again with what
followed; a byte-fallback decoder (SentencePiece's <0xNN> tokens) shows a run of byte tokens as
"\ufffd"s until the run ends on a whole character, so such a run settles whole.

The decoded text is that of the generated tokens alone, special tokens skipped and a closing EOS
left out, as a decode of the whole reply gives it. Only the text not yet streamed is kept here;
what was streamed lives with the sequence.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
CHARACTER_TAIL = 3      # bytes of a UTF-8 character after its first (4 bytes at most)


class IncrementalDetokenizer:
    """One sequence's text after its streamed part, decoded from a bounded window of tokens.

    `unstreamed(tokens, count)` is the text of the reply's first `count` generated tokens that
    follows what was streamed so far; `streamed(tokens, count, chars)` records that `chars` more
    of it were streamed after a step that ended with `count` generated tokens.
    """

    def __init__(self, tokenizer, eos_ids, start: int):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.start = start            # the prompt's length: generated tokens begin here
        self.prefix_offset = 0        # window start (a generated-token index)
        self.read_offset = 0          # text of the generated tokens before it is settled
        self.settled_rest = ""        # settled text not yet streamed
        self.overlap = 0              # characters after the settled text already streamed
        self.decoded_tokens = 0       # tokens handed to tokenizer.decode, ever (tests bound it)
        self._prefix_text: str | None = None        # text of the window before read_offset
        self._fresh: tuple[int, str] | None = None  # (count, text after read_offset) this step

    def _decode(self, tokens: list[int], lo: int, hi: int) -> str:
        window = tokens[self.start + lo:self.start + hi]
        if window and window[-1] in self.eos_ids:
            window = window[:-1]   # EOS ends the reply; it adds no text even where not special
        if not window:
            return ""
        self.decoded_tokens += len(window)
        return self.tokenizer.decode(window, skip_special_tokens=True)

    def _after_settled(self, tokens: list[int], count: int) -> str:
        """Text of generated tokens read_offset..count-1 (as a whole-reply decode gives it)."""
        while self._prefix_text is None:   # the window's settled part: decoded once per settling
            text = self._decode(tokens, self.prefix_offset, self.read_offset)
            if not text and self.prefix_offset > 0:
                # A window whose settled part decodes to nothing (special tokens) lets a decoder
                # that strips the text's first space (SentencePiece) strip the new text's:
                # start the window a token earlier.
                self.prefix_offset -= 1
                continue
            self._prefix_text = text
        if self._fresh is None or self._fresh[0] != count:
            text = self._decode(tokens, self.prefix_offset, count)
            self._fresh = (count, text[len(self._prefix_text):])
        return self._fresh[1]

    def unstreamed(self, tokens: list[int], count: int) -> str:
        """Text of the first `count` generated tokens (count >= read_offset) after what was
        streamed. `tokens` is the whole sequence, prompt first."""
        return (self.settled_rest + self._after_settled(tokens, count))[self.overlap:]

    def streamed(self, tokens: list[int], count: int, chars: int) -> None:
        """`chars` more characters were streamed after a step that left `count` generated tokens;
        settle the text up to `count`, or where it ends inside a character, up to the last of the
        step's tokens before that character (so the window does not grow while steps keep ending
        inside characters, as they do in text of 3-byte characters, a byte a token)."""
        fresh = whole = self._after_settled(tokens, count)
        self._fresh = None                 # the next step's tokens differ
        settle = count
        # A character's bytes cut by the step's end lie in its last CHARACTER_TAIL tokens at most.
        # An earlier end settles only where its text is what the decode up to `count` shows
        # now: a byte-fallback decoder (SentencePiece) turns a whole run of byte tokens into
        # "\ufffd"s while the run ends inside a character, and that run settles when complete.
        for _ in range(CHARACTER_TAIL):
            if not fresh.endswith(REPLACEMENT) or settle - 1 <= self.read_offset:
                break
            settle -= 1
            fresh = self._decode(tokens, self.prefix_offset, settle)[len(self._prefix_text):]
            if not whole.startswith(fresh):
                fresh = whole
                break
        used = self.overlap + chars        # how far into settled_rest + fresh the stream reached
        if not fresh.endswith(REPLACEMENT):
            rest = self.settled_rest + fresh
            self.settled_rest, self.overlap = rest[used:], max(0, used - len(rest))
            self.prefix_offset, self.read_offset = self.read_offset, settle
            self._prefix_text = None
        elif used <= len(self.settled_rest):
            self.settled_rest, self.overlap = self.settled_rest[used:], 0
        else:
            self.overlap = used - len(self.settled_rest)
            self.settled_rest = ""
