"""Probe test helpers: a simulated GPU in its own process; recorded traces in data/."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"


@contextlib.contextmanager
def sim_process(preset: str) -> Iterator[str]:
    """``python -m tests.probe.simserver PRESET``; yields its base URL, stops it after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.probe.simserver", preset],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the simulator for {preset} did not start")
        yield str(json.loads(line)["url"])
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
