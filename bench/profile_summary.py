"""Summarise a py-spy raw (collapsed-stack) profile by function.

    py-spy record -r 250 --format raw -o prof.raw --pid PID -d 20
    python bench/profile_summary.py prof.raw [--top 30] [--per-chunk-us 57.8]

Prints the functions with the most samples on top of the stack (self) and anywhere on
it (inclusive), line numbers folded into their function. With ``--per-chunk-us`` (the
relay's measured CPU per chunk) each share is also shown as microseconds per chunk,
taking the profile's samples as the process's CPU time.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_LINE = re.compile(r":\d+\)$")


def summarise(path: Path) -> tuple[int, Counter[str], Counter[str]]:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_LINE.sub(")", f) for f in stack.split(";")]
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    return total, own, inclusive


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", type=Path)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--per-chunk-us", type=float, default=None)
    args = p.parse_args()
    total, own, inclusive = summarise(args.raw)
    print(f"{total} samples")
    for title, counter in (("self", own), ("inclusive", inclusive)):
        print(f"\n{title}:")
        for frame, n in counter.most_common(args.top):
            share = n / total if total else 0.0
            us = f"  {share * args.per_chunk_us:5.1f} us" if args.per_chunk_us else ""
            print(f"  {share:6.1%}{us}  {frame}")


if __name__ == "__main__":
    main()
