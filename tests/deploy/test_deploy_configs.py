"""Every Headroom configuration shipped with the deployment assets loads with the project's
own loader and fits the deployment around it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from .support import ADMIN_ENV, DEPLOY, all_headroom_configs

CONFIGS = dict(all_headroom_configs())
#: The Kubernetes manifests bind the admin listener for their PodMonitor; their pods get
#: the admin key's hash from a Secret (test_deploy_kubernetes.py checks the wiring).
KUBERNETES = {where for where in CONFIGS if where.startswith("deploy/kubernetes/")}


def _pod_env(where: str) -> dict[str, str]:
    return dict(ADMIN_ENV) if where in KUBERNETES else {}


@pytest.mark.parametrize("where", sorted(CONFIGS))
def test_config_loads_with_load_settings(where: str, tmp_path: Path) -> None:
    from proxy.settings import load_settings

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(CONFIGS[where]))
    # Only the pod's environment: the test runner's HEADROOM_* must not leak.
    settings = load_settings(path, env=_pod_env(where))
    assert settings.warnings() == [], f"{where}: {settings.warnings()}"


def test_the_compose_file_itself_loads() -> None:
    from proxy.settings import load_settings

    settings = load_settings(DEPLOY / "compose" / "headroom.yaml", env={})
    assert [r.name for r in settings.pools[0].replicas] == ["gpu0", "gpu1"]


@pytest.mark.parametrize("where", sorted(CONFIGS))
def test_production_shape(where: str) -> None:
    config: dict[str, Any] = CONFIGS[where]
    assert config["listen"] == {"host": "0.0.0.0", "port": 8080}
    # The admin listener (reload, drain, /metrics) stays on loopback, reachable with
    # `kubectl exec` / `docker exec`, except where a PodMonitor scrapes it with a key.
    assert config["admin"]["host"] == ("0.0.0.0" if where in KUBERNETES else "127.0.0.1")
    # The guard is what keeps a cap that is slightly too high from hurting listeners.
    assert config["guard"]["mode"] == "enforce"
    assert config["guard"]["threshold"] == 1.2
    # Without engine scraping the dashboard's engine-queue contrast panel stays empty.
    assert config["health"]["engine_metrics_interval_s"] > 0
    for pool in config["pools"]:
        for replica in pool["replicas"]:
            assert replica["max_sessions"] >= 1


def test_sagemaker_route() -> None:
    config = CONFIGS["deploy/sagemaker/headroom.yaml"]
    (route,) = config["routes"]
    assert route == {
        "path": "/invocations-bidirectional-stream",
        "pool": "local",
        "protocol": "sagemaker-bidi",
        "inner_protocol": "vllm-realtime",
        "refusal": "close",
        "upstream_path": "/v1/realtime",
    }
    ((replica,),) = [p["replicas"] for p in config["pools"]]
    assert replica["url"] == "http://127.0.0.1:8081"
