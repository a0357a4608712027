"""The chaos soak (``bench/chaos.py``) in CI: a few hundred sessions against every fault,
every invariant asserted. Bigger runs are ``python bench/chaos.py --sessions N``
(docs/reliability.md records them).

Outcomes vary with scheduling (a loaded machine refuses more); the invariants do not:
no cap crossed, no slot leaked, an empty queue, tasks and descriptors back to their
baseline, no internal error, no hung client, the process alive and exiting cleanly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import chaos  # bench/chaos.py (tests/chaos/conftest.py puts bench/ on sys.path)


def _check(report: dict[str, Any], sessions: int) -> None:
    failed = [name for name, held in report["invariants"].items() if not held]
    assert not failed, f"invariants failed: {failed}\n\n{chaos.format_report(report)}"
    assert report["sessions"] == sessions
    assert report["leaked_slots"] == 0 and report["final_queue"] == 0
    for name, replica in report["replicas"].items():
        assert replica["max_active_audit"] <= replica["cap"], name
    # the run exercised what it claims to: admissions, refusals, departures and faults
    outcomes = report["outcomes"]
    assert outcomes.get("ok", 0) > 0 and outcomes.get("left", 0) > 0
    assert report["audit_checks"] > sessions
    assert sum(report["faults"]["proxy_triggered"].values()) > 0
    assert sum(report["faults"]["sim"].values()) > 0


async def test_short_soak_keeps_every_invariant(tmp_path: Path) -> None:
    config = chaos.ChaosConfig(sessions=200, concurrency=12, seed=20261129, workdir=str(tmp_path))
    _check(await chaos.run_soak(config), 200)
