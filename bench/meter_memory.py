"""Memory a session meter holds as its session streams, under tracemalloc.

Run: ``python bench/meter_memory.py [--sessions 500] [--tree DIR]``. It makes
``--sessions`` :class:`proxy.metering.session_meter.SessionMeter` objects with a sink that discards
what it
is given, feeds each one chunk of 40 ms audio every 40 ms (arrivals jittered by up to
+-2 ms, seeded), and prints the bytes traced per session after 100, 300 and 1,500 chunks:
the exact-sample phase of a session's quantile sketches, just after they turn to
histograms, and a one-minute stream. ``--tree`` measures the Headroom in another source
tree (``git archive <rev> | tar -x -C DIR``) to compare two revisions; the interpreted
build is measured (tracemalloc sees Python allocations either way).
"""

from __future__ import annotations

import argparse
import random
import sys
import tracemalloc
from pathlib import Path
from typing import Any

CHECKPOINTS = (100, 300, 1500)


class _Discard:
    """A replica sink that takes every call and keeps nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    from proxy.metering.session_meter import SessionMeter  # the tree's own

    rng = random.Random(1)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    meters = [SessionMeter(0.0, _Discard()) for _ in range(args.sessions)]
    now, fed = 0.0, 0
    for checkpoint in CHECKPOINTS:
        for _ in range(fed, checkpoint):
            now += 0.04
            for meter in meters:
                meter.audio(now + 0.004 * (rng.random() - 0.5), 0.04)
        fed = checkpoint
        per_session = (tracemalloc.get_traced_memory()[0] - before) / args.sessions
        print(f"{checkpoint:5d} chunks: {per_session:6.0f} B a session")


if __name__ == "__main__":
    main()
