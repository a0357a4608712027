"""Chaos tests: the soak harness of ``bench/chaos.py`` in a short configuration, the
fault-injecting proxy it relies on, and the failure paths the soak found.

The ``bench/`` modules are imported by name (they import each other that way), so the
``bench`` directory is put on ``sys.path`` here.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
