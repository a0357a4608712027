"""YAML for configuration files: PyYAML's safe loader, except that a mapping may not
repeat a key.

A plain ``yaml.safe_load`` keeps the last of two equal keys, so ``max_sessions: 4`` followed
by ``max_sessions: 40`` silently gives 40 -- for a hard per-GPU cap that is an outage
waiting to happen. :class:`StrictLoader` refuses it with :class:`DuplicateKeyError`, a
``yaml.MarkedYAMLError`` whose ``problem_mark`` is the repeated key, so every caller that
already reports YAML errors with a line and column reports this one the same way.

Merge keys (``<<: *defaults``) are not duplicates: a key written next to a merge
overrides the merged value, as YAML intends.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node

__all__ = ["DuplicateKeyError", "StrictLoader", "compose", "key_path", "load"]

_MERGE_TAG = "tag:yaml.org,2002:merge"


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


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that raises :class:`DuplicateKeyError` on a repeated key."""

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
        return super().construct_mapping(node, deep=deep)


def load(text: str, name: str | None = None) -> Any:
    """Parse one YAML document like ``yaml.safe_load``, refusing repeated keys. ``name``
    (a file name) is what error marks say the text came from, instead of PyYAML's
    ``"<unicode string>"``."""
    loader = StrictLoader(text)  # a SafeLoader
    if name is not None:
        loader.name = name
    try:
        return loader.get_single_data()
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
        root = yaml.compose(text, Loader=yaml.SafeLoader)
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
