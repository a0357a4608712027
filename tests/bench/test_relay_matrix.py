"""bench/relay.py's rounds and report, on canned cells: the rotation of the targets, the
median and range over rounds, the ratios taken within each round, the issue's targets
and the Markdown table. Pure functions; nothing is run or timed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from proxy.settings import settings_from_mapping

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _relay() -> ModuleType:
    if "bench_relay" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_relay", BENCH / "relay.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)  # puts bench/ on sys.path for its helpers
    return sys.modules["bench_relay"]


def _matrix() -> ModuleType:
    _relay()
    return sys.modules["relay_matrix"]


def _cell(target: str, r: int, cpu: float | None, setup: float | None, mem: float | None,
          n: int = 500, pacing: float = 40.0, **extra: Any) -> dict[str, Any]:  # fmt: skip
    cell: dict[str, Any] = {
        "target": target, "round": r, "sessions": n, "pacing_ms": pacing,
        "relay_cpu_us_per_chunk": cpu, "setup_cpu_ms_per_session": setup,
        "mem_kb_per_session": mem, "added_p50_ms": 0.1, "added_p99_ms": 0.5,
        "latency_ms": {"p50": 0.3, "p99": 1.0}, "delivered_ratio": 1.0,
        "load_before": [0.4, 0.3, 0.2], "noisy": [],
    }  # fmt: skip
    cell.update(extra)
    return cell


CELLS = [
    # round 0: nginx 32, compiled 30 (0.9375x), baseline compiled 31
    _cell("nginx", 0, 32.0, 0.036, 17.6),
    _cell("headroom-compiled", 0, 30.0, 0.30, 18.0),
    _cell("baseline-compiled", 0, 31.0, 0.31, 18.5),
    # round 1: nginx 30, compiled 33 (1.1x), baseline compiled 30; this round was noisy
    _cell("nginx", 1, 30.0, 0.040, 17.6, noisy=["load 1.40 >= 1"]),
    _cell("headroom-compiled", 1, 33.0, 0.40, 21.0, noisy=["load 1.40 >= 1"]),
    _cell("baseline-compiled", 1, 30.0, 0.32, 18.4, noisy=["load 1.40 >= 1"]),
    # round 2: nginx 34, compiled 31.5, baseline compiled 32
    _cell("nginx", 2, 34.0, 0.038, 17.6),
    _cell("headroom-compiled", 2, 31.5, 0.33, 19.0),
    _cell("baseline-compiled", 2, 32.0, 0.34, 19.5),
]


@pytest.mark.parametrize(
    ("round_index", "order"),
    [(0, "ABCD"), (1, "DCBA"), (2, "BCDA"), (3, "ADCB"), (4, "CDAB"), (8, "ABCD"), (9, "DCBA")],
)
def test_targets_rotate_one_place_a_pair_of_rounds_the_second_reversed(
    round_index: int, order: str
) -> None:
    assert "".join(_matrix().rotated(list("ABCD"), round_index)) == order
    assert _matrix().rotated([], round_index) == []


@pytest.mark.parametrize("rounds", [2, 3, 4, 6])
def test_every_pair_of_targets_runs_in_both_orders(rounds: int) -> None:
    targets = ["direct", "nginx", "headroom", "headroom-compiled", "baseline", "baseline-compiled"]
    before: dict[tuple[str, str], int] = {}
    for r in range(rounds):
        order = _matrix().rotated(targets, r)
        assert sorted(order) == sorted(targets)
        for i, a in enumerate(order):
            for b in order[i + 1 :]:
                before[a, b] = before.get((a, b), 0) + 1
    for i, a in enumerate(targets):
        for b in targets[i + 1 :]:
            assert before.get((a, b), 0) >= rounds // 2, (a, b)
            assert before.get((b, a), 0) >= rounds // 2, (b, a)


def test_spread_is_median_and_range_of_the_measured() -> None:
    s = _matrix().spread([3.0, None, 1.0, 2.0, 10.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 10.0, 4)
    assert _matrix().spread([None])["median"] is None


def test_summary_takes_ratios_within_each_round() -> None:
    rows = {r["target"]: r for r in _matrix().summarize(CELLS)}
    assert list(rows) == ["nginx", "headroom-compiled", "baseline-compiled"]
    h = rows["headroom-compiled"]
    assert (h["rounds"], h["noisy_rounds"]) == (3, 1)
    assert h["relay_cpu_us_per_chunk"]["median"] == 31.5
    assert (h["relay_cpu_us_per_chunk"]["min"], h["relay_cpu_us_per_chunk"]["max"]) == (30.0, 33.0)
    # per round 30/32, 33/30, 31.5/34: not the ratio of the medians (31.5/32)
    x = h["relay_cpu_us_per_chunk_x_nginx"]
    assert x["values"] == pytest.approx([30 / 32, 33 / 30, 31.5 / 34])
    assert x["median"] == pytest.approx(30 / 32)
    assert h["cpu_x_baseline"]["values"] == pytest.approx([30 / 31, 33 / 30, 31.5 / 32])
    assert rows["nginx"]["relay_cpu_us_per_chunk_x_nginx"]["n"] == 0
    assert rows["baseline-compiled"]["cpu_x_baseline"]["n"] == 0


def test_targets_judge_the_median_and_count_the_rounds() -> None:
    matrix = _matrix()
    checks = matrix.targets_met(matrix.summarize(CELLS), {"cpu_x_baseline": 1.02})
    by = {(c["name"], c["target"]): c for c in checks}
    cpu = by[("CPU per chunk x nginx", "headroom-compiled")]
    assert cpu["ok"] is True and cpu["rounds_within"] == 2 and cpu["limit"] == 1.0
    setup = by[("set-up ms per session", "headroom-compiled")]
    assert setup["median"] == 0.33 and setup["ok"] is True and setup["rounds_within"] == 2
    mem = by[("KB per streaming session", "headroom-compiled")]
    assert mem["median"] == 19.0 and mem["ok"] is True and mem["rounds_within"] == 2
    base = by[("CPU per chunk x baseline", "headroom-compiled")]
    assert base["median"] == pytest.approx(31.5 / 32) and base["ok"] is True
    assert base["limit"] == 1.02
    # nginx and the baseline are measured, not judged
    assert {c["target"] for c in checks} == {"headroom-compiled"}


def test_a_fall_behind_is_not_judged_as_memory() -> None:
    matrix = _matrix()
    behind = [*CELLS[:7], _cell("headroom-compiled", 2, 31.5, 0.33, 90.0, delivered_ratio=0.6)]
    checks = matrix.targets_met(matrix.summarize(behind))
    names = {c["name"] for c in checks if c["target"] == "headroom-compiled"}
    assert "KB per streaming session" not in names
    assert "set-up ms per session" in names


def test_markdown_table_gives_median_range_and_verdicts() -> None:
    matrix = _matrix()
    rows = matrix.summarize(CELLS)
    checks = matrix.targets_met(rows)
    text = matrix.summary_markdown(rows, checks)
    assert (
        "| 500 | 40 ms | headroom-compiled | 3 (1) | 31.5 (30.0-33.0) | 0.330 (0.300-0.400) "
        "| 19.0 (18.0-21.0) |" in text
    )
    assert "| CPU per chunk x nginx | headroom-compiled | 500x40ms | 0.938 | 0.926-1.100 " in text
    assert "| 2 of 3 | 1 | yes |" in text
    failing = matrix.targets_met(rows, {"setup_ms": 0.31})
    assert (
        "| set-up ms per session | headroom-compiled | 500x40ms | 0.330 | 0.300-0.400 "
        "| 1 of 3 | 0.31 | **NO** |" in matrix.summary_markdown(rows, failing)
    )


def test_load_table_and_report_name_the_noisy_cells() -> None:
    relay = _relay()
    cells = [
        dict(c, other_cpu_cores=0.1, busy_before=0.05, busy_after=0.5, load_waited_s=0.0,
             load_after=[0.5, 0.3, 0.2],
             setup_cpu_ms_per_session_bursts=[c["setup_cpu_ms_per_session"]])
        for c in CELLS
    ]  # fmt: skip
    load = _matrix().load_markdown(cells)
    assert (
        "| 2 | 500x40ms | headroom-compiled | 0.40/0.30/0.20 | 0.50/0.30/0.20 | 5% | 50% "
        "| 0.10 | 0 | load 1.40 >= 1 |" in load
    )
    rows = _matrix().summarize(cells)
    result = {
        "config": {"targets": ["nginx", "headroom-compiled", "baseline-compiled"],
                   "cells": [[500, 40.0]], "rounds": 3, "max_load": 1.0, "load_wait_s": 60.0,
                   "max_other_cores": 0.3},
        "machine": {"nproc": 2, "cpu_model": "x", "nginx": "1.22.1", "python": "3.11"},
        "load_start": [0.4, 0.3, 0.2], "load_end": [0.5, 0.3, 0.2], "elapsed_s": 10.0,
        "trees": {"headroom-compiled": {"revision": "abc", "build": "compiled 9 of 9"}},
        "summary": rows, "checks": _matrix().targets_met(rows), "cells": cells,
    }  # fmt: skip
    for c in cells:
        c.update(chunks_per_s=12500.0, relay_cpu_us_per_chunk_stat=c["relay_cpu_us_per_chunk"],
                 relay_sys_share=0.5, relay_cpu_cores=0.4, mem_kb_per_session_connected=15.0,
                 metered_audio_ratio=1.0)  # fmt: skip
    text = relay.markdown(result)
    assert "Noisy cells: 3 of 9" in text
    assert "load average 1/5/15 at start 0.40/0.30/0.20" in text
    assert "- `headroom-compiled`: abc, compiled 9 of 9" in text
    assert "Metered audio differs" not in text
    cells[1]["metered_audio_ratio"] = 0.0  # a meter that saw none of the relayed chunks
    assert "Metered audio differs from relayed audio** in: headroom-compiled r1 (0.0)" in (
        relay.markdown(result)
    )


def test_default_matrix_is_the_issues_and_options_override_it() -> None:
    relay = _relay()
    args = relay.parse_args([])
    assert args.cells == [(500, 40.0), (1000, 200.0)]
    assert (args.rounds, args.max_load, args.load_wait) == (3, 1.0, 60.0)
    assert relay._wanted(args) == ["direct", "nginx", "headroom", "headroom-compiled"]
    assert relay.parse_args(["--sessions", "100"]).cells == [(100, 40.0), (100, 200.0)]
    assert relay.parse_args(["--sessions", "500", "--pacing-ms", "40"]).cells == [(500, 40.0)]
    quick = relay.parse_args(["--quick"])
    assert (quick.cells, quick.rounds) == ([(20, 40.0)], 1)
    assert relay.parse_args(["--quick", "--rounds", "2"]).rounds == 2
    with_base = relay.parse_args(["--baseline", "HEAD~1"])
    assert relay._wanted(with_base)[-2:] == ["baseline", "baseline-compiled"]
    with pytest.raises(SystemExit, match="needs --baseline"):
        relay._wanted(relay.parse_args(["--targets", "baseline-compiled"]))


def test_warmup_reaches_the_histogram_phase_where_it_fits() -> None:
    relay = _relay()
    args = relay.parse_args([])
    assert relay.warmup_seconds(args, 40.0) == pytest.approx(520 * 0.04)
    assert relay.warmup_seconds(args, 200.0) == args.warmup  # would take 104 s


def test_noisy_says_why() -> None:
    relay = _relay()
    args = relay.parse_args([])
    cell = {"load_before": [1.4, 1.0, 0.5], "other_cpu_cores": 0.5}
    assert relay._noisy(args, {"quiet": False}, cell) == ["load 1.40 >= 1", "other load 0.50 cores"]
    assert relay._noisy(args, {"quiet": True}, {**cell, "other_cpu_cores": 0.1}) == []


def test_admin_listener_edit_keeps_the_configuration_valid() -> None:
    _relay()
    harness, trees = sys.modules["harness"], sys.modules["relay_trees"]
    text = trees.enable_admin(harness.headroom_config(8080, 9000, 516, "vllm-omni-speech-ws"), 9901)
    settings = settings_from_mapping(yaml.safe_load(text))
    assert settings.admin.enabled and settings.admin.port == 9901
    assert settings.admin.host == "127.0.0.1"
    with pytest.raises(RuntimeError, match="not once"):
        trees.enable_admin(text, 9902)


def test_cpu_accountings_that_disagree_are_named() -> None:
    _relay()
    report = sys.modules["relay_report"]
    agree = {"target": "nginx", "round": 0, "relay_cpu_us_per_chunk": 30.0,
             "relay_cpu_us_per_chunk_stat": 31.0, "relay_cpu_ticks": 250}  # fmt: skip
    exited = {**agree, "target": "headroom", "relay_cpu_us_per_chunk_stat": 36.0}
    too_few_ticks = {**exited, "target": "headroom-compiled", "relay_cpu_ticks": 12}
    assert report.accounting_gaps([agree, exited, too_few_ticks]) == [
        "headroom r1 (30.0 / 36.0 us)"
    ]
