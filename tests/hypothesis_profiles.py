"""Hypothesis example budgets: the full count in CI, a quarter on a developer's machine.

Profiles (``tests/conftest.py`` loads one before any test module is imported):

- ``ci``: hypothesis' defaults (100 examples a property), and every count written in a
  test as ``examples(n)`` runs ``n`` examples. Loaded when ``CI`` is set (``.ci/run``
  sets ``CI=1``).
- ``dev``: 25 examples a property, and ``examples(n)`` runs a quarter of ``n`` (at least
  one). Loaded otherwise, so ``pytest -m "not slow"`` stays a quick inner loop.

``HYPOTHESIS_PROFILE=ci`` (or pytest's ``--hypothesis-profile=ci``) runs the full counts
locally. The fuzz campaign (``tests/fuzz``) has its own scale, ``HEADROOM_FUZZ_SCALE``.
"""

from __future__ import annotations

import os

from hypothesis import settings

__all__ = ["examples", "load"]

FULL = 100  # hypothesis' default max_examples, the "ci" profile's

settings.register_profile("ci", max_examples=FULL)
settings.register_profile("dev", max_examples=FULL // 4)


def load() -> str:
    """Load the profile the environment asks for; return its name."""
    name = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
    settings.load_profile(name)
    return name


def examples(n: int) -> int:
    """The number of examples for a property written to run ``n`` in CI: ``n`` scaled
    like the loaded profile's default count against hypothesis' own (at least one)."""
    return max(1, n * settings.default.max_examples // FULL)
