"""The per-chunk modules, and whether they run compiled.

Every audio chunk of a spliced WebSocket session goes through the same few modules: the
leg's frame walk and its session, the relay core and the session record, the protocol
adapter, the session meter with its playback model and quantile sketches, and the
replica's Prometheus series. They can be compiled to C extension modules with mypyc
(``HEADROOM_MYPYC=1`` when building; the Docker image does, see docs/performance.md).
The source is the same and so is the behaviour; Python imports a compiled module in
place of the ``.py`` beside it. An install without them (the default ``pip install``)
runs the same code interpreted.

A compiled module older than its source (by more than :data:`STALE_AFTER_S`) is
*stale*: an in-place build left behind after the source was edited. Python still
imports it, so start-up warns about it.

``python -m proxy.speedups`` prints the state of each module; ``--require-compiled``
exits 1 unless all of them are compiled and none is stale (CI checks its compiled build
with it).

Compiled classes take no interpreted subclasses and no attribute monkeypatching: extend
them by wrapping, as tests/unit/test_meter_collector.py does.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass
from importlib.machinery import EXTENSION_SUFFIXES

__all__ = ["HOT_MODULES", "STALE_AFTER_S", "BuildStatus", "build_status", "main", "module_state"]

#: The modules setup.py compiles when HEADROOM_MYPYC=1 (setup.py reads this tuple).
HOT_MODULES: tuple[str, ...] = (
    "proxy.relay.wsframes",
    "proxy.relay.splice_leg",
    "proxy.relay.splice",
    "proxy.relay.relay_core",
    "proxy.relay.session_states",
    "proxy.relay.session_actions",
    "proxy.relay.deadlines",
    "proxy.relay.session_record",
    "proxy.metering.adapters.speech_ws_audio",
    "proxy.metering.session_meter",
    "proxy.metering.playback",
    "proxy.metering.sketches",
    "proxy.metering.rolling",
    "proxy.metering.replica_series",
)


@dataclass(frozen=True, slots=True)
class BuildStatus:
    """Each of :data:`HOT_MODULES` as imported: compiled, interpreted, or stale
    (compiled, but older than its source)."""

    compiled: tuple[str, ...]
    interpreted: tuple[str, ...]
    stale: tuple[str, ...]

    @property
    def all_compiled(self) -> bool:
        return not self.interpreted and not self.stale

    def describe(self) -> str:
        """One line for the start-up log."""
        total = len(self.compiled) + len(self.interpreted)
        if not self.compiled:
            return f"per-chunk modules interpreted (0 of {total} compiled)"
        text = f"per-chunk modules compiled with mypyc: {len(self.compiled)} of {total}"
        if self.interpreted:
            text += f" (interpreted: {', '.join(self.interpreted)})"
        return text


#: A source this much newer than its compiled module was edited after the build. (An
#: install writes both within a moment, in no set order: a smaller margin could call a
#: fresh install stale.)
STALE_AFTER_S = 10.0


def module_state(path: str) -> str:
    """``compiled``, ``stale`` or ``interpreted``: how a module loaded from ``path``
    runs."""
    for suffix in EXTENSION_SUFFIXES:
        if path.endswith(suffix):
            source = path[: -len(suffix)] + ".py"
            if (
                os.path.exists(source)
                and os.path.getmtime(source) > os.path.getmtime(path) + STALE_AFTER_S
            ):
                return "stale"
            return "compiled"
    return "interpreted"


def build_status() -> BuildStatus:
    """Import each of :data:`HOT_MODULES` and report how it was loaded."""
    states = {
        name: module_state(getattr(importlib.import_module(name), "__file__", None) or "")
        for name in HOT_MODULES
    }
    return BuildStatus(
        compiled=tuple(n for n, s in states.items() if s != "interpreted"),
        interpreted=tuple(n for n, s in states.items() if s == "interpreted"),
        stale=tuple(n for n, s in states.items() if s == "stale"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m proxy.speedups",
        description="Which per-chunk modules run compiled (mypyc).",
    )
    parser.add_argument(
        "--require-compiled",
        action="store_true",
        help="exit 1 unless every module is compiled and none is stale",
    )
    args = parser.parse_args(argv)
    status = build_status()
    for name in HOT_MODULES:
        path = getattr(sys.modules[name], "__file__", None) or ""
        print(f"{name:28} {module_state(path):12} {path}")
    print(status.describe())
    for name in status.stale:
        print(f"stale: {name} is older than its source; rebuild it or remove it", file=sys.stderr)
    if args.require_compiled and not status.all_compiled:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
