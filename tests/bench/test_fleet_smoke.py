"""Smoke test of bench/fleet.py at tiny sizes: four gateways in two processes against
one redis-server, two short rate phases, 20 % of the processes killed and a burst.
Checks the output's shape and that no sample was over a cap; nothing on timings."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fleet.py"

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server not installed")  # fmt: skip


def test_fleet_bench_tiny(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--gateways", "4", "--procs", "2", "--pools", "2",
         "--rates", "40", "80", "--phase-s", "2", "--fault-s", "4", "--fault-rate", "40",
         "--hold-s", "0.2", "0.5", "--ttl-s", "3", "--backends", "single",
         "--json", str(out)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| backend | phase |" in proc.stdout
    report = json.loads(out.read_text())
    (result,) = report["results"]
    phases = [row["phase"] for row in result["rows"]]
    assert phases == ["40/s", "80/s", "20% gateways killed", "10x burst"]
    for row in result["rows"]:
        assert len(row["acquire_ms"]) == len(row["release_ms"]) == 3
        assert row["samples"] > 0
        assert row["over_cap"] == 0, row
        assert isinstance(row["refused"], dict)
    faults = {row["phase"]: row for row in result["rows"][2:]}
    assert faults["20% gateways killed"]["killed"].startswith("1/2 processes")
    assert all("recovery_s" in row for row in faults.values())
    assert sum(row["held_per_s"] for row in result["rows"][:2]) > 0
    (saturation,) = report["saturation"]
    assert saturation["backend"] == "1 primary"
    assert report["cores"] >= 1 and len(report["load_average"]["before"]) == 3
