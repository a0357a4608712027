"""End to end over real sockets: the probe against ``headroom sim`` and through Headroom.

The simulator runs in its own process (as an engine does), the probe in this one. The
ceiling tests use the deterministic presets of :mod:`tests.probe.presets`, whose
``describe()`` ceilings differ (2, 4; ASR 3) and hold for every seed, and demand exact
equality (a run disturbed by a busy host may be repeated: see ``ATTEMPTS``). Holds are
short (4 s).
"""

from __future__ import annotations

import asyncio
import csv
import json
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proxy.probe import (
    ClientOptions,
    ProbeSettings,
    bundled,
    endpoint_url,
    load_workload,
    run_probe,
)
from proxy.probe.analysis import LevelStats
from proxy.probe.probe_command import main
from proxy.probe.probe_session import PROTOCOL_KINDS
from proxy.probe.ramp import LiveFigures
from proxy.probe.report import config_snippet, format_summary
from proxy.sim import Faults, describe, running_cluster
from proxy.sim.presets import PRESETS, get_preset
from tests.conftest import proxy_settings
from tests.probe.conftest import ROOT, sim_process
from tests.probe.presets import PROBE_PRESETS

QUICK = "--hold 4 --warmup 1.5 --quiet"
#: The ceiling tests judge the steady ratio alone (describe()'s ceiling_steady_only):
#: the deterministic presets' 4-frame first chunk stalls a 0.2 s listener by design.
STEADY_ONLY = "--max-stall-share 1 --ttfa-limit 0"
#: describe() measures each level once; so do the exact-ceiling tests (with a 1.5 s
#: warm-up a repeat right after a failing level still sees that level's load).
ONCE = "--repeat 0"
#: Runs allowed per ceiling test. The presets are deterministic, so the first run finds
#: the exact ceiling unless the host stalls a process for longer than the margin (150+
#: ms); a stall can only make a level fail, so a run never finds a higher ceiling.
ATTEMPTS = 5


def described_ceiling(monkeypatch: pytest.MonkeyPatch, name: str) -> int:
    """``describe(name)["ceiling_steady_only"]`` (the worst-1 % rule, the one the
    probe's verdict applies) with the test preset registered under its name."""
    monkeypatch.setitem(PRESETS, name, PROBE_PRESETS[name])
    ceiling = describe(name)["ceiling_steady_only"]
    assert isinstance(ceiling, int)
    return ceiling


@pytest.mark.parametrize(
    ("preset", "protocol", "levels"),
    [
        ("probe-test-tts-c2", "vllm-omni-speech-ws", "2,4,..."),
        ("probe-test-tts-c4", "openai-speech-http", "4,..."),
        ("probe-test-asr-c3", "vllm-realtime", "2,4,..."),
    ],
)
def test_ceiling_equals_described_ceiling(
    preset: str,
    protocol: str,
    levels: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    expected = described_ceiling(monkeypatch, preset)
    config = tmp_path / "headroom.yaml"
    found = []
    for attempt in range(ATTEMPTS):
        out = tmp_path / f"probe{attempt}"
        shutil.copy(ROOT / "config" / "single-gpu.yaml", config)
        with sim_process(preset) as url:
            status = main(
                f"--target {url} --protocol {protocol} --levels {levels} {QUICK} "
                f"{STEADY_ONLY} {ONCE} "
                f"--json {out}.json --csv {out}.csv --plot {out}.png "
                f"--write-config {config} --pool tts-main --replica gpu0".split()
            )
        printed = capsys.readouterr().out
        assert status == 0, printed
        result = json.loads(Path(f"{out}.json").read_text())
        found.append(result["ceiling"])
        # Host noise only delays arrivals, so it can only lower a measured ceiling:
        # never above the described one; below it only when this machine was too busy.
        assert result["ceiling"] <= expected, printed
        if result["ceiling"] == expected:
            break
    assert found[-1] == expected, f"ceilings measured {found}, described {expected}"
    assert result["exact"] is True
    assert result["bracket"] == [expected, expected + 1]
    assert result["complete"] is True and result["threshold"] == 1.2
    by_level = {row["level"]: row for row in result["levels"]}
    assert by_level[expected]["passed"] and by_level[expected]["worst_1pct"] >= 1.2
    assert by_level[expected + 1]["verdict"] == "slow"
    for row in result["levels"]:
        assert row["errors"] == 0 and row["refusals"] == 0, row
        assert row["chunks"] > 0 and row["sessions"] >= row["level"]
    rows = list(csv.DictReader(Path(f"{out}.csv").read_text().splitlines()))
    assert [int(r["level"]) for r in rows] == [row["level"] for row in result["levels"]]
    assert Path(f"{out}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"ceiling: {expected} concurrent sessions" in printed
    assert f"max_sessions: {expected}}}" in printed
    replica = yaml.safe_load(config.read_text())["pools"][0]["replicas"][0]
    assert replica["max_sessions"] == expected
    assert f"tts-main/gpu0 max_sessions 8 -> {expected}" in printed


def test_describe_ceilings_of_the_test_presets_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    ceilings = {name: described_ceiling(monkeypatch, name) for name in PROBE_PRESETS}
    assert ceilings == {"probe-test-tts-c2": 2, "probe-test-tts-c4": 4, "probe-test-asr-c3": 3}


def test_transcription_sse_measures_the_engine_speed(tmp_path: Path) -> None:
    out = tmp_path / "sse.json"
    with sim_process("probe-test-asr-c3") as url:
        status = main(
            f"--target {url} --protocol openai-transcription-sse --levels 1 --hold 3 "
            f"--warmup 1.5 --quiet --json {out}".split()
        )
    assert status == 0
    level = json.loads(out.read_text())["levels"][0]
    speed = 0.08 / (0.002 + 0.018661)  # the preset's single-stream delivery ratio
    assert level["verdict"] == "pass"
    assert level["median_ratio"] == pytest.approx(speed, rel=0.1)


def test_wrong_protocol_that_measures_nothing_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A transcription protocol against a speech-synthesis GPU: sessions complete, the
    pre-flight passes (the omni endpoint answers), but no transcript event can be timed.
    The probe must fail (not report "ceiling 0" and suggest max_sessions: 1) and say
    what was wrong and what to try; the config file is left alone."""
    config = tmp_path / "headroom.yaml"
    shutil.copy(ROOT / "config" / "single-gpu.yaml", config)
    before = config.read_text()
    with sim_process("h200-voxtral-tts-4b") as url:
        status = main(
            f"--target {url} --protocol vllm-realtime --levels 1,2 {QUICK} "
            f"--json {tmp_path}/p.json --write-config {config} --pool tts-main "
            "--replica gpu0".split()
        )
    captured = capsys.readouterr()
    assert status == 1
    assert "measured nothing at concurrency 1" in captured.err
    assert "speech-synthesis or speech-to-speech model" in captured.err
    assert "--protocol vllm-omni-speech-ws or openai-speech-http" in captured.err
    assert "max_sessions" not in captured.out
    assert not (tmp_path / "p.json").exists()
    assert config.read_text() == before


def test_a_stall_at_the_first_seam_fails_the_level(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """probe-test-tts-c2 alone: a 4-frame (0.32 s) first chunk, then 25 frames made in
    ~0.71 s. A 0.2 s-prebuffer listener runs dry at the first seam although every later
    chunk is 1.4x realtime; a 0.6 s prebuffer does not. A tight TTFA limit fails too."""
    runs = {}
    printed = {}
    with sim_process("probe-test-tts-c2") as url:
        for name, extra in (
            ("default", ""),
            ("prebuffer", "--prebuffer 0.6"),
            ("ttfa", "--prebuffer 0.6 --ttfa-limit 0.05"),
        ):
            out = tmp_path / f"{name}.json"
            status = main(
                f"--target {url} --protocol vllm-omni-speech-ws --levels 1 --max-level 1 "
                f"{QUICK} --json {out} {extra}".split()
            )
            assert status == 0
            runs[name] = json.loads(out.read_text())
            printed[name] = capsys.readouterr().out
    stalled = runs["default"]["levels"][0]
    assert stalled["verdict"] == "stalls" and runs["default"]["ceiling"] == 0
    assert stalled["worst_1pct"] >= 1.2  # the steady ratio alone would have passed
    assert stalled["stalled_streams"] == stalled["streams"] > 0
    assert stalled["startup_stalls"] == stalled["stalled_streams"]
    assert runs["default"]["settings"]["max_stall_share"] == 0.0
    # Level 1 failed, so it was measured again (--repeat 1): failed both times.
    assert runs["default"]["trials"] == {"1": {"passed": 0, "runs": 2}}
    assert runs["default"]["limited_by"] == ["stalls"]
    assert runs["default"]["ceiling_range"] == [0, 0]
    assert "ceiling: 0 - one session already fails: 1 of " in printed["default"]
    assert "advice: a lone stream's playback ran dry at its first seam" in printed["default"]
    assert runs["prebuffer"]["levels"][0]["verdict"] == "pass"
    assert runs["prebuffer"]["levels"][0]["stalled_streams"] == 0
    assert runs["ttfa"]["levels"][0]["verdict"] == "ttfa"


class RecordingProgress:
    def __init__(self) -> None:
        self.started: list[tuple[int, str, float, float]] = []
        self.ticks: list[LiveFigures] = []
        self.done: list[LevelStats] = []
        self.notes: list[str] = []

    def level_started(self, level: int, phase: str, warmup_s: float, hold_s: float) -> None:
        self.started.append((level, phase, warmup_s, hold_s))

    def tick(self, live: LiveFigures) -> None:
        self.ticks.append(live)

    def level_done(self, stats: LevelStats) -> None:
        self.done.append(stats)

    def note(self, message: str) -> None:
        self.notes.append(message)


@pytest.mark.parametrize(
    ("preset", "protocol", "path", "refusal"),
    [
        ("h200-voxtral-tts-4b", "vllm-omni-speech-ws", "/v1/audio/speech/stream", "http"),
        ("h100-voxtral-realtime-4b", "vllm-realtime", "/v1/realtime", "close"),
    ],
)
async def test_through_headroom_refusals_are_counted_not_errors(
    start_proxy: Any, preset: str, protocol: str, path: str, refusal: str
) -> None:
    """Headroom caps the GPU at 2: levels above are refused (503 handshake, or an error
    event and close 1013), which the probe counts as refusals, and every slot comes back
    (the fixture checks that no slot leaked)."""
    async with running_cluster(get_preset(preset), gpus=1) as cluster:
        route = {"path": path, "pool": "main", "protocol": protocol, "refusal": refusal}
        proxy = await start_proxy(proxy_settings([("gpu0", cluster.urls[0], 2)], [route]))
        probe = ProbeSettings(
            client=ClientOptions(url=endpoint_url(proxy.http_url, protocol), protocol=protocol),
            workload=bundled(PROTOCOL_KINDS[protocol]),
            levels=(1, 2, 4),
            extend=False,
            hold_s=1.2,
            warmup_s=0.5,
            cooldown_s=0.2,
            # refusals are the subject here: no repeated trials, and only the steady
            # ratio judged (a loaded machine's first-seam stall is not what is tested)
            repeats=0,
            max_stall_share=None,
            ttfa_limit_s=None,
        )
        progress = RecordingProgress()
        result = await run_probe(probe, progress=progress)
    summary = result.summary
    assert [level for level, *_ in progress.started] == [1, 2, 4, 3]
    assert [s.level for s in progress.done] == [1, 2, 4, 3]
    assert any(live.chunks > 0 and live.worst_1pct for live in progress.ticks)
    assert any(live.refusals > 0 for live in progress.ticks)
    assert summary.ceiling == 2 and summary.bounded
    verdicts = {s.level: s.verdict for s in summary.levels}
    assert verdicts == {1: "pass", 2: "pass", 4: "refused", 3: "refused"}
    for stats in summary.levels:
        assert stats.errors == 0, stats.details
        assert (stats.refusals > 0) == (stats.level > 2)
    assert any("pool_full" in d for s in summary.levels for d in s.details)


#: One text, about 25 s of speech: a session the simulated H200 serves in a few seconds.
LONG_TEXT = (
    'kind: tts\nrequests:\n  - text: "'
    + "The museum opens at ten and closes at six, except on public holidays. " * 5
    + '"\n'
)


@pytest.mark.parametrize(
    ("protocol", "path", "feedback"),
    [
        ("openai-speech-http", "/v1/audio/speech", False),
        ("vllm-omni-speech-ws", "/v1/audio/speech/stream", False),
        ("vllm-omni-speech-ws", "/v1/audio/speech/stream", True),
    ],
)
async def test_through_a_gateway_queue_the_probe_names_the_queue_not_the_engine(
    start_proxy: Any, protocol: str, path: str, feedback: bool
) -> None:
    """Headroom caps the GPU at 1 and queues the rest: at 2 sessions every session waits
    for the other's to end before its stream opens (the response or the handshake is
    held, or with queue feedback ``headroom.admitted`` comes late). Every stream still
    keeps its speed and the engine its TTFA: only the wait breaks the TTFA rule, and the
    probe says so, without suggesting a cap or blaming the GPU."""
    async with running_cluster(get_preset("h200-voxtral-tts-4b"), gpus=1) as cluster:
        route: dict[str, Any] = {"path": path, "pool": "main", "protocol": protocol}
        if feedback:
            route["queue_feedback"] = True
        queue = {"max_depth": 8, "max_wait_s": 30}
        settings = proxy_settings([("gpu0", cluster.urls[0], 1)], [route], queue=queue)
        proxy = await start_proxy(settings)
        probe = ProbeSettings(
            client=ClientOptions(url=endpoint_url(proxy.http_url, protocol), protocol=protocol),
            workload=load_workload(LONG_TEXT, "long"),
            levels=(1, 2),
            extend=False,
            hold_s=4.0,
            warmup_s=1.0,
            cooldown_s=0.2,
            repeats=0,
            # the queue is the subject: a loaded machine's first-seam stall is not
            max_stall_share=None,
            ttfa_limit_s=1.0,
        )
        result = await run_probe(probe)
    summary = result.summary
    one, two = summary.levels
    assert one.verdict == "pass", one
    assert two.verdict == "ttfa" and two.failed_rules == ("ttfa",), two
    assert two.ttfa_cause == "queue"
    assert two.wait_p99_s is not None and two.wait_p99_s > 1.0
    assert two.engine_ttfa_p99_s is not None and two.engine_ttfa_p99_s <= 1.0
    assert (summary.ceiling, summary.limited_by_queue) == (1, True)
    assert two.errors == 0 and two.refusals == 0
    text = format_summary(result)
    assert "measured a queue in front of the engine" in text and "faster GPU" not in text
    assert "max_sessions:" not in config_snippet(result, "tts-main", "gpu0")


async def _sim_stats(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{url}/sim/stats")
        data = response.json()
        assert isinstance(data, dict)
        return data


async def test_ctrl_c_reports_what_was_measured_and_closes_every_session(
    tmp_path: Path,
) -> None:
    out = tmp_path / "partial.json"
    with sim_process("probe-test-tts-c4") as url:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "proxy.probe",
            "--target",
            url,
            "--protocol",
            "vllm-omni-speech-ws",
            "--levels",
            "2,4,8",
            "--hold",
            "2",
            "--warmup",
            "1",
            # the interruption is the subject: no repeats, only the steady ratio judged
            "--repeat",
            "0",
            "--max-stall-share",
            "1",
            "--ttfa-limit",
            "0",
            "--json",
            str(out),
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stderr is not None
        seen = []
        while not any(" pass " in line for line in seen):
            line = await asyncio.wait_for(proc.stderr.readline(), 30)
            assert line, b"".join(seen)
            seen.append(line.decode())
        await asyncio.sleep(0.8)  # inside level 4, sessions open
        proc.send_signal(signal.SIGINT)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 130, stderr.decode()
        deadline = time.monotonic() + 5
        while (stats := await _sim_stats(url))["open_streams"] or stats["running"]:
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.1)
    result = json.loads(out.read_text())
    assert result["complete"] is False and result["stopped"].startswith("interrupted")
    levels = result["levels"]
    assert [(row["level"], row["verdict"]) for row in levels] == [(2, "pass"), (4, "interrupted")]
    assert result["ceiling"] == 2 and result["exact"] is False
    assert "ceiling: at least 2" in stdout.decode()


@pytest.mark.parametrize(
    ("protocol", "faults", "verdict", "detail"),
    [
        ("vllm-omni-speech-ws", Faults(error_after_chunks=2), "errors", "error event: "),
        ("openai-speech-http", Faults(drop_after_chunks=2), "errors", "RemoteProtocolError"),
        ("vllm-omni-speech-ws", Faults(drop_after_chunks=2), "errors", "connection closed"),
        ("openai-speech-http", Faults(handshake_503=True), "refused", "HTTP 503"),
        ("vllm-omni-speech-ws", Faults(handshake_503=True), "refused", "HTTP 503"),
        ("vllm-omni-speech-ws", Faults(stall_after_chunks=2, stall_s=1.5), "slow", None),
    ],
)
async def test_engine_faults_are_errors_refusals_or_slowness(
    protocol: str, faults: Faults, verdict: str, detail: str | None
) -> None:
    async with running_cluster(get_preset("h200-voxtral-tts-4b"), gpus=1) as cluster:
        probe = ProbeSettings(
            client=ClientOptions(url=endpoint_url(cluster.urls[0], protocol), protocol=protocol),
            workload=bundled("tts"),
            levels=(2,),
            extend=False,
            bisect=False,
            hold_s=2.0,
            warmup_s=0.3,
            cooldown_s=0.0,
            preflight=False,
        )
        await cluster.set_faults(faults)
        result = await run_probe(probe)
        await asyncio.sleep(0.2)
        assert cluster.engines[0].stats().running == 0  # every session was closed
    (stats,) = result.summary.levels
    assert stats.verdict == verdict, stats
    if detail is not None:
        assert any(detail in d for d in stats.details), stats.details
    assert (result.summary.ceiling, result.summary.bounded) == (0, False)
