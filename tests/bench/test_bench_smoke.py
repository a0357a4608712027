"""Smoke tests of the relay benchmarks: they run end to end in their quickest mode
(direct + Headroom; nginx is left out) and write well-formed JSON. Nothing here asserts
on timings: the machines are shared and noisy."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from proxy.settings import settings_from_mapping

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str) -> ModuleType:
    if f"bench_{name}" in sys.modules:
        return sys.modules[f"bench_{name}"]
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _run(script: str, out: Path, *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def test_relay_quick_writes_wellformed_json(tmp_path: Path) -> None:
    result = _run(
        "relay.py", tmp_path / "relay.json", "--targets", "direct,headroom", "--rounds", "2",
        "--load-wait", "0", "--markdown", str(tmp_path / "relay.md"),
    )  # fmt: skip
    assert result["benchmark"] == "relay"
    assert {"nproc", "cpu_model", "kernel", "python", "uvicorn"} <= result["machine"].keys()
    # the Headroom target ran from its own copy of the checkout, interpreted
    assert result["trees"]["headroom"]["build"].startswith("per-chunk modules interpreted")
    # two rounds, the targets' order reversed in the second
    assert [(c["round"], c["target"]) for c in result["cells"]] == [
        (0, "direct"), (0, "headroom"), (1, "headroom"), (1, "direct"),
    ]  # fmt: skip
    cells = {c["target"]: c for c in result["cells"] if c["round"] == 0}
    for cell in result["cells"]:
        assert cell["connected"] == cell["sessions"] == 20
        assert cell["chunks"] > 0
        for key in ("p50", "p99"):
            assert _finite(cell["latency_ms"][key])
            assert _finite(cell[f"added_{key}_ms"])
        assert _finite(cell["chunks_per_s"])
        assert _finite(cell["machine_busy"])
        assert len(cell["load_before"]) == len(cell["load_after"]) == 3
        assert _finite(cell["busy_before"]) and _finite(cell["busy_after"])
        assert isinstance(cell["noisy"], list)
    headroom = cells["headroom"]
    for key in (
        "relay_cpu_us_per_chunk",
        "relay_cpu_cores",
        "setup_cpu_ms_per_session",
        "mem_kb_per_session",
        "mem_kb_per_session_connected",
    ):
        assert _finite(headroom[key]), key
    assert cells["direct"]["relay_cpu_us_per_chunk"] is None  # no relay process
    # the meter counted the relayed chunks (a meter that saw none reads 0)
    assert headroom["metered_audio_ratio"] > 0.5
    assert cells["direct"]["metered_audio_ratio"] is None
    # --quick measures two connect bursts; the set-up figure is their median
    bursts = headroom["setup_cpu_ms_per_session_bursts"]
    assert len(bursts) == len(headroom["connect_seconds_bursts"]) == 2
    assert all(_finite(x) and x > 0 for x in bursts)
    assert headroom["setup_cpu_ms_per_session"] == pytest.approx(sum(bursts) / 2, abs=2e-3)
    assert cells["direct"]["setup_cpu_ms_per_session_bursts"] == []
    assert result["config"]["setup_bursts"] == 2
    summary = {r["target"]: r for r in result["summary"]}
    assert summary["headroom"]["rounds"] == 2
    assert summary["headroom"]["relay_cpu_us_per_chunk"]["n"] == 2
    assert summary["headroom"]["relay_cpu_us_per_chunk_x_nginx"]["n"] == 0  # no nginx
    checks = {c["name"] for c in result["checks"]}
    assert "set-up ms per session" in checks and "CPU per chunk x nginx" not in checks
    report = (tmp_path / "relay.md").read_text()
    assert "| 20 | 40 ms | headroom | 2 (" in report
    assert "### The machine around each cell" in report


def test_reject_storm_quick_writes_wellformed_json(tmp_path: Path) -> None:
    result = _run("reject_storm.py", tmp_path / "storm.json")
    assert result["benchmark"] == "reject_storm"
    assert [w["window"] for w in result["windows"]] == ["before", "storm", "after"]
    for window in result["windows"]:
        assert _finite(window["gap_ms"]["p99"])
        assert window["sessions_alive"] == result["config"]["active"]
    storm = result["windows"][1]["storm"]
    assert storm["attempts"] > 0
    assert result["refused"] == storm["outcomes"].get("503", 0) > 0
    assert set(storm["outcomes"]) <= {"503", "timeout"}  # nobody was admitted past the cap
    assert _finite(result["gap_p99_moved_ms"])


def test_generated_headroom_config_is_valid() -> None:
    import yaml

    harness = _load("harness")
    text = harness.headroom_config(8080, 9000, 1016, "vllm-omni-speech-ws")
    settings = settings_from_mapping(yaml.safe_load(text))
    assert settings.log_level == "warning"
    assert settings.pools[0].replicas[0].max_sessions == 1016
    assert settings.pools[0].queue.max_depth == 0
    assert settings.routes[0].path == harness.ROUTE_PATH


def test_frame_parser_reassembles_split_frames() -> None:
    wsload = _load("wsload")
    payload = (123456789).to_bytes(8, "little") + bytes(9592)
    wire = (wsload.frame_header(2, len(payload)) + payload) * 3 + wsload.client_frame(1, b"hi")
    seen: list[tuple[bool, int, bytes]] = []
    parser = wsload.FrameParser(lambda fin, op, data, key: seen.append((fin, op, bytes(data))))
    for i in range(0, len(wire), 1000):  # arbitrary TCP segmentation
        parser.feed(wire[i : i + 1000])
    assert [(fin, op) for fin, op, _ in seen] == [(True, 2)] * 3 + [(True, 1)]
    assert all(data == payload for _, op, data in seen if op == 2)
    assert seen[-1][2] == b"hi"  # the all-zero mask leaves the payload as it is


@pytest.mark.parametrize(("q", "expected"), [(50, 50.0), (99, 99.0), (100, 100.0), (0.1, 1.0)])
def test_percentile_is_nearest_rank_in_ms(q: float, expected: float) -> None:
    harness = _load("harness")
    ordered = [i * 1_000_000 for i in range(1, 101)]  # 1..100 ms
    assert harness.percentile(ordered, q) == expected
    assert harness.percentile([], q) is None


def test_profile_summary_folds_lines_into_functions(tmp_path: Path) -> None:
    raw = tmp_path / "prof.raw"
    raw.write_text(
        "run (a.py:1);send (b.py:10) 3\n"
        "run (a.py:1);send (b.py:12) 1\n"
        "run (a.py:2);meter (c.py:5) 4\n"
    )
    total, own, inclusive = _load("profile_summary").summarise(raw)
    assert total == 8
    assert own == {"send (b.py)": 4, "meter (c.py)": 4}
    assert inclusive["run (a.py)"] == 8


def test_admission_redis_bench_quick(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:  # .ci/run installs it
        message = "redis-server is not installed (Debian: apt-get install redis-server)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must provide it")
        pytest.skip(message)
    rows = _run("admission_redis.py", tmp_path / "admission.json")
    assert [row["backend"] for row in rows][:2] == ["memory", "redis"]
    for row in rows:
        assert row["sessions"] > 0 and row["acquire_p50_us"] > 0
        assert math.isfinite(row["gateway_cpu_us_per_session"])


def test_setup_instructions_reads_the_dumps_total_and_cleans_up(tmp_path: Path) -> None:
    bench = _load("setup_instructions")
    out = tmp_path / "callgrind.out"
    out.write_text("# callgrind format\nsummary: 0\n")  # the file written at exit
    (tmp_path / "callgrind.out.1").write_text("events: Ir\nsummary: 0\ntotals: 123456\n")
    assert bench._counted(out, tmp_path / "log") == 123456
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="no dump"):
        bench._counted(out, tmp_path / "log")


def test_setup_instructions_counts_a_session_under_callgrind(tmp_path: Path) -> None:
    if shutil.which("valgrind") is None:  # .ci/run installs it
        message = "valgrind is not installed (Debian: apt-get install valgrind)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must provide it")
        pytest.skip(message)
    out = tmp_path / "ir.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "setup_instructions.py"), "--sessions", "10",
         "--tree", str(BENCH.parent), "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (result,) = json.loads(out.read_text())
    assert result["sessions"] == 10
    # a session's set-up is hundreds of thousands of instructions, not a handful
    assert 50_000 < result["instructions_per_session"] < 50_000_000
    assert "instructions per session" in proc.stdout


def test_http_protocol_cost_runs_every_server_kind() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/http_protocol_cost.py", "--streams", "2", "--chunks", "20",
         "--rounds", "1"],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for kind in ("httptools", "h11", "listener"):
        assert f"  {kind} " in proc.stdout, proc.stdout


def test_meter_memory_prints_each_checkpoint_and_the_sketches_give_memory_back() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "meter_memory.py"), "--sessions", "20"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    per_session = {
        int(line.split()[0]): float(line.split(":")[1].split()[0])
        for line in proc.stdout.splitlines()
    }
    assert sorted(per_session) == [100, 300, 1500]
    # the exact samples are freed when the sketches turn to histograms, and a minute's
    # stream holds less than the exact phase did
    assert 0 < per_session[1500] < per_session[100]


def test_connect_ab_both_ways_swaps_the_sides_and_combines_the_medians(tmp_path: Path) -> None:
    tree = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(BENCH / "connect_ab.py"), "--a", str(tree), "--b", str(tree),
         "--sessions", "6", "--rounds", "1", "--client-procs", "1", "--concurrency", "3",
         "--stream-windows", "1", "--window", "0.5", "--both-ways"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("B/A CPU per chunk per window") == 2, proc.stdout
    assert f"{tree} against {tree}, both ways:" in proc.stdout
    combined = proc.stdout.split("both ways:")[1]
    assert "set-up" in combined and "CPU per chunk" in combined


def test_connect_ab_both_ways_is_the_geometric_mean_of_the_two_runs() -> None:
    ab = _load("connect_ab")
    text = ab.both_ways(ab.Medians(1.1, 0.96), ab.Medians(0.9, 1.08), "X", "Y")
    lines = text.splitlines()
    assert lines[0] == "Y against X, both ways:"
    assert lines[1].split()[1] == f"{math.sqrt(1.1 / 0.9):.3f}"
    assert lines[2].split()[3] == f"{math.sqrt(0.96 / 1.08):.3f}"
    # without stream windows only the set-up is combined
    assert len(ab.both_ways(ab.Medians(1.0), ab.Medians(1.0), "X", "Y").splitlines()) == 2
