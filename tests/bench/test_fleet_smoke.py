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
         "--hold-s", "0.2", "0.5", "--ttl-s", "3", "--idle-s", "1", "--backends", "single",
         "--json", str(out)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| backend | phase |" in proc.stdout
    report = json.loads(out.read_text())
    (result,) = report["results"]
    phases = [row["phase"] for row in result["rows"]]
    assert phases == ["idle (renewals, wake-up loops)", "40/s", "80/s", "20% gateways killed",
                      "10x burst"]  # fmt: skip
    for row in result["rows"]:
        assert len(row["acquire_ms"]) == len(row["release_ms"]) == 3
        assert row["samples"] > 0
        assert row["over_cap"] == 0, row
        assert isinstance(row["refused"], dict)
    idle, rates, faults = result["rows"][0], result["rows"][1:3], result["rows"][3:]
    assert idle["starts"] == 0 and idle["redis_cpu_pct"] is not None
    faults = {row["phase"]: row for row in faults}
    assert faults["20% gateways killed"]["killed"].startswith("1/2 processes")
    assert all("recovery_s" in row for row in faults.values())
    assert all(row["held_per_s"] > 0 for row in rates)
    assert all(row["redis_cpu_ms_per_1k_starts_net"] is not None for row in rates)
    (saturation,) = report["saturation"]
    assert saturation["backend"] == "1 primary"
    assert report["cores"] >= 1 and len(report["load_average"]["before"]) == 3
