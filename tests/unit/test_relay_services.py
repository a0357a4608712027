"""The relays' narrow interface (proxy.relay.services): the runtime provides every
member, and no module of proxy.relay imports the runtime (not even for type checking)."""

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
RELAY_MODULES = sorted(path.name for path in RELAY.glob("*.py"))


def _members() -> set[str]:
    return {name for name, _ in inspect.getmembers(RelayServices) if not name.startswith("_")}


def test_the_runtime_provides_every_relay_service() -> None:
    members = _members()
    assert {"clock", "settings", "upstream_error", "register_session", "reservations"} <= members
    assert len(members) <= 20  # a narrow interface, not the runtime again
    route = {"path": "/ws", "pool": "main", "protocol": "passthrough-ws"}
    rt = Runtime(proxy_settings([("gpu0", "http://127.0.0.1:9", 1)], [route]))
    missing = [name for name in sorted(members)
               if not hasattr(Runtime, name) and name not in vars(rt)]  # fmt: skip
    assert missing == []


def _imports(source: str) -> set[str]:
    """Every module a source file imports, wherever the import is (inside
    ``if TYPE_CHECKING:`` or a function too); ``from proxy import runtime`` counts as
    ``proxy.runtime``."""
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    return imported


def test_every_relay_module_is_checked() -> None:
    expected = {"ws_session.py", "http_session.py", "admit.py", "lifecycle.py", "splice.py"}
    assert expected <= set(RELAY_MODULES)


@pytest.mark.parametrize("module", RELAY_MODULES)
def test_no_relay_module_imports_the_runtime(module: str) -> None:
    imported = _imports((RELAY / module).read_text())
    assert not {name for name in imported if name.startswith("proxy.runtime")}


@pytest.mark.parametrize(
    "source",
    [
        "from proxy.runtime import Runtime",
        "import proxy.runtime",
        "from proxy import runtime",
        "if TYPE_CHECKING:\n    from proxy.runtime import Runtime",
    ],
)
def test_the_import_check_sees_every_form(source: str) -> None:
    assert "proxy.runtime" in _imports(source)
