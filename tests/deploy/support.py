"""Shared helpers for the static checks of the deployment assets (no Docker, no cluster)."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import Counter, Histogram

from proxy.admission.reservations import ReservationMetrics
from proxy.admission.shared_gate import SharedAdmissionMetrics
from proxy.metering.loop_lateness import LoopWatch
from proxy.metering.scrape import ReplicaGauges, TenantGauges
from proxy.metering.series import Metrics
from proxy.pool_headroom import HeadroomReport, PipelineHeadroom, PoolHeadroom

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
RULES_DIR = DEPLOY / "prometheus" / "rules"
RULE_FILES = sorted(RULES_DIR.glob("*.rules.yaml"))
RULE_TESTS = sorted((DEPLOY / "prometheus" / "tests").glob("*.yaml"))
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "headroom-overview.json"
CHART = DEPLOY / "helm" / "headroom"
CONFIG_PATH = "/etc/headroom/config.yaml"
PROXY_PORT, PROMETHEUS_PORT, GRAFANA_PORT = 8080, 9090, 3000
#: The Kubernetes manifests' admin key: the Secret headroom-admin holds it (key token,
#: which the PodMonitors send) and its SHA-256 (key sha256, which the pods get as
#: HEADROOM_ADMIN__API_KEY_SHA256; without it an admin listener off loopback is refused).
ADMIN_SECRET = "headroom-admin"
ADMIN_KEY = "scrape-key"
ADMIN_ENV = {"HEADROOM_ADMIN__API_KEY_SHA256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}


def require_tool(name: str, install: str = "Debian: apt-get install prometheus") -> str:
    """The tool's path. Missing: a failure under CI (which installs it), a skip elsewhere."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed ({install})"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must provide it")
        pytest.skip(message)
    return path


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = []
    for path in RULE_FILES:
        groups.extend(load_yaml(path)["groups"])
    return groups


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in rule_groups() for r in g["rules"] if "alert" in r]


def recording_rules() -> list[dict[str, Any]]:
    return [r for g in rule_groups() for r in g["rules"] if "record" in r]


# --- PromQL metric names -------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def headroom_series(expr: str) -> set[str]:
    """The ``headroom_*`` series names an expression selects.

    String literals (label values, regexes) are removed first; identifiers containing a colon
    are recording-rule names (``pool:headroom_x:rate5m``), not exported metrics.
    """
    code = _STRING.sub('""', expr)
    return {tok for tok in _IDENT.findall(code) if tok.startswith("headroom_") and ":" not in tok}


def recording_rule_names(expr: str) -> set[str]:
    code = _STRING.sub('""', expr)
    return {tok for tok in _IDENT.findall(code) if ":" in tok and "headroom_" in tok}


_SELECTOR = re.compile(r"(headroom_[A-Za-z0-9_]+)\s*(\{[^}]*\})?")


def selectors(expr: str) -> list[tuple[str, str]]:
    """``(metric, label matchers)`` for every ``headroom_*`` selector in ``expr``."""
    return [(m.group(1), m.group(2) or "") for m in _SELECTOR.finditer(expr)]


# --- what proxy.metering.series exports -----


def _metrics() -> tuple[Metrics, list[object]]:
    """A gateway's metrics with every family given a sample, and the metric objects of
    the families registered beside its own (shared admission, reservations)."""
    metrics = Metrics()
    gauges = ReplicaGauges(
        pool="p", replica="r", active=1, slots=2, healthy=True, guarded=False,
        delivery_ratio_worst_1pct=1.5, engine_waiting=0.0, engine_running=1.0, engine_kv_usage=0.5,
        engine_unadmitted=0,
    )  # fmt: skip
    metrics.bind_state(lambda: [gauges], lambda: [("p", 0)])
    # The age of each replica's engine figures (engine scraping on: proxy/upstreams.py).
    metrics.bind_engine_scrape(lambda: [("p", "r", 1.0)])
    # Headroom left per pool and a pipeline's limiting stage (pipelines: configured).
    pool = PoolHeadroom("p", slots_usable=2, slots_free=1, delivery_ratio_worst_1pct=1.5,
                        threshold=1.2)  # fmt: skip
    headroom = HeadroomReport((pool,), (PipelineHeadroom("agent", (pool,), "p"),))
    metrics.bind_headroom(lambda: headroom)
    # Per API key (auth.keys): scrape-time gauges and session-seconds (issue 18).
    metrics.bind_tenants(lambda: [TenantGauges("p", "t", 0, 1, 0, 1.0)])
    # The shared admission backend's series (admission.backend: redis), with a sample each.
    shared = SharedAdmissionMetrics(metrics.registry)
    shared.backend_up.labels("redis").set(1)
    shared.held.labels("p", "r", "pool").set(1)
    shared.queue_depth.labels("p", "pool").set(0)
    shared.lease_loss_closes.labels("p")
    # Gang reservations (issue 19): counters on the gateway's registry.
    reservations = ReservationMetrics(metrics.registry)
    # The event loop's lag and stalls (every gateway: proxy/metering/loop_lateness.py).
    watch = LoopWatch(metrics.registry)
    loop = [watch.lag_histogram, watch.stall_counter]
    return metrics, [*vars(shared).values(), *vars(reservations).values(), *loop]


def _give_a_child(metric: Counter | Histogram) -> None:
    """Give a labelled ``metric`` one child, so that its family is sampled with its label
    names (prometheus_client publishes them only on samples): ``labels`` with as many
    values as it takes. An unlabelled metric refuses every count and samples itself; a
    definition of what a collector exports (proxy.metering.series) refuses children."""
    for count in range(8):
        try:
            metric.labels(*(f"v{i}" for i in range(count)))
        except ValueError:  # not that many labels
            continue
        except TypeError:  # a definition whose family a collector exports (its own series)
            return
        return


def exported_series() -> dict[str, set[str]]:
    """Series name -> label names, as Prometheus will see them after a scrape.

    Histograms expose only ``_bucket``/``_sum``/``_count`` (``le`` on buckets); counters only
    ``_total`` (client_python's family name drops the suffix). ``_created`` is left out:
    nothing should query it.
    """
    metrics, others = _metrics()
    # Every family sampled: one series of each per-chunk replica family (their collector
    # exports the series Metrics.replica_series made), one child of every labelled metric.
    metrics.replica_series("p", "r")
    # dir(), not vars(): Metrics may be compiled (proxy/speedups.py), with no __dict__
    own = [getattr(metrics, name) for name in dir(metrics) if not name.startswith("__")]
    for attr in [*own, *others]:
        if isinstance(attr, Counter | Histogram):
            _give_a_child(attr)
    series: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        if family.name.startswith("headroom_"):
            assert family.samples, f"{family.name}: no samples; give it one in _metrics()"
            if family.type not in ("histogram", "counter"):
                labelled = any(s.labels for s in family.samples)
                assert labelled, f"{family.name}: gauge without labels; set every field"
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                series.setdefault(sample.name, set()).update(sample.labels)
    return series


# --- Dockerfiles ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: int


def dockerfile_instructions(path: Path) -> list[Instruction]:
    """Instructions with line continuations joined; ``stage`` counts FROMs from 0."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, f"{path}: dangling line continuation"
    out: list[Instruction] = []
    stage = -1
    for line in lines:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, args.strip(), stage))
    return out


def copy_sources(instruction: Instruction) -> list[str]:
    """Build-context sources of a COPY/ADD (none for ``--from`` copies)."""
    args = instruction.args
    if args.startswith("["):
        import json

        parts = json.loads(args)
    else:
        parts = shlex.split(args)
    flags = [p for p in parts if p.startswith("--")]
    if any(f.startswith("--from") for f in flags):
        return []
    paths = [p for p in parts if not p.startswith("--")]
    return paths[:-1]


def dockerignore_excludes(patterns: list[str], rel_path: str) -> bool:
    """Whether ``rel_path`` is excluded by .dockerignore ``patterns`` (last match wins;
    a pattern also matches everything below a matching directory)."""
    from fnmatch import fnmatchcase

    excluded = False
    parts = rel_path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip("/")
        for prefix in prefixes:
            matched = fnmatchcase(prefix, pattern) or (
                pattern.startswith("**/") and fnmatchcase(prefix.split("/")[-1], pattern[3:])
            )
            if matched:
                excluded = not negate
                break
    return excluded


def dockerignore_patterns(path: Path) -> list[str]:
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


# --- Headroom configurations ----------------------------------------------------------------


def configmap_config(path: Path, name: str | None = None) -> dict[str, Any]:
    """The parsed ``config.yaml`` of the (named) ConfigMap in a manifest file."""
    for doc in load_yaml_docs(path):
        if doc.get("kind") == "ConfigMap" and (name is None or doc["metadata"]["name"] == name):
            data: dict[str, Any] = yaml.safe_load(doc["data"]["config.yaml"])
            return data
    raise AssertionError(f"{path}: no ConfigMap {name or ''} with config.yaml")


def helm_values_config() -> dict[str, Any]:
    """What the chart's ConfigMap renders from its default values: config + pools + routes."""
    values = load_yaml(CHART / "values.yaml")
    return {**values["config"], "pools": values["pools"], "routes": values["routes"]}


def all_headroom_configs() -> Iterator[tuple[str, dict[str, Any]]]:
    """Every Headroom configuration the deployment assets ship, by where it lives."""
    yield "deploy/compose/headroom.yaml", load_yaml(DEPLOY / "compose" / "headroom.yaml")
    yield "deploy/sagemaker/headroom.yaml", load_yaml(DEPLOY / "sagemaker" / "headroom.yaml")
    yield (
        "deploy/kubernetes/gateway/configmap.yaml",
        configmap_config(DEPLOY / "kubernetes" / "gateway" / "configmap.yaml"),
    )
    yield (
        "deploy/kubernetes/sidecar/vllm-with-headroom.yaml",
        configmap_config(DEPLOY / "kubernetes" / "sidecar" / "vllm-with-headroom.yaml"),
    )
    yield "deploy/helm/headroom/values.yaml", helm_values_config()
