"""``headroom probe``: find a GPU's real ceiling by ramping concurrency.

Instead of dividing by a model card's single-stream RTF, the probe ramps concurrency
(1, 2, 4, 8, 16, ...), holds each level in steady state (exactly N sessions open, closed
loop), meters every stream's chunk arrivals with Headroom's own meter, and takes the
largest concurrency whose worst-1% per-chunk delivery ratio stays at or above the
delivery threshold (:data:`proxy.metering.rolling.DELIVERY_THRESHOLD`), bisecting the
first failing bracket to the exact integer. See ``docs/probe.md``.

Modules: :mod:`.analysis` and :mod:`.ceiling` (pure: level figures, the pass rule, the
search, the estimates), :mod:`.workload` (requests, sampling), :mod:`.clients`,
:mod:`.probe_session` and :mod:`.completions_session` (one session per protocol),
:mod:`.ramp` (the asyncio closed loop), :mod:`.report`, :mod:`.plot`, :mod:`.progress`,
:mod:`.traces`, :mod:`.config_edit` (outputs) and :mod:`.probe_command` (the command
line); ``data/`` holds the bundled workloads (:func:`.workload.bundled`). The simulator
runs the same search (:func:`.ceiling.largest_passing`).

Public API::

    from proxy.probe import ProbeSettings, run_probe, ClientOptions, endpoint_url, bundled
"""

from __future__ import annotations

from proxy.probe.analysis import LevelStats, LevelWindow, SessionTrace, level_stats
from proxy.probe.ceiling import CeilingSearch, ProbeSummary, ceiling_of, summarize
from proxy.probe.probe_session import ClientOptions, endpoint_url
from proxy.probe.ramp import ProbeError, ProbeResult, ProbeSettings, run_probe
from proxy.probe.workload import Workload, bundled, load_workload, open_workload

__all__ = [
    "CeilingSearch",
    "ClientOptions",
    "LevelStats",
    "LevelWindow",
    "ProbeError",
    "ProbeResult",
    "ProbeSettings",
    "ProbeSummary",
    "SessionTrace",
    "Workload",
    "bundled",
    "ceiling_of",
    "endpoint_url",
    "level_stats",
    "load_workload",
    "open_workload",
    "run_probe",
    "summarize",
]
