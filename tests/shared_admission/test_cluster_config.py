"""The ``redis+cluster://`` URL: read into seeds and options, checked at start-up with
the field and the reason, never echoing the password."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from proxy.admission.redis_clients import cluster_nodes
from proxy.settings.admission import RedisSettings


def test_seeds_credentials_and_options_are_read() -> None:
    nodes = cluster_nodes("rediss+cluster://u:s3cret@a:7000,[::1]:7001/0?socket_timeout=3")
    assert nodes is not None
    assert nodes.seeds == (("a", 7000), ("::1", 7001))
    assert nodes.options["password"] == "s3cret"
    assert nodes.options["username"] == "u"
    assert nodes.options["ssl"] is True
    assert nodes.options["socket_timeout"] == 3.0
    assert "db" not in nodes.options
    assert "s3cret" not in repr(nodes)


def test_other_urls_are_not_a_cluster() -> None:
    assert cluster_nodes("redis://a:6379/0") is None
    assert cluster_nodes("unix:///run/redis.sock") is None


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis+cluster://:s3cret@a", "each cluster seed must be host:port"),
        ("redis+cluster://:s3cret@a:1,b", "each cluster seed must be host:port"),
        ("redis+cluster://:s3cret@a:99999", "each cluster seed must be host:port"),
        ("redis+cluster://:s3cret@a:1/2", "a Redis Cluster has only database 0"),
    ],
)
def test_a_malformed_cluster_url_is_refused_with_the_reason(url: str, reason: str) -> None:
    with pytest.raises(ValidationError) as info:
        RedisSettings(url=url)
    errors = info.value.errors(include_input=False)
    assert errors[0]["loc"] == ("url",)
    assert reason in errors[0]["msg"]
    assert "s3cret" not in errors[0]["msg"]


def test_a_cluster_is_not_found_through_sentinel() -> None:
    with pytest.raises(ValidationError, match="not found through sentinel"):
        RedisSettings(url="redis+cluster://a:1", sentinel={"master": "m", "nodes": ["s:26379"]})


def test_a_cluster_url_is_accepted() -> None:
    assert RedisSettings(url="redis+cluster://a:1,b:2").url == "redis+cluster://a:1,b:2"


def test_the_summary_lists_the_seeds_without_the_password() -> None:
    from types import SimpleNamespace

    from proxy.settings.summary import admission_line

    redis = RedisSettings(url="redis+cluster://u:s3cret@redis-0:7000,redis-1:7001/0")
    admission = SimpleNamespace(backend="redis", redis=redis, on_backend_loss="close")
    line = admission_line(SimpleNamespace(admission=admission))  # type: ignore[arg-type]
    assert line.startswith("admission redis redis+cluster://***@redis-0:7000,redis-1:7001 (")
    assert "a Redis Cluster" in line
    assert "s3cret" not in line
    plain = admission_line(
        SimpleNamespace(
            admission=SimpleNamespace(  # type: ignore[arg-type]
                backend="redis",
                redis=RedisSettings(url="redis://a:6379/0"),
                on_backend_loss="close",
            )
        )
    )
    assert plain.startswith("admission redis redis://a:6379/0 (caps shared")
