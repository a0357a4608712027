"""Every metric the rules and the dashboard query is one that proxy.metering.series exports."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import Histogram

from proxy.metering.series import DELIVERY_RATIO_BUCKETS, GAP_BUCKETS, Metrics

from .support import (
    DASHBOARD,
    alert_rules,
    exported_series,
    headroom_series,
    recording_rule_names,
    recording_rules,
    rule_groups,
    selectors,
)


def _dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    exprs += [a["expr"] for a in board["annotations"]["list"] if "expr" in a]
    return exprs


def _rule_exprs() -> list[str]:
    return [r["expr"] for g in rule_groups() for r in g["rules"]]


# --- the extractor itself --------------------------------------------------------------------


def test_series_extraction_handles_suffixes_colons_and_strings() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (pool, le) (rate(headroom_chunk_gap_seconds_bucket"
        '{pool=~"headroom_not_a_metric"}[5m]))) / pool:headroom_session_rejections:rate5m'
        " + headroom_playback_underruns_total"
    )
    assert headroom_series(expr) == {
        "headroom_chunk_gap_seconds_bucket",
        "headroom_playback_underruns_total",
    }
    assert recording_rule_names(expr) == {"pool:headroom_session_rejections:rate5m"}
    assert _grouping_labels(expr + " unless on (pool, replica) x") == [
        "pool", "le", "pool", "replica",
    ]  # fmt: skip


def test_exported_series_follow_the_exposition_suffixes() -> None:
    series = exported_series()
    assert "headroom_chunk_gap_seconds_bucket" in series
    assert "headroom_chunk_gap_seconds" not in series  # a bare histogram name selects nothing
    assert "headroom_playback_underruns_total" in series
    assert "headroom_playback_underruns" not in series  # counters are exposed with _total
    assert "headroom_engine_requests_waiting" in series
    assert series["headroom_session_decisions_total"] == {"pool", "decision"}
    assert series["headroom_chunk_gap_seconds_bucket"] == {"pool", "replica", "le"}


# --- rules and dashboard ---------------------------------------------------------------------


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_queried_metric_is_exported(source: str) -> None:
    exprs = _rule_exprs() if source == "rules" else _dashboard_exprs()
    used = set().union(*(headroom_series(e) for e in exprs))
    assert used, "no headroom_* metric found: the extractor or the file is broken"
    missing = used - exported_series().keys()
    assert not missing, (
        f"{source} query metrics proxy.metering.series does not export: {sorted(missing)}"
    )


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_label_matcher_and_grouping_uses_real_labels(source: str) -> None:
    series = exported_series()
    exprs = _rule_exprs() if source == "rules" else _dashboard_exprs()
    problems = []
    for expr in exprs:
        for metric, matchers in selectors(expr):
            if metric not in series:
                continue  # reported by the test above
            for label in _matcher_labels(matchers):
                if label not in series[metric]:
                    problems.append(f"{metric} has no label {label!r}: {expr}")
        available = set().union(*(series.get(m, set()) for m in headroom_series(expr)))
        if available:
            for label in _grouping_labels(expr):
                if label not in available:
                    problems.append(f"grouping by {label!r}, which no metric has: {expr}")
    assert not problems, "\n".join(problems)


def _grouping_labels(expr: str) -> list[str]:
    import re

    groups = re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", expr)
    return [label.strip() for group in groups for label in group.split(",") if label.strip()]


def _matcher_labels(matchers: str) -> list[str]:
    import re

    inner = re.sub(r'"(?:[^"\\]|\\.)*"', '""', matchers.strip("{}"))
    return re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", inner)


def test_recording_rules_used_by_alerts_are_defined() -> None:
    defined = {r["record"] for r in recording_rules()}
    used = set().union(*(recording_rule_names(r["expr"]) for r in alert_rules()))
    assert used <= defined, f"undefined recording rules: {sorted(used - defined)}"


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_no_deprecated_name_is_queried(source: str) -> None:
    """Alerts, recording rules and the dashboard use the new names; the deprecated ones are
    only exported (and one recording rule re-records its new name under its old one)."""
    from proxy.metering.series import DEPRECATED_ALIASES

    deprecated_rules = {"pool_replica:headroom_chunk_delivery_ratio:p01_5m"}
    exprs = _rule_exprs() if source == "rules" else _dashboard_exprs()
    used = set().union(*(headroom_series(e) | recording_rule_names(e) for e in exprs))
    assert not used & (DEPRECATED_ALIASES.keys() | deprecated_rules)
    assert "headroom_delivery_ratio_worst_1pct" in exported_series()
    assert set(DEPRECATED_ALIASES) <= exported_series().keys()


def test_dashboard_shows_the_required_signals() -> None:
    used = set().union(*(headroom_series(e) for e in _dashboard_exprs()))
    required = {
        "headroom_delivery_ratio_worst_1pct",
        "headroom_chunk_gap_seconds_bucket",
        "headroom_playback_underruns_total",
        "headroom_playback_stall_seconds_total",
        "headroom_sessions_active",
        "headroom_session_slots",
        "headroom_queue_depth",
        "headroom_queue_wait_seconds_bucket",
        "headroom_session_decisions_total",
        "headroom_time_to_first_audio_seconds_bucket",
        "headroom_client_time_to_first_audio_seconds_bucket",
        "headroom_engine_requests_waiting",
        "headroom_pool_headroom_left_ratio",
        "headroom_pool_slots_free",
        "headroom_pipeline_limiting_stage",
        "headroom_tenant_session_seconds_total",
        "headroom_tenant_queued",
    }
    assert required <= used, f"dashboard lacks {sorted(required - used)}"


def _threshold(expr: str, metric_fragment: str) -> float:
    import re

    match = re.search(re.escape(metric_fragment) + r"\s*([<>]=?)\s*([0-9.]+)", expr)
    assert match, f"no threshold on {metric_fragment} in {expr!r}"
    return float(match.group(2))


def _alert(name: str) -> dict[str, Any]:
    return next(r for r in alert_rules() if r["alert"] == name)


def bucket_edges(histogram: Histogram) -> set[float]:
    """A per-pool histogram's bucket edges, as the ``le`` labels of one pool's series."""
    histogram.labels("p")
    (family,) = histogram.collect()
    return {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}


def test_alert_thresholds_sit_on_bucket_edges() -> None:
    # histogram_quantile interpolates linearly inside a bucket; a threshold between edges
    # would be compared against an interpolation, not a measurement.
    gap = _threshold(_alert("HeadroomChunkGapP99High")["expr"], "p99_5m")
    ratio_guard = _threshold(_alert("HeadroomChunkGapP99High")["expr"], "worst_1pct_5m")
    ratio_page = _threshold(_alert("HeadroomDeliveryRatioLow")["expr"], "ratio_worst_1pct")
    assert gap in GAP_BUCKETS
    assert ratio_guard in DELIVERY_RATIO_BUCKETS
    assert ratio_page == 1.2
    ttfa = _threshold(_alert("HeadroomTimeToFirstAudioHigh")["expr"], "p95_5m")
    assert ttfa in bucket_edges(Metrics().client_time_to_first_audio)


def test_the_clients_time_to_first_audio_buckets_cover_a_full_queue_wait() -> None:
    """The client's figure adds the queue wait (up to a pool's max_wait_s) to the engine's
    part: its buckets hold the engine's edges and reach past the queue-wait histogram's."""
    metrics = Metrics()
    client = bucket_edges(metrics.client_time_to_first_audio)
    assert bucket_edges(metrics.time_to_first_audio) <= client
    finite = [edge for edge in bucket_edges(metrics.queue_wait) if edge != float("inf")]
    assert max(client - {float("inf")}) >= max(finite)
    assert {7.5, 10.0, 15.0} <= client  # a default 10 s queue wait is resolved, not clipped
