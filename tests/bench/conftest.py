"""bench/'s modules import one another by their names in bench/ (a script run there has it on
its path), so the tests of bench code have it on theirs too."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
