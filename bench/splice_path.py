"""CPU of the splice's per-chunk path in one process: a spliced session's upstream leg
reads one 9.6 KB binary frame (0.2 s of 24 kHz PCM16) and relays it, metered on
``vllm-omni-speech-ws`` into a real :class:`proxy.metering.session_meter.SessionMeter` and the
replica's
Prometheus sink, on transports whose ``write`` does nothing.

    python bench/splice_path.py                  # the working tree
    python bench/splice_path.py --tree /tmp/a    # another source tree (compiled or not)

What it leaves out is what every relay pays: the event loop, the read and write system
calls and the kernel's loopback (bench/relay.py measures those, side by side with
nginx). Each session first streams ``--warmup`` chunks, so its quantile sketches have
switched to histograms (a long session's steady state), then ``--chunks`` are timed;
the figure is process CPU per chunk, the median of ``--sessions`` sessions with the
range. ``python -m proxy.speedups`` in the same tree says whether it ran compiled.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

CHUNK_BYTES = 9600
PACING_S = 0.04


class NullTransport(asyncio.Transport):
    """Takes every write and does nothing with it."""

    def write(self, data: Any) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_reading(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def set_protocol(self, protocol: Any) -> None:
        pass


class Lease:
    pool = "bench"
    replica = "gpu0"


def run(sessions: int, warmup: int, chunks: int) -> list[float]:
    """Microseconds of process CPU per chunk, one figure per session."""
    from proxy.clock import FakeClock
    from proxy.metering.adapters import AudioFormat, ws_adapter
    from proxy.metering.rolling import ReplicaSignals
    from proxy.metering.series import Metrics
    from proxy.metering.session_meter import PrometheusReplicaSink, SessionMeter
    from proxy.relay.session_record import SessionRecord
    from proxy.relay.splice import Splice, frame
    from proxy.settings import LimitsSettings

    class Services:
        def __init__(self, clock: FakeClock) -> None:
            self.clock = clock

        def upstream_error(self, pool: str, replica: str, kind: str) -> None:
            pass

    loop = asyncio.new_event_loop()
    clock = FakeClock()
    limits = LimitsSettings(ping_interval_s=0, idle_timeout_s=0, max_session_s=0)
    sink = PrometheusReplicaSink(Metrics(), "bench", "gpu0", ReplicaSignals())
    payload = bytes(range(256)) * (CHUNK_BYTES // 256) + bytes(CHUNK_BYTES % 256)
    chunk = frame(2, payload, masked=False)
    fmt = AudioFormat(24000, 1, 2)
    figures = []
    for _ in range(sessions):
        meter = SessionMeter(clock.now(), sink)
        adapter = ws_adapter("vllm-omni-speech-ws", meter, fmt)
        record = SessionRecord("bench", "/ws", "bench", "ws", clock.now())
        splice = Splice(Services(clock), Lease(), adapter, record, limits, loop)  # type: ignore[arg-type]
        splice.start(NullTransport(), b"", NullTransport(), b"", False)
        leg = splice.upstream
        for _ in range(warmup):
            clock.advance(PACING_S)
            leg.data_received(chunk)
        started = time.process_time()
        for _ in range(chunks):
            clock.advance(PACING_S)
            leg.data_received(chunk)
        figures.append((time.process_time() - started) / chunks * 1e6)
        splice.stop(1000, "done")
    loop.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", help="import proxy from this source tree")
    p.add_argument("--sessions", type=int, default=7)
    p.add_argument("--warmup", type=int, default=600)
    p.add_argument("--chunks", type=int, default=20000)
    args = p.parse_args(argv)
    root = Path(args.tree).resolve() if args.tree else Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from proxy.speedups import build_status

    figures = run(args.sessions, args.warmup, args.chunks)
    status = build_status()
    build = "interpreted" if not status.compiled else "mixed" if status.interpreted else "compiled"
    if status.stale:
        build += ", stale modules"
    print(
        f"{root} ({build}): {statistics.median(figures):.3f} us a chunk "
        f"({min(figures):.3f}-{max(figures):.3f}, {args.sessions} sessions)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
