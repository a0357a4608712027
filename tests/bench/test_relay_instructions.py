"""bench/relay_instructions.py's reading of callgrind and perf output and its table, on
canned text. Pure functions; nothing is run or timed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

PROFILE = """# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 22389
cmd:  python -m proxy serve --config h.yaml
part: 1

positions: line
events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw
summary: 18446744073680036789


totals: 268545191 148570102 126561304 5870169 2416872 1173634 525 4056 6109
"""


def _bench() -> ModuleType:
    if "bench_relay_instructions" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "bench_relay_instructions", BENCH / "relay_instructions.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_relay_instructions"]


def test_profile_totals_are_read_by_event_name_not_the_summary_line() -> None:
    counts = _bench().parse_profile(PROFILE)
    assert counts["Ir"] == 268545191
    assert counts["D1mr"] == 2416872
    assert counts["DLmw"] == 6109
    assert len(counts) == 9


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("events: Ir\n", "no events/totals"),
        ("totals: 5\n", "no events/totals"),
        ("events: Ir Dr\ntotals: 5\n", "2 events but 1 totals"),
    ],
)
def test_a_profile_without_matching_events_and_totals_is_refused(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        _bench().parse_profile(text)


def test_perf_count_is_read_by_event_name() -> None:
    text = (
        "241234,,raw_syscalls:sys_enter,15000000000,100.00,,\n"
        "1744.12,msec,task-clock,1744120000,100.00,0.116,CPUs utilized\n"
    )
    assert _bench().parse_perf_count(text, "raw_syscalls:sys_enter") == 241234
    with pytest.raises(ValueError, match="no 'cycles'"):
        _bench().parse_perf_count(text, "cycles")
    with pytest.raises(ValueError, match="no 'raw_syscalls:sys_enter'"):
        _bench().parse_perf_count("<not counted>,,raw_syscalls:sys_enter,0,0,,\n",
                                  "raw_syscalls:sys_enter")  # fmt: skip


def _cell(
    target: str, ir: float | None, syscalls: float | None, behind: bool = False
) -> dict[str, Any]:
    per_chunk = {}
    if ir is not None:
        per_chunk["Ir"] = ir
    if syscalls is not None:
        per_chunk["syscalls"] = syscalls
    return {"target": target, "sessions": 20, "pacing_ms": 40.0, "revision": "x",
            "chunks": 100, "fell_behind": behind, "per_chunk": per_chunk}  # fmt: skip


def test_the_two_passes_of_a_cell_merge_into_one_row() -> None:
    rows = _bench().merge([
        _cell("headroom-compiled", 20000.0, None),
        _cell("headroom-compiled", None, 2.1, behind=True),
        _cell("baseline-compiled", 19000.0, None),
    ])  # fmt: skip
    assert len(rows) == 2
    assert rows[0]["per_chunk"] == {"Ir": 20000.0, "syscalls": 2.1}
    assert rows[0]["fell_behind"] is True
    assert rows[1]["per_chunk"] == {"Ir": 19000.0}


def test_table_gives_the_ratio_to_the_same_build_of_the_baseline() -> None:
    rows = [_cell("headroom-compiled", 20000.0, 2.1), _cell("baseline-compiled", 16000.0, 2.0),
            _cell("headroom", 90000.0, 2.1, behind=True)]  # fmt: skip
    table = _bench().report(rows, {"headroom-compiled": "baseline-compiled",
                                   "headroom": "baseline"})  # fmt: skip
    lines = table.splitlines()
    assert lines[0] == (
        "| target | sessions x pacing | Ir/chunk | syscalls/chunk | x baseline Ir/chunk | behind |"
    )
    assert lines[1].count("|") == lines[0].count("|")
    assert "| headroom-compiled | 20 x 40 ms | 20,000.0 | 2.1 | 1.2500 |  |" in lines
    assert "| baseline-compiled | 20 x 40 ms | 16,000.0 | 2.0 |  |  |" in lines
    # no baseline of its build in the run: no ratio; a relay that fell behind is marked
    assert "| headroom | 20 x 40 ms | 90,000.0 | 2.1 |  | yes |" in lines


def test_cells_must_pair_sessions_with_pacing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _bench().parse_args(["--sessions", "20", "500", "--pacing-ms", "40"])
    assert "one --pacing-ms value per --sessions value" in capsys.readouterr().err
