"""Serve one simulated GPU in its own process, for real-time probe tests.

    python -m tests.probe.simserver PRESET [--max-sessions-proxy N]

Prints one JSON line ``{"url": ...}`` when listening and serves until stdin closes
(the test's end) or SIGTERM. A separate process keeps the simulator's step loop off the
probe's event loop, as it is off a real client's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys

from proxy.sim import running_cluster
from tests.probe.presets import probe_preset


async def main(name: str) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_reader(sys.stdin.fileno(), stop.set)  # EOF (or anything) on stdin: stop
    async with running_cluster(probe_preset(name), gpus=1, port=0) as cluster:
        print(json.dumps({"url": cluster.urls[0]}), flush=True)
        await stop.wait()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(sys.argv[1]))
