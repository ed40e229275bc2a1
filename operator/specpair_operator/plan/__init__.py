"""What a pass does, decided from what it observed: pure functions from worlds to steps (no I/O)."""
