"""Prometheus rules: promtool-valid, unit-tested, runbook-annotated, and copied faithfully."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from .support import (
    CHART,
    DEPLOY,
    REPO,
    RULE_FILES,
    RULE_TESTS,
    alert_rules,
    load_yaml,
    load_yaml_docs,
    require_tool,
    rule_groups,
)


def _promtool(*args: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    promtool = require_tool("promtool")
    return subprocess.run(
        [promtool, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_rule_files_exist() -> None:
    assert {p.name for p in RULE_FILES} >= {
        "headroom-alerts.rules.yaml",
        "headroom-recording.rules.yaml",
    }
    assert RULE_TESTS, "no promtool unit tests in deploy/prometheus/tests"


def test_promtool_check_rules() -> None:
    result = _promtool("check", "rules", *RULE_FILES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules() -> None:
    result = _promtool("test", "rules", *RULE_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_test_rules_detects_a_wrong_expectation(tmp_path: Path) -> None:
    # Guards against unit tests that pass whatever the rules do (e.g. rule_files resolving
    # to nothing): the same tests with one expected value changed must fail.
    source = RULE_TESTS[0]
    text = source.read_text()
    assert "value: 1.445" in text
    broken = text.replace("value: 1.445", "value: 1.5", 1).replace(
        "../rules/", f"{(source.parent / '../rules').resolve()}/"
    )
    target = tmp_path / "broken.test.yaml"
    target.write_text(broken)
    result = _promtool("test", "rules", target)
    assert result.returncode != 0, result.stdout


def test_every_alert_is_unit_tested_firing() -> None:
    fired: set[str] = set()
    for path in RULE_TESTS:
        for case in load_yaml(path)["tests"]:
            for check in case.get("alert_rule_test", []):
                if check.get("exp_alerts"):
                    fired.add(check["alertname"])
    untested = {r["alert"] for r in alert_rules()} - fired
    assert not untested, f"alerts without a firing promtool test: {sorted(untested)}"


def test_every_alert_has_a_runbook_and_a_severity() -> None:
    for rule in alert_rules():
        annotations = rule.get("annotations", {})
        for key in ("summary", "description", "action"):
            assert len(annotations.get(key, "").split()) >= 5, f"{rule['alert']}: {key}"
        assert rule.get("labels", {}).get("severity") in {"page", "warning"}, rule["alert"]


def _alert_exprs() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for r in alert_rules()}


@pytest.mark.parametrize(
    ("name", "fragment", "severity"),
    [
        ("HeadroomDeliveryRatioLow", "headroom_delivery_ratio_worst_1pct < 1.2", "page"),
        ("HeadroomChunkGapP99High", "headroom_chunk_gap_seconds:p99_5m > 1", "warning"),
        ("HeadroomPlaybackUnderruns", "headroom_playback_midstream_underruns", "warning"),
        ("HeadroomQueuePersistentlyNonEmpty", "headroom_queue_depth > 0", "warning"),
        ("HeadroomRefusalsSpiking", "headroom_session_rejections", "warning"),
        ("HeadroomReplicaUnhealthy", "headroom_replica_healthy == 0", "warning"),
        ("HeadroomPoolNoHealthyReplica", "headroom_replica_healthy", "page"),
        ("HeadroomGuardEngaged", "headroom_replica_guarded", "warning"),
        # what clients waited (queue included), not the engine's part alone
        (
            "HeadroomTimeToFirstAudioHigh",
            "pool:headroom_client_time_to_first_audio_seconds:p95_5m > 2",
            "warning",
        ),
        ("HeadroomPipelineStageNearKnee", "headroom_pipeline_limiting_stage == 1", "warning"),
        ("HeadroomPriorityClassStarving", 'decision="admitted"', "warning"),
    ],
)
def test_required_alerts(name: str, fragment: str, severity: str) -> None:
    rule = _alert_exprs()[name]
    assert fragment in " ".join(rule["expr"].split())
    assert rule["labels"]["severity"] == severity


def test_compose_prometheus_config_is_valid_and_loads_the_rules(tmp_path: Path) -> None:
    config = load_yaml(DEPLOY / "compose" / "prometheus.yml")
    assert config["rule_files"] == ["/etc/prometheus/rules/*.rules.yaml"]
    config["rule_files"] = [str(DEPLOY / "prometheus" / "rules" / "*.rules.yaml")]
    target = tmp_path / "prometheus.yml"
    target.write_text(yaml.safe_dump(config))
    result = _promtool("check", "config", target)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(RULE_FILES)} rule files found" in result.stdout, result.stdout


def _prometheus_rule(path: Path) -> dict[str, Any]:
    return next(d for d in load_yaml_docs(path) if d["kind"] == "PrometheusRule")


def test_kubernetes_prometheusrule_carries_exactly_the_source_rules() -> None:
    rule = _prometheus_rule(DEPLOY / "kubernetes" / "gateway" / "prometheusrule.yaml")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == rule_groups(), "stale: run deploy/prometheus/sync.py"


def test_kubernetes_prometheusrule_passes_promtool(tmp_path: Path) -> None:
    rule = _prometheus_rule(DEPLOY / "kubernetes" / "gateway" / "prometheusrule.yaml")
    extracted = tmp_path / "from-prometheusrule.yaml"
    extracted.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = _promtool("check", "rules", extracted)
    assert result.returncode == 0, result.stdout + result.stderr


def test_helm_chart_copies_are_byte_identical() -> None:
    for source in RULE_FILES:
        copy = CHART / "files" / "rules" / source.name
        assert copy.read_bytes() == source.read_bytes(), f"stale {copy}: run sync.py"
    assert sorted(p.name for p in (CHART / "files" / "rules").iterdir()) == sorted(
        p.name for p in RULE_FILES
    )
    dashboard = DEPLOY / "grafana" / "dashboards" / "headroom-overview.json"
    copy = CHART / "files" / "dashboards" / dashboard.name
    assert copy.read_bytes() == dashboard.read_bytes(), f"stale {copy}: run sync.py"


def test_sync_script_reports_no_stale_copy() -> None:
    result = subprocess.run(
        [sys.executable, str(DEPLOY / "prometheus" / "sync.py"), "--check"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
