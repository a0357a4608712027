"""Outputs: JSON, CSV, table, summary, config snippet, --write-config, plot, progress, CLI."""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import shutil
import stat
import sys
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from proxy.probe.ceiling import summarize
from proxy.probe.config_edit import ConfigEditError, set_max_sessions, write_max_sessions
from proxy.probe.plot import PlotUnavailable, write_plot
from proxy.probe.probe_command import add_arguments, main, parse_levels, settings_from_args
from proxy.probe.progress import TerminalProgress
from proxy.probe.ramp import LiveFigures
from proxy.probe.report import (
    CSV_COLUMNS,
    config_snippet,
    csv_text,
    format_summary,
    format_table,
    result_json,
)
from proxy.settings import settings_from_mapping
from tests.probe.helpers import recorded_result

ROOT = Path(__file__).resolve().parents[2]
LEVEL_KEYS = {
    "streams", "stalled_streams", "stalled_share", "startup_stalls", "failed_rules",
    "order", "level", "phase", "verdict", "passed", "complete", "worst_1pct", "median_ratio",
    "stream_ratio_min", "stream_ratio_p50", "stream_ratios", "p99_gap_s", "ttfa_p50_s",
    "ttfa_p99_s", "underruns", "stall_s", "throughput", "sessions", "completed", "errors",
    "refusals", "chunks", "hold_s", "finalize_p99_s", "client_lag_p99_s", "details",
}  # fmt: skip


def test_json_is_complete_and_strict() -> None:
    data = result_json(recorded_result())
    text = json.dumps(data, allow_nan=False)  # no NaN or infinity anywhere
    again = json.loads(text)
    assert again["tool"] == "headroom probe" and again["schema"] == 1
    assert (again["ceiling"], again["exact"], again["threshold"]) == (2, True, 1.2)
    assert again["bracket"] == [2, 3] and again["complete"] is True
    assert again["ceiling_range"] == [2, 2] and again["limited_by"] == ["steady"]
    assert again["trials"]["3"] == {"passed": 0, "runs": 1}
    assert again["settings"]["repeats"] == 1
    assert again["kind"] == "tts" and again["protocol"] == "vllm-omni-speech-ws"
    assert again["started_at"].endswith("+00:00")
    assert [row["level"] for row in again["levels"]] == [1, 2, 4, 3]
    assert [row["order"] for row in again["levels"]] == [1, 2, 3, 4]
    for row in again["levels"]:
        assert set(row) == LEVEL_KEYS
        assert isinstance(row["worst_1pct"], float) and isinstance(row["chunks"], int)
    e = again["estimates"]
    assert e["throughput_estimate"] == math.floor(e["peak_throughput"] / 1.2 + 1e-9)
    assert e["rtf_estimate"] == 2  # 2.8x alone / 1.2
    assert set(again["settings"]) >= {"levels", "hold_s", "warmup_s", "seed", "workload"}


def test_csv_has_one_row_per_level() -> None:
    rows = list(csv.DictReader(io.StringIO(csv_text(recorded_result()))))
    assert len(rows) == 4
    assert tuple(rows[0]) == CSV_COLUMNS
    assert [(r["level"], r["verdict"], r["passed"]) for r in rows] == [
        ("1", "pass", "True"),
        ("2", "pass", "True"),
        ("4", "slow", "False"),
        ("3", "slow", "False"),
    ]
    assert float(rows[1]["worst_1pct"]) == pytest.approx(1.46, abs=0.05)
    assert rows[1]["ttfa_p50_s"] == ""  # none in the window: an empty cell, not "None"


def test_table_and_summary() -> None:
    result = recorded_result()
    table = format_table(result).splitlines()
    assert table[0].split()[:4] == ["level", "phase", "verdict", "worst-1%"]
    assert [line.split()[0] for line in table[1:]] == ["1", "2", "4", "3"]
    summary = format_summary(result)
    assert "ceiling: 2 concurrent sessions (worst-1% delivery ratio 1.4" in summary
    assert "at 3; threshold 1.2x)" in summary
    assert "evidence: 2: 1/1 passed, 3: 0/1 passed; range seen 2; limited by steady" in summary
    assert "throughput-based estimate: " in summary and "single-stream RTF 0.35" in summary
    assert "utilisation at the ceiling:" in summary and "took 32 s (4 levels)" in summary
    asr = format_table(recorded_result("asr-c3"))
    assert "TTFT p50" in asr and "text-s/s" in asr


def test_config_snippet_is_a_valid_headroom_replica() -> None:
    snippet = config_snippet(recorded_result(), "tts-main", "gpu0")
    assert snippet.startswith("# headroom probe: vllm-omni-speech-ws at ws://gpu0.example")
    data = yaml.safe_load(snippet)
    replica = data["pools"][0]["replicas"][0]
    assert replica == {"name": "gpu0", "url": "http://gpu0.example:8000", "max_sessions": 2}
    data["routes"] = [
        {"path": "/v1/audio/speech/stream", "pool": "tts-main", "protocol": "vllm-omni-speech-ws"}
    ]
    settings = settings_from_mapping(data, env={})
    assert settings.pools[0].replicas[0].max_sessions == 2


def test_a_ceiling_of_zero_suggests_no_cap() -> None:
    result = recorded_result()
    slow = [replace(r.stats, passed=False, verdict="slow") for r in result.runs]
    zero = replace(result, summary=summarize(slow, 100.0))
    assert zero.summary.ceiling == 0
    snippet = config_snippet(zero, "tts-main", "gpu0")
    assert "max_sessions:" not in snippet  # used to say max_sessions: 1
    assert "ceiling 0 - not even one session kept 1.2x realtime" in snippet
    assert yaml.safe_load(snippet) is None  # comments only


def test_write_config_changes_only_the_value(tmp_path: Path) -> None:
    path = tmp_path / "single-gpu.yaml"
    shutil.copy(ROOT / "config" / "single-gpu.yaml", path)
    path.chmod(0o640)
    before = path.read_text()
    old = write_max_sessions(path, "tts-main", "gpu0", 11)
    after = path.read_text()
    assert old == "8"
    pairs = zip(before.splitlines(), after.splitlines(), strict=True)
    changed = [(a, b) for a, b in pairs if a != b]
    assert changed == [("        max_sessions: 8", "        max_sessions: 11")]
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert not [p for p in tmp_path.iterdir() if p.name != "single-gpu.yaml"]  # no temp left


def test_write_config_in_flow_style_and_errors() -> None:
    text = (
        "pools:\n  - name: tts\n    replicas:\n"
        '      - {name: gpu0, url: "http://a:1", max_sessions: 12}   # keep me\n'
        '      - {name: gpu1, url: "http://b:1", max_sessions: 12}\n'
    )
    new, old = set_max_sessions(text, "tts", "gpu1", 7)
    assert old == "12" and "max_sessions: 7}\n" in new and "# keep me" in new
    assert yaml.safe_load(new)["pools"][0]["replicas"][0]["max_sessions"] == 12
    with pytest.raises(ConfigEditError, match=r"no pool named 'asr' \(found: tts\)"):
        set_max_sessions(text, "asr", "gpu0", 3)
    with pytest.raises(ConfigEditError, match=r"no replica named 'gpu9' \(found: gpu0, gpu1\)"):
        set_max_sessions(text, "tts", "gpu9", 3)
    with pytest.raises(ConfigEditError, match="must be >= 1"):
        set_max_sessions(text, "tts", "gpu0", 0)
    with pytest.raises(ConfigEditError, match="no max_sessions"):
        set_max_sessions("pools: [{name: p, replicas: [{name: r}]}]", "p", "r", 3)


def test_write_config_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "headroom.yaml"
    path.write_text("pools:\n  - name: tts\n    replicas: [\n")
    with pytest.raises(ConfigEditError) as caught:
        write_max_sessions(path, "tts", "gpu0", 3)
    assert f'in "{path}", line 4' in str(caught.value)
    assert "<unicode string>" not in str(caught.value)
    path.write_text("pools: [{name: tts, replicas: [{name: gpu0, max_sessions: 2}]}]\n")
    with pytest.raises(ConfigEditError, match=f"{path}: no pool named 'asr'"):
        write_max_sessions(path, "asr", "gpu0", 3)


def test_write_config_warns_before_the_run_when_the_replica_points_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A copied example still points gpu0 at the old engine; the probe measures another
    # one (here: a closed port, so the run ends at its pre-flight with status 1).
    path = tmp_path / "headroom.yaml"
    shutil.copy(ROOT / "config" / "single-gpu.yaml", path)
    configured = yaml.safe_load(path.read_text())["pools"][0]["replicas"][0]["url"]
    base = ["--protocol", "vllm-omni-speech-ws", "--quiet", "--write-config", str(path),
            "--pool", "tts-main", "--replica", "gpu0"]  # fmt: skip
    assert main(["--target", "http://127.0.0.1:9", *base]) == 1
    err = capsys.readouterr().err
    assert f"points tts-main/gpu0 at {configured}, but this run measures http://127.0.0.1:9" in err
    assert "--write-config sets max_sessions only" in err
    path.write_text(path.read_text().replace(configured, "http://127.0.0.1:9"))
    assert main(["--target", "http://127.0.0.1:9", *base]) == 1  # the same engine
    assert "points tts-main/gpu0" not in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot_is_written(tmp_path: Path, suffix: str) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / f"probe{suffix}"
    write_plot(recorded_result(), out)
    data = out.read_bytes()
    if suffix == ".png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    else:
        root = ET.fromstring(data)
        assert root.tag.endswith("svg")
        assert "ceiling 2" in data.decode()


def test_plot_without_matplotlib_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotUnavailable, match=r"pip install 'headroom-proxy\[plot\]'"):
        write_plot(recorded_result(), tmp_path / "p.png")
    with pytest.raises(PlotUnavailable, match=r"png or \.svg"):
        write_plot(recorded_result(), tmp_path / "p.jpg")


def test_progress_on_a_terminal_and_in_a_log() -> None:
    result = recorded_result()
    stats = result.summary.levels[0]
    tty = io.StringIO()
    progress = TerminalProgress(tty, tty=True, width=10)
    progress.level_started(1, "ramp", 1.5, 4.0)
    progress.tick(LiveFigures(3.0, 1, 7, 2.8, 2.82, 0, 0))
    progress.level_done(stats)
    assert "\rlevel    1 ramp   [#####.....]  55% hold    open   1  chunks     7" in tty.getvalue()
    assert "worst-1%  2.800  median  2.82" in tty.getvalue()
    assert tty.getvalue().endswith("refused 0\x1b[K\n")
    log = io.StringIO()
    progress = TerminalProgress(log, tty=False)
    progress.level_started(1, "ramp", 1.5, 4.0)
    progress.tick(LiveFigures(3.0, 1, 7, 2.8, 2.82, 0, 0))
    progress.level_done(stats)
    progress.note("done")
    lines = log.getvalue().splitlines()
    assert lines[0] == "level    1 (ramp): 1 sessions, warm-up 1.5 s, hold 4 s"
    assert lines[1].startswith("level    1 ramp   pass") and "\r" not in log.getvalue()
    assert lines[2] == "headroom probe: done"


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_parse_levels() -> None:
    assert parse_levels("1,2,4,8,16,...") == ((1, 2, 4, 8, 16), True)
    assert parse_levels(" 3, 5 ") == ((3, 5), False)
    for bad in ("", "...", "0,1", "a,b"):
        with pytest.raises(ValueError, match="--levels"):
            parse_levels(bad)


def test_settings_from_args() -> None:
    s = settings_from_args(
        args(
            "--target", "gpu0:8000", "--protocol", "vllm-realtime", "--levels", "2,4",
            "--header", "Authorization: Bearer k", "--asr-pace", "2", "--seed", "9",
        )
    )  # fmt: skip
    assert s.client.url == "ws://gpu0:8000/v1/realtime"
    assert s.client.headers == (("Authorization", "Bearer k"),)
    assert (s.levels, s.extend, s.seed, s.kind, s.client.asr_pace) == ((2, 4), False, 9, "asr", 2)
    https = settings_from_args(args("--target", "https://h/custom", "--protocol", "vllm-realtime"))
    assert https.client.url == "wss://h/custom"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--levels", "0"], "--levels"),
        (["--workload", "asr"], "carries TTS but the workload bundled:asr is ASR"),
        (["--write-config", "x.yaml"], "--write-config needs --pool and --replica"),
        (["--plot", "p.jpg"], "writes .png or .svg"),
        (["--header", "nocolon"], "--header must look like"),
        (["--hold", "0"], "must be > 0"),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--target", "http://127.0.0.1:9", "--protocol", "openai-speech-http"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_unreachable_target_exits_1_with_a_clear_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = main(
        ["--target", "http://127.0.0.1:9", "--protocol", "vllm-omni-speech-ws", "--quiet"]
    )
    err = capsys.readouterr().err
    assert status == 1
    assert "pre-flight session against ws://127.0.0.1:9/v1/audio/speech/stream" in err
    assert "Check --target, --protocol" in err


def test_summary_warns_when_the_client_itself_lagged() -> None:
    result = recorded_result()
    levels = list(result.summary.levels)
    levels[2] = replace(levels[2], client_lag_p99_s=0.12)
    busy = replace(result, summary=replace(result.summary, levels=tuple(levels)))
    assert "event loop lagged 120 ms (p99) at level 4" in format_summary(busy)
    assert "lagged" not in format_summary(result)
