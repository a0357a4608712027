"""The Helm chart. Without a helm binary (CI has none) the templates are checked statically;
with one on PATH they are also rendered and the output checked like the plain manifests."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .support import CHART, CONFIG_PATH, PROXY_PORT, helm_values_config, load_yaml

TEMPLATES = sorted((CHART / "templates").glob("*"))
_ACTION = re.compile(r"{{-?(.*?)-?}}", re.S)


def _values() -> dict[str, Any]:
    values: dict[str, Any] = load_yaml(CHART / "values.yaml")
    return values


def _text(path: Path) -> str:
    return path.read_text()


def test_chart_metadata() -> None:
    chart = load_yaml(CHART / "Chart.yaml")
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "headroom"
    assert chart["type"] == "application"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])


def test_every_values_reference_exists_in_values_yaml() -> None:
    values = _values()
    missing = []
    for path in TEMPLATES:
        for ref in re.findall(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", _text(path)):
            node: Any = values
            for key in ref.strip(".").split("."):
                if not isinstance(node, dict) or key not in node:
                    missing.append(f"{path.name}: .Values{ref}")
                    break
                node = node[key]
    assert not missing, missing


def test_every_include_is_defined_and_every_file_exists() -> None:
    defined = set(re.findall(r'define "([^"]+)"', _text(CHART / "templates" / "_helpers.tpl")))
    for path in TEMPLATES:
        text = _text(path)
        for name in re.findall(r'include "([^"]+)"', text):
            assert name in defined, f"{path.name}: include {name!r} is not defined"
        for pattern in re.findall(r'\.Files\.(?:Get|Glob) "([^"]+)"', text):
            assert list(CHART.glob(pattern)), f"{path.name}: {pattern} matches no chart file"


def test_template_actions_are_balanced() -> None:
    openers = re.compile(r"^\s*-?\s*(if|with|range|define)\b")
    for path in TEMPLATES:
        depth = 0
        for action in _ACTION.findall(_text(path)):
            if action.strip().startswith("/*"):
                continue
            if openers.match(action):
                depth += 1
            elif re.match(r"^\s*end\b", action):
                depth -= 1
                assert depth >= 0, f"{path.name}: unmatched end"
        assert depth == 0, f"{path.name}: {depth} unclosed block(s)"


def _stripped(text: str) -> str:
    """The template as YAML: lines holding only an action dropped, inline actions -> x."""
    text = re.sub(r"{{-?\s*/\*.*?\*/\s*-?}}", "", text, flags=re.S)
    lines = []
    for line in text.splitlines():
        if re.fullmatch(r"\s*({{.*?}}\s*)+", line):
            continue
        lines.append(_ACTION.sub("x", line))
    return "\n".join(lines)


@pytest.mark.parametrize(
    "path", [p for p in TEMPLATES if p.suffix == ".yaml"], ids=lambda p: p.name
)
def test_templates_are_yaml_once_actions_are_stripped(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(_stripped(_text(path))) if d]
    assert len(docs) == 1, path.name
    assert {"apiVersion", "kind", "metadata"} <= docs[0].keys()


def test_values_keep_one_process_and_a_loadable_config() -> None:
    values = _values()
    assert values["replicaCount"] == 1
    config = helm_values_config()
    assert config["listen"]["port"] == PROXY_PORT
    assert values["config"]["drain_timeout_s"] > 0
    assert values["terminationGraceMarginSeconds"] > 0
    assert values["podDisruptionBudget"]["maxUnavailable"] == 0


def test_configmap_renders_config_with_pools_and_routes_via_toyaml() -> None:
    helpers = _text(CHART / "templates" / "_helpers.tpl")
    assert 'set $cfg "pools" .Values.pools' in helpers
    assert 'set $cfg "routes" .Values.routes' in helpers
    assert "toYaml $cfg" in helpers
    deployment = _text(CHART / "templates" / "deployment.yaml")
    assert f'"--config", "{CONFIG_PATH}"' in deployment
    assert "add (int .Values.config.drain_timeout_s)" in deployment
    assert "ne (int .Values.replicaCount) 1" in _text(CHART / "templates" / "configmap.yaml")


# --- rendered, when helm is available --------------------------------------------------------

HELM = shutil.which("helm")
needs_helm = pytest.mark.skipif(HELM is None, reason="helm is not installed (static checks ran)")


def _render(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run(
        [HELM, "template", "gw", str(CHART), *args], capture_output=True, text=True, timeout=60
    )


@needs_helm
def test_helm_lint() -> None:
    assert HELM is not None
    result = subprocess.run([HELM, "lint", str(CHART)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_helm
def test_helm_render_matches_the_gateway_contract() -> None:
    from proxy.settings import settings_from_mapping

    result = _render("--set", "grafanaDashboard.enabled=true")
    assert result.returncode == 0, result.stderr
    docs = {
        d["kind"] + "/" + d["metadata"]["name"]: d for d in yaml.safe_load_all(result.stdout) if d
    }
    kinds = {key.split("/")[0] for key in docs}
    assert kinds == {
        "ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "PodMonitor",
        "PrometheusRule",
    }  # fmt: skip
    config_map = docs["ConfigMap/gw-headroom"]
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config == helm_values_config()
    settings_from_mapping(config, env={})
    deployment = docs["Deployment/gw-headroom"]
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 1
    assert pod["terminationGracePeriodSeconds"] > config["drain_timeout_s"]
    rule = docs["PrometheusRule/gw-headroom"]
    from .support import rule_groups

    assert sorted(g["name"] for g in rule["spec"]["groups"]) == sorted(
        g["name"] for g in rule_groups()
    )
    assert rule["spec"]["groups"] == sorted(rule_groups(), key=lambda g: g["name"])


@needs_helm
def test_helm_refuses_more_than_one_replica() -> None:
    result = _render("--set", "replicaCount=2")
    assert result.returncode != 0
    assert "replicaCount must be 1" in result.stderr


def test_deployment_template_probes_mount_and_strategy() -> None:
    (deployment,) = [
        d
        for d in yaml.safe_load_all(_stripped(_text(CHART / "templates" / "deployment.yaml")))
        if d
    ]
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["serve", "--config", CONFIG_PATH]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert "lifecycle" not in container
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert mount["mountPath"] + "/config.yaml" == CONFIG_PATH
    assert "subPath" not in mount
