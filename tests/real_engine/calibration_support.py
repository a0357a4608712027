"""What the two calibration round trips (llama-server and vLLM) share: the report of a
round trip and the one rule its prediction is held to."""

from __future__ import annotations

import os
from typing import Any

from proxy.sim.calibrate import Calibration, render

__all__ = ["agrees", "assert_predicts"]


def agrees(calibration: Calibration, predicted: int, probe: dict[str, Any]) -> bool:
    """Print the round trip (the calibration, both ceilings, the load, the probe's table);
    whether ``predicted`` lies within one stream of the probe's range: from below always,
    from above only when the probe's ceiling is exact (a ceiling it reports as a lower
    bound, no level having failed, says nothing of what lies above it)."""
    low, high = probe["ceiling_range"]
    print(render(calibration))
    print(f"predicted ceiling {predicted}; probe {probe['ceiling']} (range {low}-{high}); "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(probe["table"])
    return predicted >= low - 1 and (not probe["exact"] or predicted <= high + 1)


def assert_predicts(calibration: Calibration, predicted: int, probe: dict[str, Any]) -> None:
    """:func:`agrees`, asserted."""
    low, high = probe["ceiling_range"]
    assert agrees(calibration, predicted, probe), (predicted, low, high, probe["table"])
