"""The fence around uvicorn internals: a uvicorn that renamed something the splice uses
gives the ASGI relay and one warning, never a broken stream."""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import uvicorn.protocols.websockets.websockets_sansio_impl as uvicorn_impl

import proxy.relay.uvicorn_ws as splice_module
from proxy.relay.uvicorn_fence import FALLBACK_PROTOCOL, splice_problems, websocket_protocol
from proxy.relay.uvicorn_ws import HeadroomWebSocketProtocol

IMPORT = "from uvicorn.protocols.websockets.websockets_sansio_impl import"


def _splice_on(tmp_path: Path, name: str, **renames: str) -> ModuleType:
    """The real splice module, built on a copy of uvicorn's real protocol module in
    which each ``old=new`` attribute or method name is renamed (as a uvicorn release
    might)."""
    source = inspect.getsource(uvicorn_impl)
    for old, new in renames.items():
        assert old in source, old
        source = source.replace(old, new)
    (tmp_path / f"{name}_uvicorn.py").write_text(source)
    splice = inspect.getsource(splice_module)
    assert IMPORT in splice
    (tmp_path / f"{name}_splice.py").write_text(
        splice.replace(IMPORT, f"from {name}_uvicorn import")
    )
    return importlib.import_module(f"{name}_splice")


@pytest.fixture
def on_path(tmp_path: Path) -> Iterator[Path]:
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("renamed")]:
            del sys.modules[name]


def test_the_installed_uvicorn_has_everything_the_splice_uses() -> None:
    assert splice_problems() == []
    assert websocket_protocol() is HeadroomWebSocketProtocol


def test_an_unchanged_copy_passes_the_check(on_path: Path) -> None:
    """The check itself reads sources; a faithful copy must pass (else the renamed
    cases below would prove nothing)."""
    module = _splice_on(on_path, "renamed_none")
    assert splice_problems(module) == []


@pytest.mark.parametrize(
    ("renames", "missing"),
    [
        # a method the splice calls
        ({"handle_parser_exception": "handle_parser_error"}, "handle_parser_exception"),
        # an attribute the splice writes: a silent no-op write if not checked
        ({"self.read_paused": "self.reading_paused"}, "read_paused"),
        # a method the splice extends with super()
        ({"def handle_connect(": "def on_connect("}, "handle_connect"),
        # connection tracking the splice edits by hand
        ({"self.connections": "self.live_connections"}, "connections"),
        # state uvicorn's constructor adds, which the splice's copy of it would not set
        (
            {
                "        self.close_timeout = 10.0\n": "        self.close_timeout = 10.0\n"
                "        self.added_state = None\n"
            },
            "added_state",
        ),
    ],
)
def test_a_renamed_internal_is_named_and_disables_the_splice(
    on_path: Path, renames: dict[str, str], missing: str, caplog: pytest.LogCaptureFixture
) -> None:
    module = _splice_on(on_path, f"renamed_{missing}", **renames)
    problems = splice_problems(module)
    assert any(repr(missing) in p for p in problems), problems
    with caplog.at_level(logging.WARNING, logger="headroom.gateway"):
        assert websocket_protocol(module) == FALLBACK_PROTOCOL
        assert websocket_protocol(module) == FALLBACK_PROTOCOL  # decided once
    warnings = [r for r in caplog.records if "splice disabled" in r.getMessage()]
    assert len(warnings) == 1
    assert missing in warnings[0].getMessage()


def test_a_uvicorn_without_the_sans_io_protocol_falls_back(
    on_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (on_path / "renamed_noimpl_splice.py").write_text(
        inspect.getsource(splice_module).replace(IMPORT, "from renamed_absent_module import")
    )
    problems = splice_problems("renamed_noimpl_splice")
    assert len(problems) == 1 and "no sans-I/O WebSocket protocol" in problems[0]
    with caplog.at_level(logging.WARNING, logger="headroom.gateway"):
        assert websocket_protocol("renamed_noimpl_splice") == FALLBACK_PROTOCOL
    assert "splice disabled" in caplog.text
