"""The Helm chart: its templates checked statically, and rendered by helm (CI installs it with
deploy/tools/install-k8s-tools.sh; elsewhere the rendered tests skip without it). The
rendered objects are validated against the Kubernetes schema in test_deploy_k8s_schema.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.errors import ConfigError

from .support import (
    CHART,
    CONFIG_PATH,
    PROXY_PORT,
    helm_values_config,
    load_yaml,
    require_tool,
)

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
    # Empty: 1 pod with the default (memory) backend, 2 with redis (headroom.replicas).
    assert values["replicaCount"] == ""
    assert values["admission"]["backend"] == "memory"
    assert values["admission"]["workers"] == 1
    config = helm_values_config()
    assert "admission" not in config
    assert config["listen"]["port"] == PROXY_PORT
    assert values["config"]["drain_timeout_s"] > 0
    assert values["terminationGraceMarginSeconds"] > 0
    assert values["podDisruptionBudget"]["maxUnavailable"] == ""


def test_configmap_renders_config_with_pools_and_routes_via_toyaml() -> None:
    helpers = _text(CHART / "templates" / "_helpers.tpl")
    assert 'set $cfg "pools" .Values.pools' in helpers
    assert 'set $cfg "routes" .Values.routes' in helpers
    assert "toYaml $cfg" in helpers
    deployment = _text(CHART / "templates" / "deployment.yaml")
    assert f'"--config", "{CONFIG_PATH}"' in deployment
    assert "add (int .Values.config.drain_timeout_s)" in deployment
    assert _text(CHART / "templates" / "configmap.yaml").startswith(
        '{{- include "headroom.validate" . }}'
    )


# --- rendered by helm ---------------------------------------------------------------------

MONITORING = ("--api-versions", "monitoring.coreos.com/v1")


def helm() -> str:
    return require_tool("helm", "deploy/tools/install-k8s-tools.sh")


def _render(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm(), "template", "gw", str(CHART), *args], capture_output=True, text=True, timeout=60
    )


def render_docs(*args: str) -> dict[str, dict[str, Any]]:
    """``kind/name`` -> object of the chart rendered with ``args``."""
    result = _render(*args)
    assert result.returncode == 0, result.stderr
    return {
        d["kind"] + "/" + d["metadata"]["name"]: d for d in yaml.safe_load_all(result.stdout) if d
    }


def test_helm_is_a_release_the_chart_is_written_for() -> None:
    """Chart apiVersion v2: helm 3 or 4 (deploy/tools/install-k8s-tools.sh installs 4)."""
    version = subprocess.run(
        [helm(), "version", "--short"], capture_output=True, text=True, timeout=60
    ).stdout
    assert re.match(r"v[34]\.", version), version


def test_helm_lint() -> None:
    for args in ([], ["--set", "admission.backend=redis"], ["--set", "httpRoute.enabled=true",
                 "--set", "httpRoute.parentRefs[0].name=gw"]):  # fmt: skip
        result = subprocess.run(
            [helm(), "lint", "--strict", str(CHART), *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr


def test_helm_render_matches_the_gateway_contract() -> None:
    from proxy.settings import settings_from_mapping

    docs = render_docs("--set", "grafanaDashboard.enabled=true", *MONITORING)
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


def test_helm_refuses_more_than_one_replica() -> None:
    result = _render("--set", "replicaCount=2")
    assert result.returncode != 0
    assert "replicaCount must be 1" in result.stderr
    result = _render("--set", "admission.workers=2")
    assert result.returncode != 0
    assert "admission.workers must be 1" in result.stderr


def test_helm_render_with_redis_runs_two_rolling_gateways_and_a_redis() -> None:
    from proxy.settings import settings_from_mapping

    docs = render_docs("--set", "admission.backend=redis")
    deployment = docs["Deployment/gw-headroom"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert docs["PodDisruptionBudget/gw-headroom"]["spec"]["maxUnavailable"] == 1
    config = yaml.safe_load(docs["ConfigMap/gw-headroom"]["data"]["config.yaml"])
    settings = settings_from_mapping(config, env={})
    assert settings.admission.redis.url == "redis://gw-headroom-redis:6379/0"
    assert "Service/gw-headroom-redis" in docs
    redis = docs["Deployment/gw-headroom-redis"]
    gateway_selector = deployment["spec"]["selector"]["matchLabels"].items()
    assert not gateway_selector <= redis["spec"]["template"]["metadata"]["labels"].items()
    external = _render(
        "--set", "admission.backend=redis", "--set", "admission.redis.url=rediss://r:6380/1"
    )
    assert external.returncode == 0, external.stderr
    assert "gw-headroom-redis" not in external.stdout


def test_helm_render_with_sentinel_finds_the_primary_through_the_sentinels() -> None:
    from proxy.settings import settings_from_mapping

    docs = render_docs(
        "--set", "admission.backend=redis", "--set", "admission.redis.sentinel.master=headroom",
        "--set", "admission.redis.sentinel.nodes={s0:26379,s1:26379}",
    )  # fmt: skip
    assert "Deployment/gw-headroom-redis" not in docs  # no bundled Redis beside Sentinel
    config = yaml.safe_load(docs["ConfigMap/gw-headroom"]["data"]["config.yaml"])
    sentinel = settings_from_mapping(config, env={}).admission.redis.sentinel
    assert sentinel is not None
    assert (sentinel.master, sentinel.nodes) == ("headroom", ["s0:26379", "s1:26379"])


def _values_file(tmp_path: Path, values: dict[str, Any]) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def test_operator_objects_render_only_where_the_cluster_serves_their_api() -> None:
    """Without the Prometheus Operator's CRDs an install must not fail on PodMonitor and
    PrometheusRule: they are left out unless monitoring.coreos.com/v1 is served."""
    operator = {"PodMonitor/gw-headroom", "PrometheusRule/gw-headroom"}
    assert not operator & render_docs().keys()
    assert operator <= render_docs(*MONITORING).keys()
    off = ("--set", "podMonitor.enabled=false", "--set", "prometheusRule.enabled=false")
    assert not operator & render_docs(*MONITORING, *off).keys()
    notes = subprocess.run(
        [helm(), "install", "--dry-run=client", "gw", str(CHART)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert notes.returncode == 0, notes.stderr
    assert "No PodMonitor or PrometheusRule" in notes.stdout


def test_env_env_from_and_extra_volumes_reach_the_gateway_container(tmp_path: Path) -> None:
    values = {
        "env": [{"name": "HEADROOM_LOG_LEVEL", "value": "debug"}],
        "envFrom": [{"secretRef": {"name": "headroom-env"}}],
        "extraVolumes": [{"name": "ca", "secret": {"secretName": "redis-ca"}}],
        "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/headroom-ca", "readOnly": True}],
    }
    docs = render_docs("-f", _values_file(tmp_path, values), "--set", "admission.backend=redis",
                       "--set", "admission.redis.urlSecret.name=redis-url")  # fmt: skip
    pod = docs["Deployment/gw-headroom"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert [e["name"] for e in container["env"]] == [
        "HEADROOM_CONFIG", "HEADROOM_ADMISSION__REDIS__URL", "HEADROOM_LOG_LEVEL",
    ]  # fmt: skip
    assert container["envFrom"] == values["envFrom"]
    assert container["volumeMounts"][-1] == values["extraVolumeMounts"][0]
    assert [v["name"] for v in container["volumeMounts"]] == ["config", "tmp", "ca"]
    assert pod["volumes"][-1] == values["extraVolumes"][0]
    plain = render_docs()["Deployment/gw-headroom"]["spec"]["template"]["spec"]
    assert "envFrom" not in plain["containers"][0]
    assert [v["name"] for v in plain["volumes"]] == ["config", "tmp"]


def test_a_secret_mounted_as_the_secrets_directory_sets_settings(tmp_path: Path) -> None:
    """The values' example: a Secret mounted at /run/secrets is Headroom's secrets
    directory. Its keys, written as the kubelet writes them, set fields of the rendered
    configuration (the admin key's hash here) over config.yaml."""
    from proxy.settings import settings_from_text
    from proxy.settings.sources import DEFAULT_SECRETS_DIR

    values = {
        "extraVolumes": [{"name": "headroom-secrets", "secret": {"secretName": "hs"}}],
        "extraVolumeMounts": [
            {"name": "headroom-secrets", "mountPath": "/run/secrets", "readOnly": True}
        ],
    }
    docs = render_docs("-f", _values_file(tmp_path, values))
    (container,) = docs["Deployment/gw-headroom"]["spec"]["template"]["spec"]["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "headroom-secrets"]
    assert Path(mount["mountPath"]) == DEFAULT_SECRETS_DIR
    config = docs["ConfigMap/gw-headroom"]["data"]["config.yaml"]
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    digest = "ab" * 32
    (secrets / "headroom_admin__api_key_sha256").write_text(digest)
    settings = settings_from_text(config, env={"HEADROOM_SECRETS_DIR": str(secrets)})
    assert settings.admin.api_key_sha256 == digest
    assert settings_from_text(config, env={"HEADROOM_SECRETS_DIR": ""}).admin.api_key_sha256 is None


def test_a_config_change_rolls_the_pods_unless_live_reload_is_chosen() -> None:
    def annotations(*args: str) -> dict[str, str]:
        template = render_docs(*args)["Deployment/gw-headroom"]["spec"]["template"]
        found: dict[str, str] = template["metadata"].get("annotations") or {}
        return found

    default = annotations()["checksum/config"]
    changed = annotations("--set", "config.drain_timeout_s=20")["checksum/config"]
    assert default != changed
    assert annotations("--set", "rollOnConfigChange=false") == {}
    kept = annotations("--set", "rollOnConfigChange=false", "--set", "podAnnotations.team=tts")
    assert kept == {"team": "tts"}


def test_the_pod_monitor_can_scrape_the_admin_listener_with_a_key() -> None:
    """podMonitor.port admin: /metrics off the client port, the admin listener bound for
    Prometheus with the Secret's hash, and the PodMonitor sending the Secret's token."""
    from proxy.settings import settings_from_mapping

    admin = ("--set", "podMonitor.port=admin", "--set", "podMonitor.adminKeySecret.name=ha")
    docs = render_docs(*MONITORING, *admin)
    config = yaml.safe_load(docs["ConfigMap/gw-headroom"]["data"]["config.yaml"])
    assert config["admin"] == {"host": "0.0.0.0", "port": 9901}
    assert config["metrics"] == {"client_port": False}
    (container,) = docs["Deployment/gw-headroom"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["HEADROOM_ADMIN__API_KEY_SHA256"]["valueFrom"]["secretKeyRef"] == {
        "name": "ha", "key": "sha256",
    }  # fmt: skip
    assert {"name": "admin", "containerPort": 9901, "protocol": "TCP"} in container["ports"]
    (endpoint,) = docs["PodMonitor/gw-headroom"]["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "admin" and endpoint["path"] == "/metrics"
    assert endpoint["authorization"] == {
        "type": "Bearer", "credentials": {"name": "ha", "key": "token"},
    }  # fmt: skip
    # The hash the Secret supplies is what lets the admin listener leave loopback.
    hashed = settings_from_mapping(config, env={"HEADROOM_ADMIN__API_KEY_SHA256": "ab" * 32})
    assert hashed.admin.host == "0.0.0.0" and not hashed.metrics.client_port
    with pytest.raises(ConfigError, match="api_key_sha256"):
        settings_from_mapping(config, env={})
    default = render_docs(*MONITORING)
    (endpoint,) = default["PodMonitor/gw-headroom"]["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "http" and "authorization" not in endpoint
    refused = _render("--set", "podMonitor.port=admin")
    assert refused.returncode != 0 and "adminKeySecret.name" in refused.stderr
    no_client = _render("--set", "config.metrics.client_port=false")
    assert no_client.returncode != 0 and "config.metrics.client_port true" in no_client.stderr


def test_the_http_route_sends_the_route_paths_to_the_service(tmp_path: Path) -> None:
    assert not any(key.startswith("HTTPRoute/") for key in render_docs())
    values = {
        "httpRoute": {
            "enabled": True,
            "parentRefs": [{"name": "inference-gateway", "namespace": "gateway-system"}],
            "hostnames": ["tts.example.com"],
        }
    }
    docs = render_docs("-f", _values_file(tmp_path, values))
    route = docs["HTTPRoute/gw-headroom"]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    spec = route["spec"]
    assert spec["parentRefs"] == values["httpRoute"]["parentRefs"]
    assert spec["hostnames"] == ["tts.example.com"]
    service = docs["Service/gw-headroom"]
    paths = []
    for rule in spec["rules"]:
        assert rule["backendRefs"] == [
            {"name": service["metadata"]["name"], "port": service["spec"]["ports"][0]["port"]}
        ]
        assert rule["timeouts"] == {"request": "0s"}
        paths += [m["path"] for m in rule["matches"]]
    assert paths == [{"type": "Exact", "value": r["path"]} for r in helm_values_config()["routes"]]
    refused = _render("--set", "httpRoute.enabled=true")
    assert refused.returncode != 0
    assert "httpRoute.parentRefs: name the Gateway" in refused.stderr


def test_deployment_template_probes_mount_and_strategy() -> None:
    deployment = _resolved("deployment.yaml", MEMORY)
    assert deployment is not None
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["serve", "--config", CONFIG_PATH]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert "lifecycle" not in container
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert mount["mountPath"] + "/config.yaml" == CONFIG_PATH
    assert "subPath" not in mount


# --- admission.backend: the templates with their backend conditions decided ----------------
#
# Without helm, the `if` blocks whose condition is one of the chart's backend switches are
# resolved here for a given set of values (every other action is stripped as above), so the
# memory and the redis variants of each manifest can be checked as YAML.

_SHARED = 'eq (include "headroom.shared" .) "true"'
_BUNDLED = 'eq (include "headroom.bundledRedis" .) "true"'
_WORKERS = "gt (int .Values.admission.workers) 1"
_SECRET = f"and ({_SHARED}) .Values.admission.redis.urlSecret.name"
_ADMIN = 'eq .Values.podMonitor.port "admin"'
_AUTH = 'eq (include "headroom.redisAuth" .) "true"'
MEMORY = {
    _SHARED: False, _BUNDLED: False, _WORKERS: False, _SECRET: False, _ADMIN: False,
    _AUTH: False,
}  # fmt: skip
REDIS_BUNDLED = {
    _SHARED: True, _BUNDLED: True, _WORKERS: False, _SECRET: False, _ADMIN: False, _AUTH: True,
}  # fmt: skip
REDIS_EXTERNAL_WORKERS = {
    _SHARED: True, _BUNDLED: False, _WORKERS: True, _SECRET: True, _ADMIN: False, _AUTH: False,
}  # fmt: skip
_TOKEN = re.compile(r"{{-?\s*(.*?)\s*-?}}", re.S)


def _resolve(text: str, known: dict[str, bool]) -> str:
    """``text`` with every ``if <known condition>`` block replaced by its chosen branch."""
    out: list[str] = []
    # Each open block: [is_known, keeping_now, a branch was taken].
    stack: list[list[bool]] = []
    pos = 0

    def keeping() -> bool:
        return all(frame[1] for frame in stack if frame[0])

    for match in _TOKEN.finditer(text):
        action = match.group(1)
        if keeping():
            out.append(text[pos : match.start()])
        pos = match.end()
        keyword, _, rest = action.partition(" ")
        if keyword == "if" and rest in known:
            stack.append([True, known[rest], known[rest]])
            continue
        if keyword in ("if", "with", "range", "define"):
            stack.append([False, True, True])
        elif keyword == "else" and stack and stack[-1][0]:
            frame = stack[-1]
            condition = rest.removeprefix("if ")
            if rest.startswith("if "):
                assert condition in known, f"unknown else-if condition {condition!r}"
                frame[1] = not frame[2] and known[condition]
            else:
                frame[1] = not frame[2]
            frame[2] = frame[2] or frame[1]
            continue
        elif keyword == "end" and stack.pop()[0]:
            continue
        if keeping():
            out.append(match.group(0))
    assert not stack, "unbalanced template"
    if keeping():
        out.append(text[pos:])
    return "".join(out)


def _resolved(name: str, known: dict[str, bool]) -> dict[str, Any] | None:
    text = _resolve(_text(CHART / "templates" / name), known)
    docs = [d for d in yaml.safe_load_all(_stripped(text)) if d]
    assert len(docs) <= 1, name
    return docs[0] if docs else None


def _define(name: str) -> str:
    """The body of one named template of _helpers.tpl (up to the next one)."""
    helpers = _text(CHART / "templates" / "_helpers.tpl")
    start = helpers.index(f'define "{name}" -}}}}')
    rest = helpers[start:]
    following = re.search(r"\n(?:{{/\*|{{- define )", rest)
    return rest[: following.start()] if following else rest


def test_memory_backend_renders_no_redis_and_one_serving_process() -> None:
    assert _resolved("redis-deployment.yaml", MEMORY) is None
    assert _resolved("redis-service.yaml", MEMORY) is None
    deployment = _resolved("deployment.yaml", MEMORY)
    assert deployment is not None
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["serve", "--config", CONFIG_PATH]
    assert [e["name"] for e in container["env"]] == ["HEADROOM_CONFIG"]


def test_redis_backend_rolls_gateways_and_bundles_a_noeviction_redis() -> None:
    deployment = _resolved("deployment.yaml", REDIS_BUNDLED)
    assert deployment is not None
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }  # fmt: skip
    redis = _resolved("redis-deployment.yaml", REDIS_BUNDLED)
    service = _resolved("redis-service.yaml", REDIS_BUNDLED)
    assert redis is not None and service is not None
    assert redis["kind"] == "Deployment" and service["kind"] == "Service"
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--appendonly") + 1] == "no"
    assert service["spec"]["ports"][0]["port"] == 6379
    # Both name themselves and select with the Redis labels, not the gateway's: the
    # gateway's Service, PDB and PodMonitor must never pick the Redis pod.
    for text in (_text(CHART / "templates" / n) for n in ("redis-deployment.yaml",
                                                           "redis-service.yaml")):  # fmt: skip
        assert 'include "headroom.selectorLabels"' not in text
        assert 'name: {{ include "headroom.redisName" . }}' in text
    assert 'include "headroom.redisSelectorLabels"' in _text(
        CHART / "templates" / "redis-service.yaml"
    )
    redis_labels = _define("headroom.redisSelectorLabels")
    gateway_labels = _define("headroom.selectorLabels")
    assert "-redis" in redis_labels and "-redis" not in gateway_labels
    # The gateway's URL is that Service's name, and the password's URL the same address.
    assert 'printf "%s:6379" (include "headroom.redisName" .)' in _define("headroom.redisAddress")
    assert 'printf "redis://%s/0" (include "headroom.redisAddress" .)' in _define("headroom.config")
    (gateway,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in gateway["env"]}
    assert env["HEADROOM_ADMISSION__REDIS__URL"]["value"] == "redis://:$(REDIS_PASSWORD)@x/0"
    assert "--requirepass" in args and "REDISCLI_AUTH" in {e["name"] for e in container["env"]}


def test_external_redis_from_a_secret_and_several_workers() -> None:
    assert _resolved("redis-deployment.yaml", REDIS_EXTERNAL_WORKERS) is None
    assert _resolved("redis-service.yaml", REDIS_EXTERNAL_WORKERS) is None
    deployment = _resolved("deployment.yaml", REDIS_EXTERNAL_WORKERS)
    assert deployment is not None
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["serve", "--config", CONFIG_PATH, "--workers", "x"]
    env = {e["name"]: e for e in container["env"]}
    assert env["HEADROOM_ADMISSION__REDIS__URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "x", "key": "x",
    }  # fmt: skip


def test_helpers_decide_replicas_pdb_and_refuse_unsafe_values() -> None:
    replicas = _define("headroom.replicas")
    # Empty replicaCount: 2 with redis, 1 otherwise.
    assert re.search(r'"true" }}\s*{{- 2 }}\s*{{- else }}\s*{{- 1 }}', replicas)
    assert 'ne (toString .Values.replicaCount) ""' in replicas
    pdb = _define("headroom.pdbMaxUnavailable")
    assert re.search(r'"true" }}\s*{{- 1 }}\s*{{- else }}\s*{{- 0 }}', pdb)
    assert 'include "headroom.pdbMaxUnavailable"' in _text(CHART / "templates" / "pdb.yaml")
    assert 'replicas: {{ include "headroom.replicas" . }}' in _text(
        CHART / "templates" / "deployment.yaml"
    )
    validate = _define("headroom.validate")
    assert "replicaCount must be 1 with admission.backend memory" in validate
    assert "admission.workers must be 1 with admission.backend memory" in validate
    assert 'has .Values.admission.backend (list "memory" "redis")' in validate


def test_redis_values_render_a_loadable_shared_config() -> None:
    """The admission section headroom.config builds from the default redis values loads
    (bundled Redis URL) and passes the lease/renewal checks."""
    from proxy.settings import settings_from_mapping

    values = _values()
    redis = values["admission"]["redis"]
    (line,) = [ln for ln in _define("headroom.config").splitlines() if "$redis := dict" in ln]
    keys = re.findall(r'"(\w+)" \$r\.(\w+)', line)
    assert keys and all(a == b for a, b in keys)
    section = {k: redis[k] for k, _ in keys}
    section["url"] = "redis://gw-headroom-redis:6379/0"
    config = {
        **helm_values_config(),
        "admission": {"backend": "redis", "on_backend_loss": values["admission"]["on_backend_loss"],
                      "redis": section},
    }  # fmt: skip
    settings = settings_from_mapping(config, env={})
    assert settings.admission.backend == "redis"
    assert settings.admission.on_backend_loss == "close"
    assert settings.warnings() == []
    # url, urlSecret and sentinel are rendered by their own branches of headroom.config.
    assert set(redis) - {"url", "urlSecret", "sentinel"} == {k for k, _ in keys}


# --- image registry, Redis auth, NetworkPolicies (rendered) -------------------------------

REDIS = ("--set", "admission.backend=redis")


def _containers(docs: dict[str, dict[str, Any]], deployment: str) -> dict[str, Any]:
    spec = docs[f"Deployment/{deployment}"]["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["containers"]}


def test_images_come_from_the_registry_the_values_name() -> None:
    default = render_docs(*REDIS)
    assert _containers(default, "gw-headroom")["headroom"]["image"] == "headroom:0.1.0"
    assert _containers(default, "gw-headroom-redis")["redis"]["image"] == "redis:7.2-alpine"
    docs = render_docs(
        *REDIS, "--set", "image.registry=registry.example.com/voice/", "--set", "image.tag=1.2.3",
        "--set", "admission.bundledRedis.image.registry=mirror.example.com",
        "--set", "imagePullSecrets[0].name=pull",
    )  # fmt: skip
    gateway = _containers(docs, "gw-headroom")["headroom"]
    assert gateway["image"] == "registry.example.com/voice/headroom:1.2.3"
    assert _containers(docs, "gw-headroom-redis")["redis"]["image"] == (
        "mirror.example.com/redis:7.2-alpine"
    )
    for name in ("gw-headroom", "gw-headroom-redis"):
        pod = docs[f"Deployment/{name}"]["spec"]["template"]["spec"]
        assert pod["imagePullSecrets"] == [{"name": "pull"}], name


def _secret_ref(env: dict[str, Any], name: str) -> dict[str, str]:
    ref: dict[str, str] = env[name]["valueFrom"]["secretKeyRef"]
    return ref


def test_the_bundled_redis_requires_a_password_that_the_gateways_send() -> None:
    """The chart's Secret holds a random password; Redis requires it (and its readiness
    probe's redis-cli sends it); the gateways' URL carries it once the kubelet expands
    $(REDIS_PASSWORD), and overrides the ConfigMap's URL."""
    import base64
    from urllib.parse import urlsplit

    from proxy.settings import settings_from_mapping

    docs = render_docs(*REDIS)
    secret = docs["Secret/gw-headroom-redis-auth"]
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password)
    ref = {"name": "gw-headroom-redis-auth", "key": "password"}
    redis = _containers(docs, "gw-headroom-redis")["redis"]
    redis_env = {e["name"]: e for e in redis["env"]}
    assert _secret_ref(redis_env, "REDIS_PASSWORD") == ref
    assert _secret_ref(redis_env, "REDISCLI_AUTH") == ref
    args = redis["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert redis["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
    gateway = _containers(docs, "gw-headroom")["headroom"]
    names = [e["name"] for e in gateway["env"]]
    # The kubelet expands $(VAR) only from variables defined before it.
    assert names.index("REDIS_PASSWORD") < names.index("HEADROOM_ADMISSION__REDIS__URL")
    env = {e["name"]: e for e in gateway["env"]}
    assert _secret_ref(env, "REDIS_PASSWORD") == ref
    url = env["HEADROOM_ADMISSION__REDIS__URL"]["value"].replace("$(REDIS_PASSWORD)", password)
    config = yaml.safe_load(docs["ConfigMap/gw-headroom"]["data"]["config.yaml"])
    settings = settings_from_mapping(config, env={"HEADROOM_ADMISSION__REDIS__URL": url})
    parts = urlsplit(settings.admission.redis.url)
    assert (parts.password, parts.hostname, parts.port) == (password, "gw-headroom-redis", 6379)
    assert password not in docs["ConfigMap/gw-headroom"]["data"]["config.yaml"]


def test_redis_auth_from_an_existing_secret_or_none() -> None:
    existing = render_docs(
        *REDIS, "--set", "admission.bundledRedis.auth.existingSecret=team-redis",
        "--set", "admission.bundledRedis.auth.existingSecretKey=pw",
    )  # fmt: skip
    assert not any(key.startswith("Secret/") for key in existing)
    ref = {"name": "team-redis", "key": "pw"}
    for deployment, container in (("gw-headroom", "headroom"), ("gw-headroom-redis", "redis")):
        env = {e["name"]: e for e in _containers(existing, deployment)[container]["env"]}
        assert _secret_ref(env, "REDIS_PASSWORD") == ref, deployment
    refused = _render(*REDIS, "--set", "admission.bundledRedis.auth.existingSecret=team-redis",
                      "--set", "admission.bundledRedis.auth.existingSecretKey=")  # fmt: skip
    assert refused.returncode != 0 and "existingSecretKey" in refused.stderr
    off = render_docs(*REDIS, "--set", "admission.bundledRedis.auth.enabled=false")
    assert not any(key.startswith("Secret/") for key in off)
    redis = _containers(off, "gw-headroom-redis")["redis"]
    assert "--requirepass" not in redis["args"] and "env" not in redis
    gateway_env = [e["name"] for e in _containers(off, "gw-headroom")["headroom"]["env"]]
    assert gateway_env == ["HEADROOM_CONFIG"]
    # An external Redis brings its own password (url / urlSecret): no Secret of the chart's.
    external = render_docs(*REDIS, "--set", "admission.redis.url=rediss://:pw@r:6380/1")
    assert not any(key.startswith(("Secret/", "NetworkPolicy/")) for key in external)


def test_the_rendered_redis_args_and_probe_work_on_a_real_redis(tmp_path: Path) -> None:
    """The bundled Redis's args, as the kubelet expands them, make a real redis-server refuse
    a client without the password, and its readiness probe (redis-cli with REDISCLI_AUTH)
    answer PONG."""
    import base64
    import os
    import time

    import redis as redis_py

    server = require_tool("redis-server", "Debian: apt-get install redis-server")
    cli = require_tool("redis-cli", "Debian: apt-get install redis-server")
    docs = render_docs(*REDIS)
    password = base64.b64decode(docs["Secret/gw-headroom-redis-auth"]["data"]["password"]).decode()
    args = [a.replace("$(REDIS_PASSWORD)", password)
            for a in _containers(docs, "gw-headroom-redis")["redis"]["args"]]  # fmt: skip
    socket = tmp_path / "redis.sock"
    process = subprocess.Popen(
        [server, *args, "--port", "0", "--unixsocket", str(socket), "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not socket.exists():
            assert process.poll() is None and time.monotonic() < deadline, "redis did not start"
            time.sleep(0.02)
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(unix_socket_path=str(socket)).ping()
        assert redis_py.Redis(unix_socket_path=str(socket), password=password).ping()
        probe = subprocess.run(
            [cli, "-s", str(socket), "ping"], capture_output=True, text=True, timeout=30,
            env={**os.environ, "REDISCLI_AUTH": password},
        )  # fmt: skip
        assert probe.stdout.strip() == "PONG", probe.stdout + probe.stderr
    finally:
        process.terminate()
        process.wait(timeout=30)


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_the_bundled_redis_takes_connections_from_the_gateways_only() -> None:
    docs = render_docs(*REDIS)
    policy = docs["NetworkPolicy/gw-headroom-redis"]["spec"]
    gateway_pod = docs["Deployment/gw-headroom"]["spec"]["template"]["metadata"]["labels"]
    redis_pod = docs["Deployment/gw-headroom-redis"]["spec"]["template"]["metadata"]["labels"]
    assert _labels_match(policy["podSelector"]["matchLabels"], redis_pod)
    assert not _labels_match(policy["podSelector"]["matchLabels"], gateway_pod)
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    (peer,) = rule["from"]
    assert peer.keys() == {"podSelector"}  # this namespace's pods, no other namespace
    assert _labels_match(peer["podSelector"]["matchLabels"], gateway_pod)
    assert not _labels_match(peer["podSelector"]["matchLabels"], redis_pod)
    redis_ports = {p["name"] for p in _containers(docs, "gw-headroom-redis")["redis"]["ports"]}
    assert [p["port"] for p in rule["ports"]] == ["redis"] and "redis" in redis_ports
    off = render_docs(*REDIS, "--set", "networkPolicy.redis.enabled=false")
    assert not any(key.startswith("NetworkPolicy/") for key in off)
    assert not any(key.startswith("NetworkPolicy/") for key in render_docs())


def test_the_gateway_policy_admits_clients_and_the_scraper_to_their_ports(tmp_path: Path) -> None:
    assert "NetworkPolicy/gw-headroom" not in render_docs()
    scraper = [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]
    clients = [{"namespaceSelector": {"matchLabels": {"team": "voice"}}}]
    admin = {"podMonitor": {"port": "admin", "adminKeySecret": {"name": "ha"}},
             "networkPolicy": {"gateway": {"enabled": True, "scraper": scraper}}}  # fmt: skip
    docs = render_docs("-f", _values_file(tmp_path, admin))
    policy = docs["NetworkPolicy/gw-headroom"]["spec"]
    pod = docs["Deployment/gw-headroom"]["spec"]["template"]
    assert _labels_match(policy["podSelector"]["matchLabels"], pod["metadata"]["labels"])
    port_names = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    client_rule, admin_rule = policy["ingress"]
    assert [p["port"] for p in client_rule["ports"]] == ["http"]
    assert "from" not in client_rule  # no clients listed: any source
    assert [p["port"] for p in admin_rule["ports"]] == ["admin"]
    assert admin_rule["from"] == scraper
    assert {"http", "admin"} <= port_names
    # Clients listed, /metrics on the client port: the scraper joins the clients, and
    # there is no admin rule (the admin listener stays on loopback).
    values = {"networkPolicy": {"gateway": {"enabled": True, "clients": clients,
                                            "scraper": scraper}}}  # fmt: skip
    (rule,) = render_docs("-f", _values_file(tmp_path, values))["NetworkPolicy/gw-headroom"][
        "spec"
    ]["ingress"]
    assert [p["port"] for p in rule["ports"]] == ["http"]
    assert rule["from"] == clients + scraper
    no_scraper = {"podMonitor": admin["podMonitor"],
                  "networkPolicy": {"gateway": {"enabled": True}}}  # fmt: skip
    refused = _render("-f", _values_file(tmp_path, no_scraper))
    assert refused.returncode != 0 and "networkPolicy.gateway.scraper" in refused.stderr
