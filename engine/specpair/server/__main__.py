"""`python -m specpair.server engine serve|generate ...` (the same commands as `specpair engine`)."""

import sys

from specpair.server.cli import main

sys.exit(main())
