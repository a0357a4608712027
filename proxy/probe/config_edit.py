"""``--write-config``: set one replica's ``max_sessions`` in a Headroom YAML file in place.

Only the value's characters change: comments, order, quoting and flow/block style stay
as they were (the value is located with :func:`yaml.compose`, whose nodes carry their
character offsets). The new file is parsed again before it replaces the old one, which
happens atomically (write to a temporary file, then rename).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from proxy.settings import strict_yaml

__all__ = ["ConfigEditError", "replica_url", "set_max_sessions", "write_max_sessions"]


class ConfigEditError(ValueError):
    """The file has no such pool/replica or cannot be edited; the message says which."""


def _get(node: Node, key: str) -> Node | None:
    if isinstance(node, MappingNode):
        for k, v in node.value:
            if isinstance(k, ScalarNode) and k.value == key:
                return v  # type: ignore[no-any-return]
    return None


def _named(seq: Node | None, name: str, what: str, where: str) -> MappingNode:
    if not isinstance(seq, SequenceNode):
        raise ConfigEditError(f"{where}: no '{what}' list")
    names = []
    for item in seq.value:
        found = _get(item, "name")
        if isinstance(found, ScalarNode):
            names.append(found.value)
            if found.value == name and isinstance(item, MappingNode):
                return item
    raise ConfigEditError(
        f"{where}: no {what[:-1]} named {name!r} (found: {', '.join(names) or 'none'})"
    )


def _replica_node(text: str, pool: str, replica: str, source: str | None) -> MappingNode:
    where = source or "configuration"
    try:
        root = strict_yaml.compose(text, name=source)
    except yaml.YAMLError as exc:
        raise ConfigEditError(f"{where}: invalid YAML: {exc}") from None
    if root is None:
        raise ConfigEditError(f"{where}: the file is empty")
    pool_node = _named(_get(root, "pools"), pool, "pools", where)
    return _named(_get(pool_node, "replicas"), replica, "replicas", f"pool {pool!r}")


def replica_url(text: str, pool: str, replica: str, source: str | None = None) -> str | None:
    """The ``url`` the file gives ``pools[pool].replicas[replica]`` (None: none given)."""
    url = _get(_replica_node(text, pool, replica, source), "url")
    return str(url.value) if isinstance(url, ScalarNode) else None


def set_max_sessions(
    text: str, pool: str, replica: str, value: int, source: str | None = None
) -> tuple[str, str]:
    """``(new text, old value)`` with ``pools[pool].replicas[replica].max_sessions`` set;
    ``source`` (the file name) is named in errors."""
    if value < 1:
        raise ConfigEditError(f"max_sessions must be >= 1, not {value}: nothing to write")
    rep = _replica_node(text, pool, replica, source)
    old = _get(rep, "max_sessions")
    if not isinstance(old, ScalarNode):
        raise ConfigEditError(
            f"pool {pool!r} replica {replica!r} has no max_sessions value to update; add one"
        )
    start, end = old.start_mark.index, old.end_mark.index
    new = text[:start] + str(value) + text[end:]
    try:
        check = strict_yaml.load(new, name=source)
    except strict_yaml.DuplicateKeyError as exc:
        raise ConfigEditError(f"invalid configuration: {exc}") from None
    for p in check["pools"]:
        if p.get("name") == pool:
            for r in p["replicas"]:
                if r.get("name") == replica and r.get("max_sessions") != value:
                    raise ConfigEditError("the edit did not take (unusual YAML?); edit by hand")
    return new, str(old.value)


def write_max_sessions(path: str | Path, pool: str, replica: str, value: int) -> str:
    """Update the file in place (atomically); returns the old value."""
    target = Path(path)
    try:
        text = target.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigEditError(f"cannot read {target}: {exc}") from None
    new, old = set_max_sessions(text, pool, replica, value, source=str(target))
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(new)
        os.chmod(tmp, target.stat().st_mode & 0o777)
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise ConfigEditError(f"cannot write {target}: {exc}") from None
    return old
