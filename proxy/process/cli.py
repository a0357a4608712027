"""The ``headroom`` command.

::

    headroom serve --config FILE     run the gateway (or HEADROOM_CONFIG=FILE headroom serve)
    headroom check --config FILE     validate a configuration and print a summary
    headroom healthcheck             exit 0 if the configured listener's /healthz is 2xx
    headroom sim ...                 serve simulated GPUs (see headroom sim --help)
    headroom probe ...               find a GPU's ceiling (see headroom probe --help)
    headroom demo                    the simulator + the gateway in front of it, one command

Exit codes: 0 success, 1 runtime failure (e.g. a listen or admin port already in use:
one line naming the address and the reason), 2 invalid configuration or usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from proxy import __version__
from proxy.errors import ConfigError, ListenError
from proxy.process.console import say
from proxy.process.eventloop import run_async

if TYPE_CHECKING:
    from proxy.settings import Settings

__all__ = ["main", "run_async"]


def _add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", "-c", metavar="FILE", help="YAML configuration (default: $HEADROOM_CONFIG)"
    )
    parser.add_argument(
        "--env-file",
        metavar="FILE",
        help="a .env file of HEADROOM_* settings, below secret files and the environment "
        "(same as HEADROOM_ENV_FILE=FILE)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="headroom",
        description="Admission-control gateway for streaming speech models.",
    )
    parser.add_argument("--version", action="version", version=f"headroom {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the gateway")
    _add_config(serve)
    serve.add_argument("--host", help="override listen.host")
    serve.add_argument("--port", type=int, help="override listen.port")
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes on one listen socket; more than 1 needs admission.backend "
        "redis (caps shared through Redis; see docs/shared-admission.md)",
    )
    # A worker started by `serve --workers N` (proxy.process.workers): its index and the file
    # descriptors of the sockets the supervisor bound.
    serve.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    serve.add_argument("--worker-fds", default=None, help=argparse.SUPPRESS)

    check = sub.add_parser("check", help="validate a configuration and print a summary")
    _add_config(check)

    from proxy.process.healthcheck import add_arguments as add_healthcheck_arguments

    healthcheck = sub.add_parser(
        "healthcheck", help="exit 0 if the configured listener's /healthz answers 2xx"
    )
    add_healthcheck_arguments(healthcheck)

    from proxy.sim.sim_command import add_arguments as add_sim_arguments

    sim = sub.add_parser("sim", help="serve simulated GPUs speaking the upstream protocols")
    add_sim_arguments(sim)

    from proxy.probe.probe_command import add_arguments as add_probe_arguments

    probe = sub.add_parser(
        "probe",
        help="find a GPU's real ceiling: ramp concurrency until the worst-1%% per-chunk "
        "delivery ratio, a listener's playback or TTFA p99 breaks its rule",
    )
    add_probe_arguments(probe)

    from proxy.process.demo import add_arguments as add_demo_arguments

    demo = sub.add_parser("demo", help="run the gateway in front of a 2-GPU simulator")
    add_demo_arguments(demo)
    return parser


def _load(args: argparse.Namespace, overrides: dict[str, Any] | None = None) -> Any:
    from proxy.settings import load_settings
    from proxy.settings.environment import ENV_FILE_VAR

    if args.env_file:
        # In the environment, so a reload and the --workers processes read it too.
        os.environ[ENV_FILE_VAR] = args.env_file
    settings = load_settings(args.config)
    if overrides:
        listen = settings.listen.model_copy(update=overrides)
        settings = settings.model_copy(update={"listen": listen})
    return settings


def _tracing_refusal(settings: Settings) -> str | None:
    """Why ``settings`` cannot run here (tracing on without the ``[otel]`` extra), or None."""
    from proxy.tracing import NO_OTEL, otel_available

    return NO_OTEL if settings.tracing.enabled and not otel_available() else None


def _serve(args: argparse.Namespace) -> int:
    if args.workers < 1:
        say("headroom: --workers must be at least 1")
        return 2
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    start = None
    if args.worker_fds is not None:  # a worker of `serve --workers`: the supervisor's text
        from proxy.process.workers import worker_start

        start = worker_start(args.worker_fds, args.config or os.environ.get("HEADROOM_CONFIG"),
                             overrides)  # fmt: skip
        settings = start.settings
    else:
        settings = _load(args, overrides)
    from proxy.admission.redis_backend import redis_available

    if settings.admission.backend == "redis" and not redis_available():
        say(
            "headroom: admission.backend is redis but the 'redis' package is not installed: "
            "pip install 'headroom-proxy[redis]' (or set admission.backend: memory)"
        )
        return 2
    refusal = _tracing_refusal(settings)
    if refusal is not None:
        say(f"headroom: {refusal}")
        return 2
    if args.workers > 1 and settings.admission.backend != "redis":
        from proxy.process.workers import memory_refusal

        say(memory_refusal(args.workers))
        return 2
    from proxy.logs import configure_logging
    from proxy.process.gateway import Gateway

    configure_logging(settings.log_level, settings.log_format)
    config_path = args.config or os.environ.get("HEADROOM_CONFIG")
    if args.workers > 1:
        from proxy.process.workers import supervise

        for warning in settings.warnings():
            say(f"headroom: warning: {warning}")
        return supervise(settings, args.workers, args)
    if args.worker_fds is None:
        for warning in settings.warnings():  # a worker's supervisor has printed them
            say(f"headroom: warning: {warning}")

    async def run() -> None:
        gateway: Gateway
        if start is not None:
            from proxy.process.workers import make_worker

            gateway = make_worker(start, args.worker_fds, args.worker_index, config_path)
        else:
            gateway = Gateway(settings, config_path=config_path)
        say(f"headroom: serving on http://{settings.listen.host}:{gateway.port}")
        await gateway.serve()

    run_async(run())
    return 0


def _check(args: argparse.Namespace) -> int:
    from proxy.settings import summary
    from proxy.sim.gpu_memory_check import check_gpus

    settings = _load(args)
    print(summary(settings))
    from proxy.admission.redis_backend import redis_available

    if settings.admission.backend == "redis" and not redis_available():
        say(
            "headroom check: refused: admission.backend is redis but the 'redis' package is "
            "not installed: pip install 'headroom-proxy[redis]'"
        )
        return 2
    refusal = _tracing_refusal(settings)
    if refusal is not None:
        say(f"headroom check: refused: {refusal}")
        return 2
    gpu_lines, findings = check_gpus(settings)  # co-location (proxy.sim.gpu_memory_check)
    for line in gpu_lines:
        print(line)
    for warning in settings.warnings():
        print(f"warning: {warning}")
    for finding in findings:
        if finding.level != "error":
            print(f"{finding.level}: {finding}")
    errors = [finding for finding in findings if finding.level == "error"]
    for finding in errors:
        say(f"headroom check: refused: {finding}")
    return 2 if errors else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "check":
            return _check(args)
        if args.command == "healthcheck":
            from proxy.process.healthcheck import run as run_healthcheck

            return run_healthcheck(args)
        if args.command == "sim":
            from proxy.sim.sim_command import run as run_sim

            return run_sim(args)
        if args.command == "probe":
            from proxy.probe.probe_command import run as run_probe

            return run_probe(args)
        if args.command == "demo":
            from proxy.process.demo import run as run_demo

            return run_demo(args)
    except ConfigError as err:
        say(f"headroom: {err}")
        return 2
    except ListenError as err:  # a busy or unavailable port: one line, no traceback
        say(f"headroom: {err}")
        return 1
    except KeyboardInterrupt:
        return 130
    parser.print_help()
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
