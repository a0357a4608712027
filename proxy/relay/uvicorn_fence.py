"""The fence around Headroom's use of uvicorn internals.

The WebSocket splice (:mod:`proxy.relay.uvicorn_ws`) subclasses uvicorn's private
``websockets_sansio_impl.WebSocketsSansIOProtocol`` and uses attributes and methods that
uvicorn does not promise to keep. ``pyproject.toml`` bounds uvicorn to the versions the
tests ran on, but an install may still bring another one (a constraints file, a distro
package). So at start-up :func:`websocket_protocol` checks that every internal the splice
uses is there -- the names are read from the splice module's own source, so a new use
cannot escape the check -- and, if one is missing, serves WebSockets with uvicorn's own
protocol and Headroom's ASGI relay (:mod:`proxy.relay.ws_pump`) instead, with one
warning. Sessions then cost more CPU per frame but stay correct; nothing breaks on the
first WebSocket.

Nothing else in Headroom touches uvicorn internals except the request-head limits
(:mod:`proxy.relay.uvicorn_http`), which are checked the same way by their own tests.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import logging
from collections.abc import Callable
from functools import cache
from types import ModuleType

__all__ = [
    "FALLBACK_PROTOCOL",
    "assigned_attributes",
    "assigned_in",
    "splice_problems",
    "websocket_protocol",
]

log = logging.getLogger("headroom.gateway")

#: uvicorn's ``ws`` setting used when the splice cannot run.
FALLBACK_PROTOCOL = "websockets-sansio"

_SPLICE_MODULE = "proxy.relay.uvicorn_ws"
_SPLICE_CLASS = "HeadroomWebSocketProtocol"
_UVICORN_INIT = "_uvicorn_init"  # the splice's copy of uvicorn's constructor


def _self_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names read or called as ``self.X``, names assigned as ``self.X = ...``)."""
    used: set[str] = set()
    assigned: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            used.add(node.attr)
            if isinstance(node.ctx, ast.Store):
                assigned.add(node.attr)
    return used, assigned


def assigned_in(source_of: type | Callable[..., object]) -> set[str]:
    """The names a class or function assigns as ``self.X``, read from its source. Raises
    OSError or TypeError when the source cannot be read."""
    source = inspect.cleandoc("\n" + inspect.getsource(source_of))
    return _self_names(ast.parse(source))[1]


def _class_node(module_source: str, name: str) -> ast.ClassDef:
    for node in ast.walk(ast.parse(module_source)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"class {name} not found")


def assigned_attributes(parent: type) -> tuple[set[str], list[str]]:
    """Attributes the parent classes assign on ``self`` (from their source), and
    problems reading that source."""
    assigned: set[str] = set()
    problems: list[str] = []
    for cls in parent.__mro__:
        if cls is object or cls.__module__.startswith("asyncio"):
            continue
        try:
            assigned |= assigned_in(cls)
        except (OSError, TypeError) as exc:
            problems.append(f"cannot read the source of {cls.__module__}.{cls.__qualname__}: {exc}")
    return assigned, problems


def splice_problems(module: ModuleType | str = _SPLICE_MODULE) -> list[str]:
    """What the splice needs from uvicorn and the installed uvicorn lacks (empty: all
    there). ``module`` is the splice module or its name."""
    if isinstance(module, str):
        try:
            module = importlib.import_module(module)
        except ImportError as exc:
            return [f"uvicorn has no sans-I/O WebSocket protocol ({exc})"]
    splice = getattr(module, _SPLICE_CLASS)
    parent = splice.__mro__[1]
    ours = _class_node(inspect.getsource(module), _SPLICE_CLASS)
    methods = {n.name for n in ours.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    init = next((n for n in ours.body if getattr(n, "name", "") == "__init__"), None)
    own_attributes = _self_names(init)[1] if init is not None else set()
    used = _self_names(ours)[0]
    # uvicorn's attributes we read or write, and uvicorn's methods we call or extend
    # (super().x); our own attributes (set in our __init__) and helpers need nothing.
    required = (used - own_attributes - methods) | (_overrides(ours) - {"__init__"})
    parent_assigned, problems = assigned_attributes(parent)
    if problems:
        return problems
    missing = sorted(n for n in required if n not in parent_assigned and not hasattr(parent, n))
    where = f"{parent.__module__}.{parent.__qualname__}"
    problems = [f"{where} has no {name!r}" for name in missing]
    # Our copy of uvicorn's constructor (_uvicorn_init; the names it assigns are
    # required above) must also set everything uvicorn's sets, but for what we define
    # ourselves (the lazy ``conn`` property).
    copy = next((n for n in ours.body if getattr(n, "name", "") == _UVICORN_INIT), None)
    if copy is not None:
        try:
            theirs = assigned_in(parent.__init__)
        except (OSError, TypeError) as exc:
            return [f"cannot read the source of {where}.__init__: {exc}"]
        unset = sorted(theirs - _self_names(copy)[1] - methods)
        problems += [
            f"{where}.__init__ sets {name!r}, which {_UVICORN_INIT} does not" for name in unset
        ]
    return problems


def _overrides(ours: ast.ClassDef) -> set[str]:
    """Methods of ours that call ``super().<same name>`` (they extend uvicorn's)."""
    names: set[str] = set()
    for fn in ours.body:
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and node.value.func.id == "super"
            ):
                names.add(node.attr)
    return names


@cache
def websocket_protocol(module: ModuleType | str = _SPLICE_MODULE) -> type[asyncio.Protocol] | str:
    """uvicorn's ``ws`` setting: the splice protocol when every internal it needs is
    there, otherwise uvicorn's own sans-I/O protocol (sessions go through the ASGI
    relay), with one warning naming what is missing. Decided once per process."""
    problems = splice_problems(module)
    if problems:
        log.warning(
            "WebSocket splice disabled, sessions use the ASGI relay (more CPU per frame): "
            "the installed uvicorn lacks what it needs: %s",
            "; ".join(problems),
        )
        return FALLBACK_PROTOCOL
    if isinstance(module, str):
        module = importlib.import_module(module)
    protocol: type[asyncio.Protocol] = getattr(module, _SPLICE_CLASS)
    return protocol
