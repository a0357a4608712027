"""bench/chaos_shared.py (the multi-gateway chaos run): its analysis on hand-made
timelines, and a small end-to-end run with real processes (3 gateways, redis-server,
the simulator) through kill -9, a Redis restart and a cut-off. Only invariants are
asserted (no session holding a slot beyond the cap, 0 leaked slots, every fault ran),
never timings."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load() -> ModuleType:
    name = "bench_chaos_shared"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / "chaos_shared.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


cs = _load()


def _session(cid: str, gateway: int, sent: float) -> object:
    return cs.Session(cid, gateway, sent, ended=sent + 10, outcome="ok", opened=sent + 1)


def test_fifo_inversions_count_pairs_reaching_a_gpu_out_of_arrival_order() -> None:
    sessions = [_session("a", 0, 0.0), _session("b", 1, 1.0), _session("c", 2, 2.0)]
    # b and c reach a GPU before a, which arrived first: two inverted pairs.
    starts = {"a": (0, 5.0), "b": (0, 3.0), "c": (1, 4.0)}
    result = cs.fifo_inversions(sessions, starts, 0.05, [])
    assert result["inversions"] == 2
    assert result["beyond_margin"] == 2
    assert result["beyond_margin_by_cause"] == {"across_gateways": 2}
    # The same arrivals inside a fault window are put down to the fault.
    assert cs.fifo_inversions(sessions, starts, 0.05, [(4.5, 6.0)])["beyond_margin_by_cause"] == {
        "fault": 2
    }
    # In order: none. Closer than the margin: counted, but not beyond it.
    in_order = {"a": (0, 3.0), "b": (0, 4.0), "c": (1, 5.0)}
    assert cs.fifo_inversions(sessions, in_order, 0.05, [])["inversions"] == 0
    close = [_session("a", 0, 0.0), _session("b", 1, 0.01)]
    result = cs.fifo_inversions(close, {"a": (0, 2.0), "b": (0, 1.0)}, 0.05, [])
    assert (result["inversions"], result["beyond_margin"]) == (1, 0)


def test_idle_while_queued_pairs_a_freed_slot_with_the_next_start_on_that_gpu() -> None:
    # cap 1; "w" waits from t=1 and starts on gpu0 at 2.5 after "x" left it at 2.0.
    sessions = [_session("x", 0, 0.0), _session("w", 1, 1.0)]
    starts = {"x": (0, 0.5), "w": (0, 2.5)}
    per_gpu = [[(0.5, 1), (2.0, -1), (2.5, 1), (4.0, -1)]]
    result = cs.idle_while_queued(sessions, starts, per_gpu, 1, [])
    assert result["count"] == 1
    assert result["max_ms"] == 500.0
    # Nobody waiting when the slot frees: not counted.
    alone = cs.idle_while_queued([sessions[0]], {"x": (0, 0.5)}, [[(0.5, 1), (2.0, -1)]], 1, [])
    assert alone["count"] == 0
    # An end that leaves the GPU still at its cap (a connection over cap) frees nothing.
    over = [[(0.1, 1), (0.5, 1), (2.0, -1), (2.5, 1), (4.0, -1), (4.1, -1)]]
    assert cs.idle_while_queued(sessions, starts, over, 1, [])["count"] == 0


def _require_redis() -> None:
    if shutil.which("redis-server") is None:
        message = "redis-server is not installed (Debian: apt-get install redis-server)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must provide it")
        pytest.skip(message)


def test_a_small_run_holds_the_caps_and_leaks_nothing(tmp_path: Path) -> None:
    _require_redis()
    out = tmp_path / "report.json"
    args = [
        "--duration", "14", "--gateways", "3", "--gpus", "2", "--cap", "2",
        "--lease-ttl", "1.5", "--renew-interval", "0.4", "--fence-margin", "0.4",
        "--redis-timeout", "0.3", "--queue-depth", "4", "--queue-wait", "3",
        "--first-fault", "1", "--fault-every", "3", "--pause-extra", "0.5",
        "--faults", "kill9,redis_restart,cutoff", "--long-share", "0", "--settle", "20",
        "--workdir", str(tmp_path / "work"), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(BENCH / "chaos_shared.py"), *args],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.exists(), proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert [f["kind"] for f in report["faults"]] == ["kill9", "redis_restart", "cutoff"]
    over = report["over_cap"]
    assert over["samples"] > 0 and over["streams_opened"] > 0
    # Every engine stream over the cap belongs to a session its gateway had already
    # ended while the engine had not yet noticed (a fenced session mid-sentence); none is
    # a session holding a slot beside `cap` others (docs/reliability.md).
    assert set(over["over_cap_streams_by_cause"]) <= {"ended_session_upstream_lag"}, over
    assert over["redis_over_cap"] == 0 and over["redis_negative_held"] == 0, over
    leaks = report["leaks"]
    assert leaks["leaked"] == 0 and leaks["redis_queue"] == 0, leaks
    assert sum(leaks["sim_sessions"]) == 0 and sum(leaks["sim_streams"]) == 0, leaks
    outcomes = report["sessions"]["by_outcome"]
    assert outcomes.get("ok", 0) > 0
    assert not [o for o in outcomes if o.startswith("client_error")], outcomes
    assert report["reclaim_after_kill9"][0]["reclaim_s"] is not None
    assert report["gateway_exit_codes"] == [0, 0, 0]
    assert report["logs"]["tracebacks"] == 0
