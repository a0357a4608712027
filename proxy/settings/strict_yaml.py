"""YAML for configuration files: PyYAML's safe loader, except that a mapping may not
repeat a key.

A plain ``yaml.safe_load`` keeps the last of two equal keys, so ``max_sessions: 4`` followed
by ``max_sessions: 40`` silently gives 40 -- for a hard per-GPU cap that is an outage
waiting to happen. :class:`StrictLoader` refuses it with :class:`DuplicateKeyError`, a
``yaml.MarkedYAMLError`` whose ``problem_mark`` is the repeated key, so every caller that
already reports YAML errors with a line and column reports this one the same way.

Merge keys (``<<: *defaults``) are not duplicates: a key written next to a merge
overrides the merged value, as YAML intends.

A configuration may be megabytes (thousands of API keys), so :func:`load` is built for
size. The parser is libyaml's when PyYAML has it (:data:`BASE_LOADER`), and a document
of plain mappings, sequences and scalars -- what a configuration is -- is built straight
from the parser's events (:func:`_from_events`): one pass, a few Python calls per
scalar, no node tree. Anything else (anchors and aliases, merge keys, explicit tags
other than the scalar ones, a collection as a key, a repeated key, a second document,
nesting deeper than :data:`MAX_FAST_DEPTH`, any error) is loaded again by
:class:`StrictLoader`, PyYAML's node-based path, whose result or error is the answer:
the fast path only ever returns what that path would.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, cast

import yaml
from yaml.constructor import ConstructorError
from yaml.events import (
    DocumentEndEvent,
    DocumentStartEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
    StreamEndEvent,
    StreamStartEvent,
)
from yaml.nodes import MappingNode, Node, ScalarNode

__all__ = [
    "BASE_LOADER",
    "MAX_FAST_DEPTH",
    "DuplicateKeyError",
    "StrictLoader",
    "compose",
    "key_path",
    "load",
]

_MERGE_TAG = "tag:yaml.org,2002:merge"
_STR_TAG = "tag:yaml.org,2002:str"
#: The scalar tags the event path constructs (with the safe loader's own constructors).
_SCALAR_TAGS = frozenset(
    f"tag:yaml.org,2002:{name}" for name in ("null", "bool", "int", "float", "binary", "timestamp")
)
#: The safe loader on libyaml's parser when PyYAML was built with it (its wheels are),
#: else PyYAML's pure-Python one: the same resolvers and constructors either way.
try:
    from yaml import CSafeLoader as BASE_LOADER
except ImportError:  # pragma: no cover - a PyYAML built without libyaml
    from yaml import SafeLoader as BASE_LOADER  # type: ignore[assignment]
#: Deeper nesting than this goes to the node-based path (a configuration is a few levels
#: deep), so a pathological document fails there as it always did.
MAX_FAST_DEPTH = 100


class DuplicateKeyError(ConstructorError):
    """A mapping repeats a key. ``key`` is the repeated key, ``first_line`` (1-based)
    where it first appeared; ``problem_mark`` points at the repetition."""

    def __init__(self, key: Any, first: Node, again: Node) -> None:
        self.key = key
        self.first_line = first.start_mark.line + 1
        problem = (
            f"duplicate key {key!r} (first at line {self.first_line}); "
            "a key may appear only once in a mapping"
        )
        super().__init__(None, None, problem, again.start_mark)


class StrictLoader(BASE_LOADER):
    """The safe loader (:data:`BASE_LOADER`) raising :class:`DuplicateKeyError` on a
    repeated key."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            seen: dict[Any, Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, Hashable):
                    continue  # the safe loader's own error names an unhashable key
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # hashable type, unhashable content (a tuple of lists)
                    continue
                if first is not key_node:
                    raise DuplicateKeyError(key, first, key_node)
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


def load(text: str, name: str | None = None) -> Any:
    """Parse one YAML document like ``yaml.safe_load``, refusing repeated keys. ``name``
    (a file name) is what error marks say the text came from, instead of PyYAML's
    ``"<unicode string>"``."""
    try:
        return _from_events(text)
    except Exception:  # any: the node-based path gives the answer
        pass
    loader = StrictLoader(text)
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        if name is not None:
            exc.context_mark = _named(exc.context_mark, name)
            exc.problem_mark = _named(exc.problem_mark, name)
        raise
    finally:
        loader.dispose()


def _named(mark: Any, name: str) -> yaml.Mark | None:
    """``mark`` saying it is in ``name`` (libyaml's marks cannot be changed in place)."""
    if mark is None:
        return None
    return yaml.Mark(name, mark.index, mark.line, mark.column, mark.buffer, mark.pointer)


class _Deferred(Exception):
    """The document is not one :func:`_from_events` builds: the node-based path loads it."""


class _Mapping:
    """A mapping being built: its dict and the key read before the value (if any)."""

    __slots__ = ("data", "key", "keyed")

    def __init__(self) -> None:
        self.data: dict[Any, Any] = {}
        self.key: Any = None
        self.keyed = False


def _from_events(text: str) -> Any:
    """The document in ``text`` built from the parser's events, or :class:`_Deferred`
    (or any error): see the module docstring."""
    loader = BASE_LOADER(text)
    try:
        if loader.yaml_path_resolvers:  # tags would depend on the path: not tracked here
            raise _Deferred
        get_event = cast(Callable[[], Any], loader.get_event)
        resolve = cast(Callable[[type[Node], str, tuple[bool, bool]], str], loader.resolve)
        constructors = cast(dict[str, Callable[[Any, Node], Any]], loader.yaml_constructors)
        scalar_node = cast(Callable[..., Node], ScalarNode)
        if type(get_event()) is not StreamStartEvent:
            raise _Deferred
        event = get_event()
        if type(event) is StreamEndEvent:
            return None  # no document: what safe_load gives
        if type(event) is not DocumentStartEvent:
            raise _Deferred
        open_: list[_Mapping | list[Any]] = []  # the collections being built, innermost last
        while True:
            event = get_event()
            kind = type(event)
            if kind is ScalarEvent:
                if event.anchor is not None:
                    raise _Deferred
                tag = event.tag
                if tag is None or tag == "!":
                    tag = resolve(ScalarNode, event.value, event.implicit)
                if tag == _STR_TAG:
                    value: Any = event.value
                elif tag in _SCALAR_TAGS:
                    node = scalar_node(tag, event.value, event.start_mark, event.end_mark,
                                       event.style)  # fmt: skip
                    value = constructors[tag](loader, node)
                else:
                    raise _Deferred  # a merge key, "=", a tag of the application's
            elif kind is MappingStartEvent or kind is SequenceStartEvent:
                if event.anchor is not None or event.tag not in (None, "!"):
                    raise _Deferred
                parent = open_[-1] if open_ else None
                if isinstance(parent, _Mapping) and not parent.keyed:
                    raise _Deferred  # a collection as a key
                if len(open_) >= MAX_FAST_DEPTH:
                    raise _Deferred
                open_.append(_Mapping() if kind is MappingStartEvent else [])
                continue
            elif kind is MappingEndEvent or kind is SequenceEndEvent:
                done = open_.pop()
                value = done.data if isinstance(done, _Mapping) else done
            else:
                raise _Deferred  # an alias
            if not open_:
                if type(get_event()) is not DocumentEndEvent:
                    raise _Deferred
                if type(get_event()) is not StreamEndEvent:
                    raise _Deferred  # a second document: the node path's error
                return value
            top = open_[-1]
            if isinstance(top, _Mapping):
                if top.keyed:
                    top.data[top.key] = value
                    top.keyed = False
                elif value in top.data:
                    raise _Deferred  # a repeated key: DuplicateKeyError from the node path
                else:
                    top.key, top.keyed = value, True
            else:
                top.append(value)
    finally:
        loader.dispose()


def compose(text: str, name: str | None = None) -> Node | None:
    """``yaml.compose`` with the safe loader, error marks naming ``name`` (see :func:`load`)."""
    loader = yaml.SafeLoader(text)
    if name is not None:
        loader.name = name
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()


def key_path(text: str, index: int) -> tuple[str | int, ...] | None:
    """Where in the document the mapping key starting at character ``index`` sits, as
    keys and list indices (``("pools", 0, "replicas", 0, "max_sessions")``); None when
    no key starts there or the text does not compose."""
    try:
        root = yaml.compose(text, Loader=BASE_LOADER)  # the marks load's errors carry
    except yaml.YAMLError:
        return None
    return _find(root, index, (), set()) if root is not None else None


def _find(
    node: Node, index: int, path: tuple[str | int, ...], seen: set[int]
) -> tuple[str | int, ...] | None:
    if id(node) in seen:  # an alias back into its own anchor
        return None
    seen.add(id(node))
    if isinstance(node, MappingNode):
        for key_node, value in node.value:
            here = (*path, str(key_node.value))
            if key_node.start_mark.index == index:
                return here
            if (found := _find(value, index, here, seen)) is not None:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            if (found := _find(item, index, (*path, i), seen)) is not None:
                return found
    return None
