"""Smoke test of bench/redis_saturation.py at tiny sizes: one redis-server, two client
steps of a fraction of a second, two gateways' renewals. Checks the output's shape (the
recorded scripts, every step's fields); nothing on rates or timings."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "redis_saturation.py"

pytestmark = pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in ("redis-server", "redis-benchmark")),
    reason="redis-server or redis-benchmark not installed",
)


def test_redis_saturation_bench_tiny(tmp_path: Path) -> None:
    out = tmp_path / "saturation.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--backends", "single", "--clients", "1", "2",
         "--step-s", "0.5", "--idle-s", "0.5", "--hold-s", "0.2", "--gateways", "2",
         "--sessions", "10", "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| backend | clients per redis-benchmark" in proc.stdout
    assert "renewals only: 2 gateways x 1 pool(s)" in proc.stdout
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["backend"] == "1 primary" and result["pools"] == ["pool-0"]
    scripts = result["scripts"]
    assert set(scripts) == {"acquire", "release"}
    assert scripts["acquire"] != scripts["release"]
    assert all(len(sha) == 40 and int(sha, 16) >= 0 for sha in scripts.values())
    renewals = result["renewals"]
    assert renewals["renew_calls_per_s"] > 0 and renewals["errors"] == []
    assert renewals["lost"] == 0
    steps = result["steps"]
    assert [s["clients_per_benchmark"] for s in steps] == [1, 2][: len(steps)] and steps
    for step in steps:
        assert step["connections"] == 2 * step["clients_per_benchmark"]
        assert step["starts_per_s"] > 0 and step["acquire_rps"] > 0
        assert len(step["acquire_ms"]) == len(step["release_ms"]) == 2
        (node,) = step["per_primary"].values()
        # Every replayed call ran its script: an acquire and a release per start, and
        # the renewals' ticks on top.
        assert node["evalsha_calls"] >= 2 * step["calls_per_benchmark"]
        assert node["leases_at_end"] > 0
        assert step["renewal_errors"] == 0
    assert result["peak"]["starts_per_s"] == max(s["starts_per_s"] for s in steps)
    assert isinstance(result["stopped_by"], str) and result["stopped_by"]
    assert all(s["renew_calls_per_s"] >= 0 for s in steps)
    assert report["cores"] >= 1 and len(report["load_average"]["before"]) == 3
