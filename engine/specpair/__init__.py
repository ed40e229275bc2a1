"""specpair: speculative-decoding runtime and CLI.

Importing this package must stay cheap and torch-free: the operator imports the identity and
config helpers from here without having torch installed.
"""

__version__ = "0.1.0"
