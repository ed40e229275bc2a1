"""The demo is a top-level folder (demo/), not an installed package: put the repository root on
sys.path so `import demo` finds it (tests/demo, a folder without __init__, would not shadow it:
a regular package wins over a namespace portion wherever it sits on the path)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
