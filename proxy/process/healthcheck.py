"""``headroom healthcheck``: ask the running gateway's ``/healthz`` (liveness) on the port
its configuration gives, read the same way ``headroom serve`` reads it (the file named by
``--config`` or ``$HEADROOM_CONFIG``, then the ``HEADROOM_*`` environment). For a
container's HEALTHCHECK, where a port set in the file must count as much as one set in
the environment.

Exit status: 0 when ``/healthz`` answers 2xx, 1 when it answers anything else, refuses the
connection or does not answer within ``--timeout``, 2 for an invalid configuration.

``python -m proxy.process.healthcheck`` is the same without the rest of the ``headroom`` command's
imports (the simulator, the probe): the image runs it every few seconds.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import sys

from proxy.errors import ConfigError
from proxy.process.console import say

__all__ = ["add_arguments", "main", "probe_address", "run"]

_WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", "-c", metavar="FILE", help="YAML configuration (default: $HEADROOM_CONFIG)"
    )
    parser.add_argument(
        "--timeout", type=float, default=2.0, metavar="S", help="seconds to wait (default 2)"
    )


def probe_address(host: str) -> str:
    """Where to reach a listener bound to ``host``: its loopback for a wildcard address."""
    return _WILDCARDS.get(host, host)


def run(args: argparse.Namespace) -> int:
    """Carry out ``headroom healthcheck``. Raises ``ConfigError`` for a bad configuration."""
    from proxy.settings import load_settings

    if not args.timeout > 0:
        say("headroom healthcheck: --timeout must be positive")
        return 2
    settings = load_settings(args.config)
    host = probe_address(settings.listen.host)
    port = settings.listen.port
    try:
        shown = f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:  # a host name
        shown = host
    url = f"http://{shown}:{port}/healthz"
    connection = http.client.HTTPConnection(host, port, timeout=args.timeout)
    try:
        connection.request("GET", "/healthz")
        status = connection.getresponse().status
    except (OSError, http.client.HTTPException) as exc:
        say(f"headroom healthcheck: {url}: {exc or type(exc).__name__}")
        return 1
    finally:
        connection.close()
    if 200 <= status < 300:
        return 0
    say(f"headroom healthcheck: {url} answered {status}")
    return 1


def main(argv: list[str] | None = None) -> int:
    """``python -m proxy.process.healthcheck [--config FILE] [--timeout S]``."""
    parser = argparse.ArgumentParser(
        prog="python -m proxy.process.healthcheck", description=__doc__.split("\n\n")[0]
    )
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ConfigError as err:
        say(f"headroom healthcheck: {err}")
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
