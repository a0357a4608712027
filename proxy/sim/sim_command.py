"""``headroom sim``: serve simulated GPUs, list presets, describe a preset.

``proxy/process/cli.py`` wires :func:`add_arguments` and :func:`run` into the
``sim`` subcommand::

    headroom sim --preset l40s-qwen3tts-1.7b --gpus 2 --host 127.0.0.1 --port 8000
    headroom sim --list-presets
    headroom sim --describe h200-qwen3tts-1.7b --json
    headroom sim --calibrate http://127.0.0.1:8080 --write engine.json
    headroom sim --describe engine.json      # a preset calibrated from a live engine
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from proxy.process.serving import signal_handlers
from proxy.sim.capacity import describe
from proxy.sim.chunks import parse_ramp
from proxy.sim.cluster import running_cluster
from proxy.sim.faults import add_fault_arguments, faults_from_args
from proxy.sim.gpu import Timeouts
from proxy.sim.presets import DEFAULT_PRESET, PRESETS, Preset, get_preset, preset_names

__all__ = ["add_arguments", "main", "run"]


#: The options of one mode, each ``(flag, type, default, metavar, help)``; the help
#: of a mode's options is prefixed with the mode (``with --calibrate: ...``).
_Option = tuple[str, Callable[[str], object], object, str | None, str]

_ENGINE_OPTIONS: tuple[_Option, ...] = (
    ("--max-num-seqs", int, None, "N", "override vLLM max_num_seqs"),
    ("--kv-cache-gib", float, None, "GIB", "override KV cache size"),
    ("--codec-chunk-ramp", str, None, "LIST",
     "vLLM-Omni codec_chunk_ramp: initial chunk frames, e.g. 4,4,8,16,25"),
    ("--initial-codec-chunk-frames", int, None, "N",
     "vLLM-Omni initial_codec_chunk_frames: a fixed first chunk of N frames"),
    ("--speech-config-timeout", float, 10.0, "S",
     "speech WebSocket: seconds to wait for session.config (vLLM-Omni: 10)"),
    ("--speech-idle-timeout", float, 30.0, "S",
     "speech WebSocket: idle timeout in seconds (vLLM-Omni: 30)"),
    ("--exit-after", float, None, "S", "stop serving after S seconds"),
)  # fmt: skip

_COLOCATE_OPTIONS: tuple[_Option, ...] = (
    ("--gpu-memory-utilization", str, "0.45,0.45", "UA,UB",
     "each engine's share of the GPU's memory (default 0.45,0.45)"),
)  # fmt: skip

_CALIBRATE_OPTIONS: tuple[_Option, ...] = (
    ("--protocol", str, "openai-completions-tokens", None,
     "how to speak to the engine (a headroom probe protocol)"),
    ("--tokens-per-audio-second", float, 12.5, "N",
     "tokens the engine makes per second of audio (default 12.5)"),
    ("--calibrate-levels", str, "1,2,4,8,16", "LIST",
     "the concurrency levels of the ramp (default 1,2,4,8,16)"),
    ("--calibrate-hold", float, 6.0, "S", "seconds each level is measured, after its warm-up"),
    ("--calibrate-warmup", float, 3.0, "S", "seconds each level runs before it is measured"),
    ("--calibrate-batch-tokens", int, None, "N",
     "the engine's per-step token budget (llama.cpp's -b, vLLM's --max-num-batched-tokens); "
     "prompts are taken in pieces of it (default: taken whole)"),
    ("--write", str, None, "FILE",
     "write the calibrated preset (JSON; give it to --describe or --preset)"),
)  # fmt: skip


def _add_options(parser: argparse.ArgumentParser, options: tuple[_Option, ...], mode: str) -> None:
    for flag, kind, default, metavar, text in options:
        parser.add_argument(flag, type=kind, default=default, metavar=metavar, help=f"{mode}{text}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``headroom sim``'s options to ``parser``."""
    a = parser.add_argument
    a("--preset", default=DEFAULT_PRESET, metavar="PRESET",
      help=f"deployment to simulate (default {DEFAULT_PRESET}; see --list-presets)")  # fmt: skip
    a("--gpus", type=int, default=1, help="simulated GPUs, one port each")
    a("--host", default="127.0.0.1", help="address to listen on")
    a("--port", type=int, default=8000, help="first port; GPU i uses PORT+i (0: free ports)")
    a("--seed", type=int, default=0, help="seed of the step-time jitter")
    a("--list-presets", action="store_true", help="list presets and exit")
    a("--describe", metavar="PRESET", help="measure a preset and exit")
    a("--json", action="store_true", help="machine-readable output")
    _add_options(parser, _ENGINE_OPTIONS, "")
    a("--colocate", metavar="A,B",
      help="measure two presets sharing one GPU (ceilings alone and beside each other) "
      "and exit")  # fmt: skip
    _add_options(parser, _COLOCATE_OPTIONS, "with --colocate: ")
    a("--calibrate", metavar="URL",
      help="measure a running engine's step cost against batch size with a short ramp, "
      "print the fit and the ceiling it predicts, and exit (--write keeps the preset)")  # fmt: skip
    _add_options(parser, _CALIBRATE_OPTIONS, "with --calibrate: ")
    add_fault_arguments(parser)


def _print_presets(args: argparse.Namespace, out: TextIO) -> None:
    if args.json:
        rows = [
            {"preset": p.name, "kind": p.kind, "model": p.model, "gpu": p.gpu.name,
             "description": p.description, "release": p.release}
            for p in PRESETS.values()
        ]  # fmt: skip
        print(json.dumps(rows, indent=2), file=out)
        return
    for name in preset_names():
        p = PRESETS[name]
        default = " (default)" if name == DEFAULT_PRESET else ""
        print(f"{name:28s} {p.kind:4s} {p.gpu.name:9s} {p.description}{default}", file=out)


def _described(key: str, info: dict[str, object]) -> object:
    """``info[key]`` as ``--describe`` prints it: the ceiling labelled with its seed,
    the range with its seeds, the recommended cap with why it is that number."""
    value = info[key]
    if key == "ceiling":
        return f"{value} (seed {info['seed']}; one draw of the jitter, not the cap to set)"
    if key == "ceiling_range" and isinstance(value, list):
        seeds = info.get("ceiling_by_seed")
        span = str(value[0]) if value[0] == value[1] else f"{value[0]}-{value[1]}"
        pairs = seeds.items() if isinstance(seeds, dict) else []
        by_seed = ", ".join(f"{s}: {c}" for s, c in pairs)
        return f"{span} (by seed {by_seed})"
    if key == "recommended_cap":
        return f"{value}  <- set max_sessions to this: {info.get('recommended_cap_note', '')}"
    return value


def _print_description(info: dict[str, object], args: argparse.Namespace, out: TextIO) -> None:
    if args.json:
        print(json.dumps(info, indent=2), file=out)
        return
    keys = ("preset", "model", "gpu", "release", "token_rate_hz", "chunk_schedule", "max_num_seqs",
            "single_stream_rtf", "single_stream_delivery_ratio", "ttfa_s", "knee_batch",
            "recommended_cap", "ceiling", "ceiling_range", "limited_by", "ceiling_steady_only",
            "ceiling_steady_only_note", "min_prebuffer_s", "ceiling_at_min_prebuffer",
            "ceiling_mean_model", "expected_ceiling")  # fmt: skip
    for key in keys:
        if info.get(key) not in (None, ""):
            print(f"{key:30s} {_described(key, info)}", file=out)
    print(
        "ramp (concurrency: worst-1% / median delivery ratio, mean step ms, share of "
        "streams stalling, TTFA p99)",
        file=out,
    )
    ramp = info["ramp"]
    assert isinstance(ramp, list)
    for row in ramp:
        print(
            f"  {row['concurrency']:5d}: {row['worst_1pct']:6.3f} / "
            f"{row['median_delivery_ratio']:6.3f}  {row['mean_step_ms']:7.1f}  "
            f"{row['stalled_share']:5.0%}  {row['ttfa_p99_s']:6.3f} s",
            file=out,
        )


def _print_colocated(args: argparse.Namespace, out: TextIO) -> None:
    from proxy.sim.colocated_ceilings import describe_colocated

    names = [n.strip() for n in args.colocate.split(",")]
    try:
        shares = [float(u) for u in args.gpu_memory_utilization.split(",")]
    except ValueError:
        value = args.gpu_memory_utilization
        raise ValueError(f"--gpu-memory-utilization: not numbers: {value!r}") from None
    info = describe_colocated(names, shares, seed=args.seed)
    if args.json:
        print(json.dumps(info, indent=2), file=out)
        return
    print(f"{' + '.join(names)} on one {info['gpu']} ({info['model']})", file=out)
    for e in info["engines"]:
        print(
            f"  {e['preset']:26s} share {e['gpu_memory_utilization']:g} "
            f"(KV {e['kv_cache_gib']} GiB): ceiling alone {e['ceiling_alone']}, at its share "
            f"{e['ceiling_alone_at_share']}, beside {e['other_streams']} streams of the other "
            f"{e['ceiling_beside_other']}",
            file=out,
        )
    print(f"  both together pass at {info['shared_percent']}% of their ceilings", file=out)


def _named_preset(name: str) -> Preset:
    """A preset by name, or the preset of a calibration file (``*.json``)."""
    if name.endswith(".json"):
        from proxy.sim.calibrate import load_calibration

        return load_calibration(name).preset(Path(name).stem)
    return get_preset(name)


def _preset_from_args(name: str, args: argparse.Namespace) -> Preset:
    """The named preset with the command line's engine options applied."""
    preset = _named_preset(name)
    if args.max_num_seqs is not None or args.kv_cache_gib is not None:
        preset = preset.with_overrides(
            max_num_seqs=args.max_num_seqs,
            kv_cache_bytes=None if args.kv_cache_gib is None else args.kv_cache_gib * 2**30,
        )
    ramp = parse_ramp(args.codec_chunk_ramp) if args.codec_chunk_ramp else None
    first = args.initial_codec_chunk_frames
    if first is not None and first < 1:
        raise ValueError("--initial-codec-chunk-frames must be >= 1")
    if ramp is not None or first is not None:
        preset = preset.with_schedule(initial_frames=first, ramp=ramp)
    return preset


def _customised(args: argparse.Namespace) -> bool:
    options = (args.max_num_seqs, args.kv_cache_gib, args.codec_chunk_ramp,
               args.initial_codec_chunk_frames)  # fmt: skip
    return any(o is not None for o in options)


async def _serve(args: argparse.Namespace, out: TextIO) -> None:
    preset = _preset_from_args(args.preset, args)
    timeouts = Timeouts(args.speech_config_timeout, args.speech_idle_timeout)
    stop = asyncio.Event()
    with signal_handlers({signal.SIGINT: stop.set, signal.SIGTERM: stop.set}):
        async with running_cluster(
            preset, args.gpus, args.host, args.port, args.seed, faults_from_args(args), timeouts
        ) as cluster:
            if args.json:
                print(json.dumps({"preset": preset.name, "urls": cluster.urls}), file=out)
            else:
                print(f"headroom sim: {preset.name} ({preset.model}), {args.gpus} GPU(s)", file=out)
                for gpu in cluster.gpus:
                    print(f"  gpu{gpu.index}  {gpu.url}", file=out)
            out.flush()
            if args.exit_after is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), args.exit_after)
            else:
                await stop.wait()


def _calibrate(args: argparse.Namespace, out: TextIO) -> None:
    from proxy.sim.calibrate import measure, render

    try:
        levels = tuple(int(v) for v in args.calibrate_levels.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--calibrate-levels: not integers: {args.calibrate_levels!r}") from None
    _require_no_running_loop()
    calibration = asyncio.run(
        measure(
            args.calibrate,
            protocol=args.protocol,
            tokens_per_audio_second=args.tokens_per_audio_second,
            levels=levels,
            hold_s=args.calibrate_hold,
            warmup_s=args.calibrate_warmup,
            seed=args.seed,
            max_num_seqs=args.max_num_seqs,
            batch_tokens=args.calibrate_batch_tokens,
        )
    )
    if args.write:
        Path(args.write).write_text(json.dumps(calibration.as_json(), indent=2) + "\n")
    info = describe(calibration.preset(Path(args.write).stem if args.write else "calibrated"))
    if args.json:
        print(json.dumps({"calibration": calibration.as_json(), "describe": info}, indent=2),
              file=out)  # fmt: skip
        return
    print(render(calibration), file=out)
    print(
        f"predicted ceiling {info['ceiling']} (seeds {info['ceiling_range'][0]}-"
        f"{info['ceiling_range'][1]}), recommended cap {info['recommended_cap']}",
        file=out,
    )
    if args.write:
        print(f"wrote {args.write}: headroom sim --describe {args.write}", file=out)


def _require_no_running_loop() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        "proxy.sim.sim_command.run() serves from its own event loop; inside a running loop use "
        "proxy.sim.running_cluster() instead"
    )


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Carry out ``headroom sim``; returns the exit status."""
    out = out or sys.stdout
    try:
        if args.list_presets:
            _print_presets(args, out)
            return 0
        if args.colocate:
            _print_colocated(args, out)
            return 0
        if args.calibrate:
            _calibrate(args, out)
            return 0
        if args.describe:
            custom = _customised(args) or args.describe.endswith(".json")
            target = _preset_from_args(args.describe, args) if custom else args.describe
            _print_description(describe(target, args.seed), args, out)
            return 0
        if args.gpus < 1:
            raise ValueError("--gpus must be >= 1")
        faults_from_args(args)  # validate before binding anything
        _require_no_running_loop()
        asyncio.run(_serve(args, out))
        return 0
    except (ValueError, OSError) as exc:
        print(f"headroom sim: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m proxy.sim``)."""
    parser = argparse.ArgumentParser(prog="headroom sim", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
