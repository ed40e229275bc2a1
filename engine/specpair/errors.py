"""Errors a user can act on. The CLI prints them as one line and exits 2, never a traceback."""


class SpecpairError(Exception):
    """A problem with the user's input or environment, with a message that says what to change."""


class TokenizerMismatch(SpecpairError):
    """Draft and target tokenizers differ: speculating would emit wrong tokens."""

    def __init__(self, differences: list[str]):
        self.differences = list(differences)
        super().__init__("draft and target tokenizers differ: " + "; ".join(self.differences))
