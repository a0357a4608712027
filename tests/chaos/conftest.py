"""Chaos tests: the soak harness of ``bench/chaos.py`` in a short configuration, the
fault-injecting proxy it relies on, and the failure paths the soak found.

Tests marked ``slow`` (the bigger soak) are skipped unless ``HEADROOM_SLOW=1``.
The ``bench/`` modules are imported by name (they import each other that way), so the
``bench`` directory is put on ``sys.path`` here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

HERE = Path(__file__).resolve().parent


def slow_enabled() -> bool:
    return os.environ.get("HEADROOM_SLOW") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this directory's ``slow`` tests unless ``HEADROOM_SLOW=1``."""
    if slow_enabled():
        return
    skip = pytest.mark.skip(reason="slow: set HEADROOM_SLOW=1 to run")
    for item in items:
        if item.get_closest_marker("slow") is not None and HERE in item.path.parents:
            item.add_marker(skip)
