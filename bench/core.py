"""Cost of one admission decision in the pure core (issue: <= 10 us).

    python bench/core.py [--n 200000]

Measures arrive+release pairs on a pool of 8 replicas x 12 slots with a queue,
half full, and prints the median per decision over several repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

from proxy.admission import Admit, PoolCore, QueuePolicy, ReplicaSpec


def run(n: int) -> list[float]:
    core = PoolCore("bench", [ReplicaSpec(f"gpu{i}", 12) for i in range(8)], QueuePolicy(32, 10.0))
    now = 0.0
    held = []
    for _ in range(48):  # half full
        d = core.arrive(now)
        assert isinstance(d, Admit)
        held.append(d.ticket)
    per_decision: list[float] = []
    for _ in range(7):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            d = core.arrive(now)
            assert isinstance(d, Admit)
            core.release(d.ticket, now)
            now += 0.001
        elapsed = time.perf_counter_ns() - t0
        per_decision.append(elapsed / (2 * n) / 1000.0)
    return per_decision


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=100_000)
    args = parser.parse_args()
    runs = run(args.n)
    print("admission decision (arrive or release), 8 replicas x 12 slots, half full:")
    print(
        f"  median {statistics.median(runs):.2f} us  min {min(runs):.2f} us  "
        f"over {len(runs)} runs of {2 * args.n} decisions"
    )


if __name__ == "__main__":
    main()
