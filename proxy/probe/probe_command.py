"""``headroom probe``: find a GPU's real ceiling by ramping concurrency.

``proxy/process/cli.py`` wires :func:`add_arguments` and :func:`run` into the
``probe`` subcommand (``python -m proxy.probe`` runs it stand-alone)::

    headroom probe --target http://gpu0:8000 --protocol vllm-omni-speech-ws \\
        --json probe.json --csv probe.csv --plot probe.png

Exit status: 0 done (also when the time limit cut it short: see ``complete`` in the
JSON), 1 the target could not be probed (the pre-flight failed, or a level measured
nothing: the wrong protocol for the endpoint), 2 invalid usage, 130 Ctrl-C (what was
measured is still printed and written).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import TextIO

from proxy.metering.adapters.base import MAX_TOKENS_PER_SECOND
from proxy.metering.rolling import DELIVERY_THRESHOLD
from proxy.probe.config_edit import (
    ConfigEditError,
    replica_url,
    set_max_sessions,
    write_max_sessions,
)
from proxy.probe.plot import PlotUnavailable, require_matplotlib, write_plot
from proxy.probe.probe_session import PROTOCOL_KINDS, ClientOptions, endpoint_url
from proxy.probe.progress import TerminalProgress
from proxy.probe.ramp import ProbeError, ProbeResult, ProbeSettings, run_probe
from proxy.probe.report import config_snippet, csv_text, format_summary, format_table, result_json
from proxy.probe.report import replica_url as probed_url
from proxy.probe.traces import RecordedLevel, write_traces
from proxy.probe.workload import open_workload
from proxy.process.serving import signal_handlers

__all__ = ["add_arguments", "main", "parse_levels", "run", "settings_from_args"]

DEFAULT_LEVELS = "1,2,4,8,16,..."


def parse_levels(text: str) -> tuple[tuple[int, ...], bool]:
    """``("1,2,4,...")`` -> ``((1, 2, 4), True)``: a trailing ``...`` keeps doubling."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    extend = bool(parts) and parts[-1] == "..."
    if extend:
        parts = parts[:-1]
    try:
        levels = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--levels must be integers separated by commas, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError("--levels must list concurrencies >= 1, e.g. 1,2,4,8,16,...")
    return levels, extend


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``headroom probe``'s options to ``parser``."""
    parser.description = (
        "Ramp concurrency against a speech endpoint (an engine, or Headroom in front of "
        "it), hold each level, and find the largest concurrency whose worst-1% per-chunk "
        f"delivery ratio stays at or above the threshold ({DELIVERY_THRESHOLD:g}x realtime), "
        "whose listeners never stall (a modelled --prebuffer playback) and whose TTFA p99 "
        "stays within --ttfa-limit. The summary names the rule that broke; a broken TTFA "
        "rule is split into the wait before the stream opened (a gateway's queue) and the "
        "engine's part."
    )
    a = parser.add_argument
    a("--target", required=True, metavar="URL", help="engine or Headroom base URL")
    a("--protocol", required=True, choices=sorted(PROTOCOL_KINDS), help="protocol to speak")
    a("--levels", default=DEFAULT_LEVELS, metavar="LIST",
      help=f"ramp (default {DEFAULT_LEVELS}; a trailing ... keeps doubling)")  # fmt: skip
    a("--max-level", type=int, default=512, metavar="N", help="highest level (default 512)")
    a("--no-bisect", action="store_true", help="stop at the first failing level")
    a("--hold", type=float, default=30.0, metavar="S", help="measured seconds per level (30)")
    a("--warmup", type=float, default=8.0, metavar="S", help="unmeasured warm-up per level (8)")
    a("--threshold", type=float, default=DELIVERY_THRESHOLD, metavar="X",
      help=f"worst-1%% delivery ratio a level must keep (default {DELIVERY_THRESHOLD:g})")  # fmt: skip # noqa: E501
    a("--workload", metavar="FILE", help="YAML/JSONL workload (default: the bundled tts/asr)")
    a("--seed", type=int, help="sampling seed (default: the workload's, else 0)")
    a("--json", metavar="OUT", help="write the result as JSON")
    a("--csv", metavar="OUT", help="write one row per level as CSV")
    a("--plot", metavar="OUT", help="write a .png or .svg plot (needs matplotlib)")
    a("--save-traces", metavar="OUT", help="write every session's arrivals (JSON Lines)")
    a("--write-config", metavar="FILE", help="set --pool/--replica's max_sessions in FILE")
    a("--pool", metavar="NAME", help="pool for the config snippet / --write-config")
    a("--replica", metavar="NAME", help="replica for the config snippet / --write-config")
    a("--time-limit", type=float, default=1800.0, metavar="S", help="whole run (1800)")
    a("--session-timeout", type=float, default=600.0, metavar="S", help="one session (600)")
    a("--max-error-rate", type=float, default=0.0, metavar="F",
      help="fraction of errored sessions a passing level may have (default 0)")  # fmt: skip
    a("--model", help="model name to send (realtime: default from GET /v1/models)")
    a("--voice", help="voice for every TTS request (overrides the workload)")
    a("--sample-rate", type=int, default=24000, metavar="HZ",
      help="PCM rate when the stream does not say (24000)")  # fmt: skip
    a("--tokens-per-audio-second", type=float, metavar="N",
      help="openai-completions-tokens: generated tokens per second of audio (required "
           "there; Orpheus: 82)")  # fmt: skip
    a("--stream-format", choices=("audio", "sse"), default="audio",
      help="openai-speech-http: raw PCM or SSE (default audio)")  # fmt: skip
    a("--asr-pace", type=float, default=0.0, metavar="X",
      help="ASR: send audio at X x realtime (default 0: all at once; the engine sets the "
           "pace)")  # fmt: skip
    a("--prebuffer", type=float, default=0.2, metavar="S",
      help="modelled client buffer before playback, for underruns (0.2)")  # fmt: skip
    a("--max-stall-share", type=float, default=0.0, metavar="F",
      help="share of streams whose modelled playback may run dry at a passing level "
           "(default 0; 1 = not judged)")  # fmt: skip
    a("--ttfa-limit", type=float, default=1.0, metavar="S",
      help="TTFA p99 a passing level may reach (default 1.0 s; 0 = not judged)")  # fmt: skip
    a("--repeat", type=int, default=1, metavar="N",
      help="measure the ceiling and the level above it N more times once found; a "
           "level passes only if every trial does (default 1; 0 = once)")  # fmt: skip
    a("--header", action="append", default=[], metavar="'NAME: VALUE'",
      help="extra request header, e.g. 'Authorization: Bearer KEY' (repeatable)")  # fmt: skip
    a("--quiet", action="store_true", help="no live progress")


def _headers(items: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--header must look like 'Name: value', got {item!r}")
        out.append((name.strip(), value.strip()))
    return tuple(out)


def settings_from_args(args: argparse.Namespace) -> ProbeSettings:
    """Validated settings; ValueError (or WorkloadError) says what is wrong."""
    levels, extend = parse_levels(args.levels)
    kind = PROTOCOL_KINDS[args.protocol]
    workload = open_workload(args.workload or kind)
    if not args.max_stall_share >= 0 or args.ttfa_limit < 0 or args.repeat < 0:
        raise ValueError("--max-stall-share, --ttfa-limit and --repeat must be >= 0")
    if args.asr_pace < 0 or args.hold <= 0 or args.warmup < 0 or args.time_limit <= 0:
        raise ValueError("--hold and --time-limit must be > 0, --warmup and --asr-pace >= 0")
    tokens = args.tokens_per_audio_second
    if (args.protocol == "openai-completions-tokens") != (tokens is not None):
        raise ValueError(
            "--tokens-per-audio-second is required for, and only for, openai-completions-tokens"
        )
    if tokens is not None and not 0 < tokens <= MAX_TOKENS_PER_SECOND:
        raise ValueError(f"--tokens-per-audio-second must be in (0, {MAX_TOKENS_PER_SECOND:g}]")
    client = ClientOptions(
        url=endpoint_url(args.target, args.protocol),
        protocol=args.protocol,
        headers=_headers(args.header),
        model=args.model,
        voice=args.voice,
        sample_rate=args.sample_rate,
        stream_format=args.stream_format,
        asr_pace=args.asr_pace,
        prebuffer_s=args.prebuffer,
        tokens_per_audio_second=tokens,
    )
    seed = args.seed if args.seed is not None else (workload.seed or 0)
    return ProbeSettings(
        client=client,
        workload=workload,
        levels=levels,
        extend=extend,
        max_level=args.max_level,
        hold_s=args.hold,
        warmup_s=args.warmup,
        threshold=args.threshold,
        seed=seed,
        time_limit_s=args.time_limit,
        session_timeout_s=args.session_timeout,
        max_error_rate=args.max_error_rate,
        bisect=not args.no_bisect,
        max_stall_share=args.max_stall_share if args.max_stall_share < 1 else None,
        ttfa_limit_s=args.ttfa_limit if args.ttfa_limit > 0 else None,
        repeats=args.repeat,
    )


async def _probe(settings: ProbeSettings, progress: TerminalProgress | None) -> ProbeResult:
    """Run with Ctrl-C handling: the first stops and reports, the second aborts."""
    stop = asyncio.Event()
    main = asyncio.current_task()
    presses = 0

    def interrupt() -> None:
        nonlocal presses
        presses += 1
        if presses == 1:
            stop.set()
            print(
                "\nheadroom probe: stopping - closing every session, then reporting what "
                "was measured (Ctrl-C again to abort)",
                file=sys.stderr,
            )
        elif main is not None:
            main.cancel()

    with signal_handlers({signal.SIGINT: interrupt}):
        return await run_probe(settings, progress=progress, stop=stop)


def _run_loop(settings: ProbeSettings, progress: TerminalProgress | None) -> ProbeResult:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        return asyncio.run(_probe(settings, progress))
    return uvloop.run(_probe(settings, progress))


def _recorded(result: ProbeResult) -> list[RecordedLevel]:
    return [RecordedLevel(r.window, list(r.traces), r.share) for r in result.runs]


def _outputs(result: ProbeResult, args: argparse.Namespace, out: TextIO) -> int:
    """Print and write every requested output; returns 1 if one could not be written."""
    status = 0
    pool = args.pool or ("asr-main" if result.settings.kind == "asr" else "tts-main")
    replica = args.replica or "gpu0"
    print(format_table(result), file=out)
    print(file=out)
    print(format_summary(result), file=out)
    if result.summary.levels:
        print("\nconfiguration:\n" + config_snippet(result, pool, replica), file=out, end="")
    writers = (
        (args.json, lambda p: Path(p).write_text(json.dumps(result_json(result), indent=2))),
        (args.csv, lambda p: Path(p).write_text(csv_text(result))),
        (args.plot, lambda p: write_plot(result, p)),
        (args.save_traces, lambda p: write_traces(_recorded(result), p)),
    )
    for path, write in writers:
        if path:
            try:
                write(path)
                print(f"wrote {path}", file=out)
            except (OSError, PlotUnavailable) as exc:
                print(f"headroom probe: cannot write {path}: {exc}", file=sys.stderr)
                status = 1
    if args.write_config:
        # The low end of the range seen: a level counts only when every trial of it passed.
        ceiling = result.summary.range[0]
        if result.stopped or not result.summary.bounded or ceiling < 1:
            print(
                f"headroom probe: not updating {args.write_config}: the ceiling was not "
                "measured exactly (run stopped early, no level failed, or it is 0)",
                file=sys.stderr,
            )
            return 1
        if result.summary.limited_by_queue:
            print(
                f"headroom probe: not updating {args.write_config}: only the wait before "
                "the streams opened broke a rule, so this run measured a queue in front "
                "of the engine, not the engine (see the advice above)",
                file=sys.stderr,
            )
            return 1
        try:
            old = write_max_sessions(args.write_config, pool, replica, ceiling)
            low, high = result.summary.range
            seen = f"{low}" if low == high else f"{low}-{high}"
            change = (
                f"{pool}/{replica} max_sessions {old} -> {ceiling} (the low end of the "
                f"ceiling range seen, {seen}: one run's ceiling, with no margin below the "
                'knee; see "Which number to set" in docs/probe.md)'
            )
            print(f"{args.write_config}: {change}", file=out)
            _warn_other_url(args, result.settings.client.url)
        except ConfigEditError as exc:
            print(f"headroom probe: {args.write_config}: {exc}", file=sys.stderr)
            status = 1
    return status


def _preflight_outputs(args: argparse.Namespace) -> None:
    """Fail before a long run, not after it: plot support, the config file and names."""
    if args.plot:
        require_matplotlib(args.plot)
    if args.write_config:
        if not (args.pool and args.replica):
            raise ValueError("--write-config needs --pool and --replica")
        try:
            text = Path(args.write_config).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read {args.write_config}: {exc}") from None
        set_max_sessions(text, args.pool, args.replica, 1, source=args.write_config)
        _warn_other_url(args, endpoint_url(args.target, args.protocol), text)


def _warn_other_url(args: argparse.Namespace, target: str, text: str | None = None) -> None:
    """``--write-config`` sets ``max_sessions`` only: say so when the file's replica
    points at another engine than the one measured (its cap would be this one's)."""
    try:
        if text is None:
            text = Path(args.write_config).read_text(encoding="utf-8")
        configured = replica_url(text, args.pool, args.replica, args.write_config)
    except (OSError, ConfigEditError):
        return
    measured = probed_url(target)
    if configured is None or configured.rstrip("/") != measured:
        print(
            f"headroom probe: warning: {args.write_config} points {args.pool}/{args.replica} "
            f"at {configured or 'no url'}, but this run measures {measured}; --write-config "
            "sets max_sessions only, so set that replica's url to the engine measured (or "
            "probe the engine it points at)",
            file=sys.stderr,
        )


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Carry out ``headroom probe``; returns the exit status."""
    out = out or sys.stdout
    try:
        settings = settings_from_args(args)
        _preflight_outputs(args)
    except (ValueError, PlotUnavailable) as exc:  # WorkloadError, ConfigEditError included
        print(f"headroom probe: {exc}", file=sys.stderr)
        return 2
    progress = None if args.quiet else TerminalProgress()
    print(
        f"headroom probe: {settings.client.url} ({settings.client.protocol}), threshold "
        f"{settings.threshold:g}x, warm-up {settings.warmup_s:g} s + hold {settings.hold_s:g} s "
        f"per level, workload {settings.workload.source} (seed {settings.seed})",
        file=sys.stderr,
    )
    try:
        result = _run_loop(settings, progress)
    except ProbeError as exc:
        print(f"headroom probe: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("headroom probe: aborted; every session was closed", file=sys.stderr)
        return 130
    status = _outputs(result, args, out)
    if result.stopped and result.stopped.startswith("interrupted"):
        return 130
    return status


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m proxy.probe``)."""
    parser = argparse.ArgumentParser(prog="headroom probe")
    add_arguments(parser)
    return run(parser.parse_args(argv))
