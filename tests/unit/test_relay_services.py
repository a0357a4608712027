"""The relays' narrow interface (proxy.relay.services): the runtime provides every
member, and the session relays written against it do not import the runtime."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import proxy
from proxy.relay.services import RelayServices
from proxy.runtime import Runtime
from tests.conftest import proxy_settings

RELAY = Path(proxy.__file__).parent / "relay"
WRITTEN_AGAINST_SERVICES = ["splice.py", "splice_leg.py", "ws_pump.py", "http_exchange.py",
                            "core.py", "services.py"]  # fmt: skip


def _members() -> set[str]:
    return {name for name, _ in inspect.getmembers(RelayServices) if not name.startswith("_")}


def test_the_runtime_provides_every_relay_service() -> None:
    members = _members()
    assert {"clock", "settings", "upstream_error", "register_session"} <= members
    route = {"path": "/ws", "pool": "main", "protocol": "passthrough-ws"}
    rt = Runtime(proxy_settings([("gpu0", "http://127.0.0.1:9", 1)], [route]))
    missing = [name for name in sorted(members)
               if not hasattr(Runtime, name) and name not in vars(rt)]  # fmt: skip
    assert missing == []


@pytest.mark.parametrize("module", WRITTEN_AGAINST_SERVICES)
def test_the_session_relays_do_not_import_the_runtime(module: str) -> None:
    tree = ast.parse((RELAY / module).read_text())
    imported = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module is not None
    } | {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert "proxy.runtime" not in imported
