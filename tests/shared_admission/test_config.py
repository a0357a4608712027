"""The ``admission`` section: validation, and start-up without the redis package."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.errors import ConfigError
from proxy.process.cli import main
from proxy.settings import settings_from_mapping

BASE: dict[str, Any] = {
    "pools": [{"name": "p", "replicas": [{"name": "r", "url": "http://a:1", "max_sessions": 1}]}],
    "routes": [{"path": "/x", "pool": "p", "protocol": "passthrough-ws"}],
    "auth": {"enabled": False},
}


def test_memory_is_the_default_and_closing_is_the_default_on_backend_loss() -> None:
    settings = settings_from_mapping(BASE, env={})
    assert settings.admission.backend == "memory"
    assert settings.admission.on_backend_loss == "close"


@pytest.mark.parametrize(
    ("admission", "field", "reason"),
    [
        ({"backend": "etcd"}, "admission.backend", "memory, redis"),
        ({"redis": {"url": "http://h:6379"}}, "admission.redis.url", "redis://"),
        ({"redis": {"renew_interval_s": 5}}, "admission.redis.renew_interval_s", "two renewals"),
        ({"redis": {"timeout_s": 3}}, "admission.redis.timeout_s", "below renew_interval_s"),
        ({"on_backend_loss": "ignore"}, "admission.on_backend_loss", "close, keep"),
    ],
)
def test_bad_admission_settings_name_the_field(
    admission: dict[str, Any], field: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_mapping({**BASE, "admission": admission}, env={})
    assert any(path == field and reason in why for path, why in info.value.problems), info.value


def test_a_redis_password_in_the_url_is_never_echoed() -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_mapping(
            {**BASE, "admission": {"redis": {"url": "redis://:s3cret@h:bad/0"}}}, env={}
        )
    assert "s3cret" not in str(info.value)
    ok = settings_from_mapping(
        {**BASE, "admission": {"redis": {"url": "rediss://:s3cret@h:6380/0"}}}, env={}
    )
    assert "s3cret" not in repr(ok)


def test_serve_with_redis_backend_and_no_redis_package_fails_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "headroom.yaml"
    config.write_text(yaml.safe_dump({**BASE, "admission": {"backend": "redis"}}))
    monkeypatch.setitem(sys.modules, "redis.asyncio", None)  # import now fails
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'headroom-proxy[redis]'" in err and "admission.backend" in err


def test_the_shipped_shared_redis_example_loads_without_warnings() -> None:
    from proxy.settings import load_settings

    root = Path(__file__).resolve().parents[2]
    settings = load_settings(root / "config" / "gateway-shared-redis.yaml", env={})
    assert settings.admission.backend == "redis"
    assert settings.admission.on_backend_loss == "close"
    assert settings.warnings() == []
