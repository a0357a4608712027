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
from typing import Any

import pytest
import yaml

from proxy.probe.analysis import LevelWindow, SessionTrace
from proxy.probe.config_edit import ConfigEditError, set_max_sessions, write_max_sessions
from proxy.probe.plot import PlotUnavailable, figure, write_plot
from proxy.probe.probe_command import (
    _outputs,
    add_arguments,
    main,
    parse_levels,
    settings_from_args,
)
from proxy.probe.progress import TerminalProgress
from proxy.probe.ramp import LiveFigures, ProbeResult
from proxy.probe.report import (
    CSV_COLUMNS,
    config_snippet,
    csv_text,
    format_summary,
    format_table,
    result_json,
)
from proxy.settings import settings_from_mapping
from tests.probe.helpers import (
    queued_level,
    recorded_result,
    result_of,
    steady,
    tts_trace,
)

ROOT = Path(__file__).resolve().parents[2]
LEVEL_KEYS = {
    "streams", "stalled_streams", "stalled_share", "startup_stalls", "failed_rules",
    "order", "level", "phase", "verdict", "passed", "complete", "worst_1pct", "median_ratio",
    "stream_ratio_min", "stream_ratio_p50", "stream_ratios", "p99_gap_s", "ttfa_p50_s",
    "ttfa_p99_s", "wait_p99_s", "engine_ttfa_p99_s", "ttfa_cause", "underruns", "stall_s",
    "throughput", "sessions", "completed", "errors", "refusals", "chunks", "hold_s",
    "finalize_p99_s", "client_lag_p99_s", "details",
}  # fmt: skip


def test_json_is_complete_and_strict() -> None:
    data = result_json(recorded_result())
    text = json.dumps(data, allow_nan=False)  # no NaN or infinity anywhere
    again = json.loads(text)
    assert again["tool"] == "headroom probe" and again["schema"] == 1
    assert (again["ceiling"], again["exact"], again["threshold"]) == (2, True, 1.2)
    assert again["bracket"] == [2, 3] and again["complete"] is True
    assert again["ceiling_range"] == [2, 2] and again["limited_by"] == ["steady"]
    assert again["limited_by_queue"] is False
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
    assert "< 1.2x at 3; threshold 1.2x)" in summary
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


def _one(*traces: SessionTrace) -> ProbeResult:
    """A run of one level (1 session, window [10, 40]) with these traces."""
    return result_of([(LevelWindow(1, 0.0, 10.0, 40.0), list(traces))])


#: Level 1 alone, failing one rule each: (traces, the summary's words, the advice's).
ZERO: dict[str, tuple[list[SessionTrace], str, str]] = {
    "steady": (
        [steady(11.0, 11.5, 2.0, 2.0, 12, opened=11.0)],  # 1.0x
        "one session already fails: worst-1% 1.000x < 1.2x",
        "not even one session kept 1.2x realtime: serve this model on a faster GPU",
    ),
    "stalls": (
        # a 0.32 s first chunk, then full ones: the 0.2 s prebuffer runs dry at the seam
        [
            tts_trace(
                11.0, [(11.5, 0.32)] + [(12.3 + 1.25 * i, 2.0) for i in range(12)], opened=11.0
            )
        ],
        "one session already fails: 1 of 1 streams stalled (1 at the first seam)",
        "ran dry at its first seam: the engine's first chunk is too short",
    ),
    "ttfa engine": (
        [steady(s, s + 1.6, 1.25, 2.0, 6, opened=s + 0.05) for s in (11.0, 20.0)],
        "TTFA p99 1.60 s > 1 s (engine 1.55 s after the stream opened, wait 0.05 s before)",
        "the engine's own time to first audio for a lone session exceeds --ttfa-limit",
    ),
    "ttfa queue": (
        queued_level(1, "ramp", wait_s=9.1)[1],
        "TTFA p99 9.39 s > 1 s (queue wait 9.10 s before the stream opened, engine 0.29 s)",
        "this run measured a queue in front of the engine (a gateway's, full at its cap or "
        "with other traffic), not the engine",
    ),
}


@pytest.mark.parametrize("case", list(ZERO))
def test_a_ceiling_of_zero_names_the_rule_and_advice_that_fits_it(case: str) -> None:
    traces, broken, remedy = ZERO[case]
    result = _one(*traces)
    assert (result.summary.ceiling, result.summary.bounded) == (0, True)
    summary = format_summary(result)
    (line,) = [line for line in summary.splitlines() if line.startswith("advice: ")]
    assert broken in summary and remedy in line
    snippet = config_snippet(result, "tts-main", "gpu0")
    assert "max_sessions:" not in snippet and yaml.safe_load(snippet) is None  # comments
    flat = " ".join(snippet.replace("\n# ", " ").split())
    assert "ceiling 0" in flat and remedy[1:] in flat  # the advice, as a sentence
    # The GPU is blamed only when the engine broke the rule for a lone stream, not for
    # a first chunk too short for the prebuffer nor for a queue in front of it.
    assert ("faster GPU" in summary) == (case in ("steady", "ttfa engine"))


@pytest.mark.parametrize("case", ["steady", "ttfa queue"])
def test_a_lagging_client_is_blamed_before_the_gpu_or_a_queue(case: str) -> None:
    """A client whose event loop lags reads every arrival late, the opening of the
    stream included: its slow chunks and its waits may be its own."""
    result = _one(*ZERO[case][0])
    (stats,) = result.summary.levels
    lagged = replace(stats, client_lag_p99_s=0.23)
    busy = replace(result, summary=replace(result.summary, levels=(lagged,)))
    text = format_summary(busy)
    assert "advice: this client's event loop lagged 230 ms (p99) at 1 session" in text
    assert "faster GPU" not in text and "measured a queue" not in text
    assert "probe again from a less busy machine" in config_snippet(busy, "tts-main", "gpu0")


def test_a_gateway_queue_is_named_and_measured_apart_from_the_engine() -> None:
    """Through a gateway whose cap is 2: every stream keeps 1.6x, and only the wait in
    its queue breaks the TTFA rule from 3 on. The run says it measured the queue."""
    result = result_of(
        [
            queued_level(1, "ramp", wait_s=0.01),
            queued_level(2, "ramp", wait_s=0.01),
            queued_level(4, "ramp", wait_s=6.0),
            queued_level(3, "bisect", wait_s=5.0),
        ]
    )
    summary = result.summary
    assert (summary.ceiling, summary.limited_by, summary.limited_by_queue) == (2, ("ttfa",), True)
    text = format_summary(result)
    assert (
        "at 2, TTFA p99 5.29 s > 1 s (queue wait 5.00 s before the stream opened, engine "
        "0.29 s) at 3" in text
    )
    assert "limited by ttfa (queue wait)" in text
    assert "advice: only the wait before the streams opened broke a rule at 3 sessions" in text
    assert "streams kept 1.60x once served" in text and "faster GPU" not in text
    table = format_table(result).splitlines()
    assert table[0].split()[9:12] == ["p99", "wait", "p99"]
    assert table[3].split()[9:13] == ["6.29", "s", "6.00", "s"]
    snippet = config_snippet(result, "tts-main", "gpu0")
    assert "ceiling 2, set by the wait before" in snippet and "max_sessions:" not in snippet
    data = result_json(result)
    assert data["limited_by_queue"] is True
    row = data["levels"][3]
    assert (row["ttfa_cause"], row["wait_p99_s"], row["engine_ttfa_p99_s"]) == ("queue", 5.0, 0.29)
    rows = list(csv.DictReader(io.StringIO(csv_text(result))))
    assert rows[3]["ttfa_cause"] == "queue" and rows[0]["ttfa_cause"] == ""


def test_write_config_refuses_a_ceiling_the_queue_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "headroom.yaml"
    shutil.copy(ROOT / "config" / "single-gpu.yaml", path)
    before = path.read_text()
    queued = result_of([queued_level(1, "ramp", wait_s=0.01), queued_level(2, "ramp", wait_s=4.0)])
    argv = ("--target", "http://headroom.example:8080", "--protocol", "vllm-omni-speech-ws",
            "--write-config", str(path), "--pool", "tts-main", "--replica", "gpu0")  # fmt: skip
    out = io.StringIO()
    assert _outputs(queued, args(*argv), out) == 1
    assert "this run measured a queue in front of the engine" in capsys.readouterr().err
    assert path.read_text() == before
    # The engine's own limit at 2 is written, with a word on the number it is.
    engine = result_of(
        [queued_level(1, "ramp", wait_s=0.01), queued_level(2, "ramp", wait_s=0.01, gap=2.5)]
    )
    assert _outputs(engine, args(*argv), out) == 0
    assert "max_sessions 8 -> 1 (the low end of the ceiling range seen, 1: one run's" in (
        out.getvalue()
    )
    assert 'see "Which number to set" in docs/probe.md' in out.getvalue()


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


def _points(ax: Any) -> list[tuple[float, float, float]]:
    """``(x, y, radius)`` in display pixels of every marker drawn on ``ax``."""
    out = []
    for line in ax.get_lines():
        if line.get_marker() in ("None", None, ""):
            continue
        radius = line.get_markersize() * ax.figure.dpi / 72.0 / 2.0
        for x, y in line.get_transform().transform(line.get_xydata()):
            out.append((float(x), float(y), radius))
    return out


def _stalling(level: int, gap: float) -> tuple[LevelWindow, list[SessionTrace]]:
    """A level whose streams all stall at their first seam (a 0.32 s first chunk) and
    then get 2 s chunks every ``gap`` s."""
    window = LevelWindow(level, 0.0, 10.0, 40.0)
    starts = [11.0 + 0.1 * i for i in range(level)]
    chunks = [(0.5, 0.32)] + [(1.3 + gap * i, 2.0) for i in range(12)]
    return window, [tts_trace(s, [(s + at, a) for at, a in chunks], opened=s) for s in starts]


@pytest.mark.parametrize(
    "case",
    ["recorded", "queue", "ceiling at the last level", "ceiling 0", "stalls", "knee"],
)
def test_plot_marks_each_levels_failing_rule_and_its_label_covers_no_marker(case: str) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    levels = [queued_level(1, "ramp", wait_s=0.01), queued_level(2, "ramp", wait_s=0.01)]
    result = {
        "recorded": recorded_result,
        "queue": lambda: result_of([*levels, queued_level(4, "ramp", wait_s=6.0)]),
        "ceiling at the last level": lambda: result_of(levels),
        "ceiling 0": lambda: _one(*ZERO["ttfa queue"][0]),
        "stalls": lambda: _one(*ZERO["stalls"][0]),
        # A knee like the README's run's: 6 fails on stalls with its worst-1% (1.31x) just
        # above the threshold, right of the ceiling's line, where the label used to be drawn.
        "knee": lambda: result_of(
            [
                *(
                    queued_level(n, "ramp", wait_s=0.01, gap=g)
                    for n, g in ((1, 0.647), (2, 0.89), (4, 1.216))
                ),
                _stalling(8, 1.543),
                _stalling(6, 1.526),
                queued_level(5, "bisect", wait_s=0.01, gap=1.263),
            ]
        ),
    }[case]()
    fig = figure(result)
    try:
        fig.canvas.draw()
        ratios, strip, throughput = fig.axes
        (label,) = [t for t in ratios.texts if t.get_text().startswith("ceiling ")]
        box = label.get_window_extent()
        for x, y, r in _points(ratios) + _points(throughput):
            clear_x = x + r < box.x0 or x - r > box.x1
            clear_y = y + r < box.y0 or y - r > box.y1
            assert clear_x or clear_y, (case, label.get_text(), (x, y), box)
        assert box.x0 >= ratios.bbox.x0 and box.x1 <= ratios.bbox.x1  # inside the axes
        rows = [t.get_text() for t in strip.get_yticklabels()]
        assert rows == ["worst-1% \u2265 1.2x", "no stall (0.2 s buffer)", "TTFA p99 \u2264 1 s"]
        marks = {
            (round(x), rows[round(y)], line.get_marker())
            for line in strip.get_lines()
            if line.get_marker() in ("X", "D")
            for x, y in line.get_xydata()
        }
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
    finally:
        plt.close(fig)
    expected = {
        "recorded": {(3, rows[0], "X"), (4, rows[0], "X")},
        "queue": {(4, rows[2], "D")},
        "ceiling at the last level": set(),
        "ceiling 0": {(1, rows[2], "D")},
        "stalls": {(1, rows[1], "X")},
        "knee": {(6, rows[1], "X"), (8, rows[1], "X")},
    }[case]
    assert marks == expected
    assert ("TTFA broken by queue wait" in legend) == (case in ("queue", "ceiling 0"))
    assert ("rule broken" in legend) == (case in ("recorded", "stalls", "knee"))


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
    queued = result_of([queued_level(1, "ramp", wait_s=5.0)]).summary.levels[0]
    progress.level_done(queued)
    assert log.getvalue().splitlines()[3].endswith("refused 0  (broke ttfa by queue wait)")


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
