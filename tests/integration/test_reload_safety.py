"""A live reload applies whole or not at all: the admin key, addresses, a file cut short."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proxy.settings import settings_from_text
from tests.integration.test_operations import config, running_gateway
from tests.integration.test_ws_relay import upstream

__all__ = ["upstream"]

ADMIN_KEY = "admin-key-one"
OTHER_KEY = "admin-key-two"


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _with_admin_key(url: str, key: str | None, **admin: Any) -> dict[str, Any]:
    cfg = config(url, 1)
    cfg["admin"] = {"host": "127.0.0.1", "port": 0, **admin}
    if key is not None:
        cfg["admin"]["api_key_sha256"] = _sha(key)
    return cfg


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and text in r.getMessage()]  # fmt: skip


async def test_a_reload_removing_the_admin_key_is_refused_and_the_key_stays(
    upstream: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server, _ = upstream
    path = tmp_path / "headroom.yaml"
    path.write_text(yaml.safe_dump(_with_admin_key(server.http_url, ADMIN_KEY)))
    async with running_gateway(path) as gateway, httpx.AsyncClient() as client:
        admin = f"http://127.0.0.1:{gateway.admin_port}"
        before = gateway.runtime.settings
        path.write_text(yaml.safe_dump(_with_admin_key(server.http_url, None)))
        refused = await client.post(admin + "/admin/reload", headers=_bearer(ADMIN_KEY))
        assert refused.status_code == 400, refused.text
        (problem,) = refused.json()["problems"]
        assert problem["field"] == "admin.api_key_sha256"
        assert "removed" in problem["reason"]
        assert _warnings(caplog, "admin.api_key_sha256")
        assert gateway.runtime.settings is before
        assert (await client.get(admin + "/admin/status")).status_code == 401
        ok = await client.get(admin + "/admin/status", headers=_bearer(ADMIN_KEY))
        assert ok.status_code == 200


async def test_a_reload_changing_the_admin_key_applies_at_once_and_warns(
    upstream: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server, _ = upstream
    path = tmp_path / "headroom.yaml"
    path.write_text(yaml.safe_dump(_with_admin_key(server.http_url, ADMIN_KEY)))
    async with running_gateway(path) as gateway, httpx.AsyncClient() as client:
        admin = f"http://127.0.0.1:{gateway.admin_port}"
        path.write_text(yaml.safe_dump(_with_admin_key(server.http_url, OTHER_KEY)))
        reloaded = await client.post(admin + "/admin/reload", headers=_bearer(ADMIN_KEY))
        assert reloaded.status_code == 200, reloaded.text
        assert reloaded.json()["changes"] == ["admin key changed"]
        assert _warnings(caplog, "admin key changed")
        status = admin + "/admin/status"
        assert (await client.get(status, headers=_bearer(ADMIN_KEY))).status_code == 401
        assert (await client.get(status, headers=_bearer(OTHER_KEY))).status_code == 200


async def test_an_admin_address_change_is_reported_and_not_applied(
    upstream: Any, tmp_path: Path
) -> None:
    """The running settings keep saying what runs: the old address, the new key."""
    server, _ = upstream
    path = tmp_path / "headroom.yaml"
    path.write_text(yaml.safe_dump(_with_admin_key(server.http_url, ADMIN_KEY)))
    async with running_gateway(path) as gateway, httpx.AsyncClient() as client:
        admin = f"http://127.0.0.1:{gateway.admin_port}"
        moved = _with_admin_key(server.http_url, OTHER_KEY, port=gateway.admin_port + 1)
        path.write_text(yaml.safe_dump(moved))
        reloaded = await client.post(admin + "/admin/reload", headers=_bearer(ADMIN_KEY))
        assert reloaded.status_code == 200, reloaded.text
        assert reloaded.json()["changes"] == [
            "listen/admin address changes need a restart: not applied",
            "admin key changed",
        ]
        running = gateway.runtime.settings.admin
        assert running.port == 0  # as started (bound to a free port)
        assert running.api_key_sha256 == _sha(OTHER_KEY)


def _with_keys(url: str, cap: int) -> str:
    cfg = config(url, cap)
    cfg["auth"] = {"keys": [
        {"name": "team-a", "sha256": _sha("key-a")},
        {"name": "team-b", "sha256": _sha("key-b"), "max_sessions": 1, "pools": ["main"]},
    ]}  # fmt: skip
    return yaml.safe_dump(cfg, sort_keys=False)  # auth last, each key's fields in order


async def test_a_file_cut_short_inside_auth_keys_is_refused_whole(
    upstream: Any, tmp_path: Path
) -> None:
    """Cut after team-b's hash, the file still parses and validates -- team-b without its
    max_sessions and pool list, the cap raised -- and a reload refuses it whole."""
    server, _ = upstream
    path = tmp_path / "headroom.yaml"
    path.write_text(_with_keys(server.http_url, 1))
    async with running_gateway(path) as gateway, httpx.AsyncClient() as client:
        before = gateway.runtime.settings
        full = _with_keys(server.http_url, 4)
        cut = full[: full.index(_sha("key-b")) + 64]
        shortened = settings_from_text(cut, env={})  # valid on its own: the danger
        team_b = shortened.auth.keys[1] if shortened.auth else None
        assert team_b is not None and team_b.max_sessions is None and team_b.pools == ()
        path.write_text(cut)
        refused = await client.post(f"http://127.0.0.1:{gateway.admin_port}/admin/reload")
        assert refused.status_code == 400, refused.text
        (problem,) = refused.json()["problems"]
        assert problem["field"] == "<file>"
        assert "does not end with a newline" in problem["reason"]
        assert gateway.runtime.settings is before
        path.write_text(full)  # the whole file, written at last
        applied = await client.post(f"http://127.0.0.1:{gateway.admin_port}/admin/reload")
        assert applied.status_code == 200, applied.text
        assert gateway.runtime.settings.pools[0].replicas[0].max_sessions == 4
        assert gateway.runtime.settings.auth == settings_from_text(full, env={}).auth
