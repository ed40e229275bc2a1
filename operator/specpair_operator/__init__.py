"""Kopf operator for SpecModelPair (no torch here)."""
