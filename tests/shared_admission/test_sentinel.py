"""Redis Sentinel: the configuration, how the clients are made, and a failover under
load with a real primary, replica and three sentinels (bench/sentinel_failover.py):
the caps hold, admission resumes after the promotion and the sessions running at the
kill survive a failover shorter than lease_ttl_s - fence_margin_s."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proxy.admission.redis_clients import (
    SentinelNodes,
    _data_node_options,
    async_client,
    sync_client,
)
from proxy.errors import ConfigError
from proxy.settings import settings_from_mapping

ROOT = Path(__file__).resolve().parents[2]


def _settings(redis: dict[str, object]) -> object:
    return settings_from_mapping({
        "admission": {"backend": "redis", "redis": redis},
        "pools": [{"name": "tts", "replicas": [{"name": "gpu0", "url": "http://127.0.0.1:9",
                                                 "max_sessions": 1}]}],
        "routes": [{"path": "/v1/audio/speech", "pool": "tts",
                    "protocol": "openai-speech-http"}],
    }, env={})  # fmt: skip


def test_a_sentinel_section_is_read_and_checked() -> None:
    s = _settings(
        {
            "url": "redis://:secret@ignored:6379/2",
            "sentinel": {"master": "mymaster", "nodes": ["10.0.0.1:26379", "s2:26379"]},
        }
    )
    sentinel = s.admission.redis.sentinel  # type: ignore[attr-defined]
    assert sentinel.master == "mymaster" and sentinel.nodes == ["10.0.0.1:26379", "s2:26379"]
    with pytest.raises(ConfigError, match=r"nodes.*host:port"):
        _settings({"sentinel": {"master": "m", "nodes": ["s1"]}})
    with pytest.raises(ConfigError, match="nodes"):
        _settings({"sentinel": {"master": "m", "nodes": []}})
    with pytest.raises(ConfigError, match="unix"):
        _settings({"url": "unix:///run/redis.sock", "sentinel": {"master": "m", "nodes": ["s:1"]}})


def test_the_data_nodes_take_credentials_db_and_tls_from_the_url() -> None:
    assert _data_node_options("rediss://user:p%40ss@ignored:6380/3") == {
        "username": "user",
        "password": "p@ss",
        "db": 3,
        "ssl": True,
    }
    assert _data_node_options("redis://ignored") == {}
    assert _data_node_options(
        "rediss://ignored/1?socket_timeout=5&ssl_cert_reqs=none&health_check_interval=7"
    ) == {"db": 1, "socket_timeout": 5.0, "ssl_cert_reqs": "none",
          "health_check_interval": 7, "ssl": True}  # fmt: skip
    nodes = SentinelNodes.parse("m", ["127.0.0.1:26379", "[::1]:26380"], "sentinel-secret")
    assert nodes.nodes == (("127.0.0.1", 26379), ("::1", 26380))
    assert "secret" not in repr(nodes)


@pytest.mark.parametrize("make", [sync_client, async_client], ids=["sync", "async"])
def test_a_sentinel_client_keeps_the_urls_query_options_over_the_callers(make: Any) -> None:
    nodes = SentinelNodes.parse("m", ["127.0.0.1:26379"], None)
    url = "redis://:secret@ignored/2?socket_timeout=5&health_check_interval=7"
    client = make(url, nodes, socket_timeout=1.0, socket_connect_timeout=0.5, retry_on_timeout=True)
    options = client.connection_pool.connection_kwargs
    assert options["socket_timeout"] == 5.0  # the URL's, as from_url without Sentinel
    assert options["health_check_interval"] == 7
    assert options["socket_connect_timeout"] == 0.5 and options["retry_on_timeout"] is True
    assert options["password"] == "secret" and options["db"] == 2
    assert "host" not in options and "port" not in options
    direct = make(url, None, socket_timeout=1.0).connection_pool.connection_kwargs
    assert direct["socket_timeout"] == options["socket_timeout"]


@pytest.mark.slow
def test_a_primary_killed_under_load_fails_over_without_breaking_a_cap(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        message = "redis-server is not installed (Debian: apt-get install redis-server)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must provide it")
        pytest.skip(message)
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sentinel_failover.py"), "--after", "10",
         "--workdir", str(tmp_path / "work"), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["passed"], report["invariants"]
    assert report["sessions_live_at_kill"] > 0
    assert report["engine"]["over_cap_samples"] == 0
