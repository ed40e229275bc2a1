"""What a release is (the immutable content of one spec, its hash) and what the registry holds for
it: tag names, aliases and which of them move. No MLflow client here (that is clients/registry.py)."""
