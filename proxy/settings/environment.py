"""How :mod:`proxy.settings` reads the environment, and how it explains what is wrong.

Two halves of the same boundary: ``HEADROOM_*`` variables are applied over the file's
data (below), and pydantic's validation errors are turned into ``(field path, reason)``
problems (:func:`explain`) that name the variable when one set the offending value.

Environment rules operators rely on:

* A variable is ``HEADROOM_`` followed by a path of setting names joined by ``__``; names
  are case-insensitive. ``HEADROOM_LISTEN__PORT=9000`` sets ``listen.port``.
* A numeric segment indexes a list element, which must already exist (in the file, in the
  field's default, or set by a shorter variable): ``HEADROOM_POOLS__0__QUEUE__MAX_DEPTH=4``,
  ``HEADROOM_POOLS__0__REPLICAS__1__MAX_SESSIONS=8``. Elements cannot be appended by
  index; set the whole list instead. A missing element is an error naming the variable.
* A value is read as YAML (JSON is a subset), so a collection replaces the whole value
  (``HEADROOM_ROUTES='[{"path": "/v1/realtime", ...}]'``) and scalars are YAML scalars
  (``8`` -> 8, ``true`` -> True, ``null``, ``~`` or empty -> None). Where the setting is a
  string, the text is taken verbatim (surrounding whitespace stripped), so a replica named
  ``0`` or a voice named ``on`` stays a string.
* A key repeated inside a value (``{"port": 1, "port": 2}``) is an error, as in the file.
* Shorter paths apply first: replace a whole list, then adjust one element of it.
* The environment wins over the file (and over the secret files and the ``.env`` file,
  which :mod:`proxy.settings.sources` applies with these same rules).
* ``HEADROOM_CONFIG`` names the file, ``HEADROOM_SECRETS_DIR`` and ``HEADROOM_ENV_FILE``
  the other sources; they are not settings. Another variable whose first segment is not
  a setting is an error when it looks like one (it is nested, or it is a close
  misspelling, reported with "did you mean"); otherwise it is ignored, because other
  tools share the prefix (the test suite's ``HEADROOM_SLOW``).

The overlay (:func:`apply_env`) is applied to the file's raw data before validation, by
:func:`proxy.settings.settings_from_mapping`, which passes the mapping to read
(``os.environ`` unless told otherwise, so tests can pass a plain dict). It returns the
merged data and which variable set each path, so validation errors name the variable.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticUndefined

from proxy.errors import ConfigError
from proxy.settings import strict_yaml

__all__ = [
    "CONFIG_VAR",
    "ENV_FILE_VAR",
    "LOCATORS",
    "SECRETS_DIR_VAR",
    "Loc",
    "Problems",
    "annotation_at",
    "apply_env",
    "did_you_mean",
    "explain",
    "format_loc",
]

#: The variable naming the configuration file (``headroom serve`` without ``--config``).
CONFIG_VAR = "HEADROOM_CONFIG"
#: The variables naming the secrets directory and the ``.env`` file
#: (:mod:`proxy.settings.sources`).
SECRETS_DIR_VAR = "HEADROOM_SECRETS_DIR"
ENV_FILE_VAR = "HEADROOM_ENV_FILE"
#: Variables that say where the settings are; they are not settings themselves.
LOCATORS = frozenset({CONFIG_VAR, SECRETS_DIR_VAR, ENV_FILE_VAR})

#: A location inside the settings: field names and list indices.
Loc = tuple[str | int, ...]

_NULLS = frozenset({"", "~", "null", "Null", "NULL"})


def format_loc(loc: Iterable[str | int]) -> str:
    """``("pools", 0, "replicas", 1, "url")`` -> ``"pools[0].replicas[1].url"``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "<top level>"


def did_you_mean(word: str, candidates: Iterable[str], cutoff: float = 0.6) -> str:
    """``"; did you mean 'port'?"`` for the closest candidate, or ``""`` when none is close."""
    names = list(candidates)
    lowered = {name.lower(): name for name in names}
    close = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=cutoff)
    return f"; did you mean {lowered[close[0]]!r}?" if close else ""


def _unwrap(tp: Any) -> Any:
    """Strip ``Annotated[...]`` and ``X | None`` down to the type that carries structure."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin is Union or origin is types.UnionType:
            args = [arg for arg in get_args(tp) if arg is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def annotation_at(root: type[BaseModel], loc: Sequence[str | int]) -> Any:
    """The (unwrapped) type declared at ``loc`` below ``root``, or None if there is none."""
    tp: Any = root
    for seg in loc:
        tp = _unwrap(tp)
        if isinstance(seg, str) and _is_model(tp):
            info: FieldInfo | None = tp.model_fields.get(seg)
            if info is None:
                return None
            tp = info.annotation
        elif isinstance(seg, int) and get_origin(tp) in (tuple, list):
            tp = get_args(tp)[0]
        else:
            return None
    return _unwrap(tp)


def _default_at(root: type[BaseModel], loc: Loc) -> Any:
    """The plain-data default of the field at ``loc`` (None if required or unknown)."""
    parent = annotation_at(root, loc[:-1])
    seg = loc[-1]
    if not (isinstance(seg, str) and _is_model(parent) and seg in parent.model_fields):
        return None
    value = parent.model_fields[seg].get_default(call_default_factory=True)
    if value is PydanticUndefined:
        return None
    if isinstance(value, BaseModel):
        return value.model_dump()
    return list(value) if isinstance(value, tuple) else value


def _is_text(tp: Any) -> bool:
    if tp is str:
        return True
    return get_origin(tp) is Literal and all(isinstance(arg, str) for arg in get_args(tp))


def _parse_value(raw: str, target: Any) -> Any:
    text = raw.strip()
    if text in _NULLS:
        return None
    if _is_text(target):
        return text
    try:
        return strict_yaml.load(text)
    except strict_yaml.DuplicateKeyError:
        raise
    except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError):
        return text  # validation then says what the setting expects, naming the variable


class _PathError(Exception):
    """An override cannot be applied; the message says why."""


def _var(naming: tuple[str, str], loc: Loc) -> str:
    prefix, delimiter = naming
    return prefix + delimiter.join(str(seg).upper() for seg in loc)


def _assign(
    node: Any, path: Loc, value: Any, done: Loc, root: type[BaseModel], naming: tuple[str, str]
) -> Any:
    """A copy of ``node`` with ``value`` at ``path``; only containers on the path are copied."""
    if not path:
        return value
    seg, rest = path[0], path[1:]
    here = (*done, seg)
    whole = f"{_var(naming, done)}='[...]'"
    if isinstance(seg, int):
        if not isinstance(node, list | tuple):
            raise _PathError(f"{format_loc(done)} is not a list, so it has no element {seg}")
        if seg >= len(node):
            have = f"indices 0..{len(node) - 1}" if node else "it is empty"
            raise _PathError(
                f"{format_loc(here)} does not exist ({format_loc(done)} has {len(node)} "
                f"element(s), {have}); to add elements set the whole list with {whole}"
            )
        items = list(node)
        items[seg] = _assign(items[seg], rest, value, here, root, naming)
        return items
    if isinstance(node, list | tuple):
        example = _var(naming, (*done, 0, *path))
        raise _PathError(f"{format_loc(done)} is a list: index it with a number, e.g. {example}")
    if not isinstance(node, Mapping):
        raise _PathError(f"{format_loc(done)} is a {type(node).__name__}, not a mapping")
    copy = dict(node)
    key = next((k for k in copy if isinstance(k, str) and k.lower() == seg), seg)
    child = copy.get(key)
    if child is None and rest:
        child = _default_at(root, here)
        if child is None:
            if isinstance(rest[0], int):
                raise _PathError(
                    f"{format_loc(here)} is not set, so it has no element {rest[0]}; "
                    f"set the whole list with {_var(naming, here)}='[...]'"
                )
            child = {}
    copy[key] = _assign(child, rest, value, here, root, naming)
    return copy


def apply_env(
    env: Mapping[str, str],
    base: Mapping[str, Any],
    root: type[BaseModel],
    *,
    prefix: str = "HEADROOM_",
    delimiter: str = "__",
) -> tuple[dict[str, Any], dict[Loc, str]]:
    """Apply the ``prefix`` variables of ``env`` over ``base`` (the file's data).

    Returns the merged data (``base`` with every variable applied; a collection from the
    environment replaces the file's value whole) and which variable set each path.
    ``base`` is not modified. Raises :class:`ConfigError` listing every variable that
    cannot be applied (the variable name is the problem's path).
    """
    problems: list[tuple[str, str]] = []
    overrides: list[tuple[Loc, str, str]] = []
    fields = list(root.model_fields)
    for name, raw in env.items():
        if not name.upper().startswith(prefix.upper()) or name.upper() in LOCATORS:
            continue
        segs = name[len(prefix) :].lower().split(delimiter)
        if segs[0] not in fields:
            close = did_you_mean(segs[0], fields, cutoff=0.8)
            if len(segs) > 1 or close:
                hint = close or did_you_mean(segs[0], fields) or f"; settings: {', '.join(fields)}"
                problems.append((name, f"{segs[0]!r} is not a setting{hint}"))
            continue
        if "" in segs:
            problems.append((name, f"empty name between {delimiter!r} separators"))
            continue
        path: Loc = tuple(
            int(s) if s.isascii() and s.isdigit() and len(s) <= 9 else s for s in segs
        )
        overrides.append((path, name, raw))

    state: dict[str, Any] = dict(base)
    origins: dict[Loc, str] = {}
    for path, name, raw in sorted(overrides, key=lambda item: (len(item[0]), item[1])):
        try:
            value = _parse_value(raw, annotation_at(root, path))
        except strict_yaml.DuplicateKeyError as exc:
            problems.append((name, f"invalid value: {exc.problem}"))
            continue
        try:
            state = _assign(state, path, value, (), root, (prefix, delimiter))
        except _PathError as exc:
            problems.append((name, str(exc)))
            continue
        origins[path] = name
    if problems:
        raise ConfigError(problems)
    return state, origins


# -- explaining validation errors --------------------------------------------------------


class Problems(ValueError):
    """Raised by a validator: problems at paths relative to the model being validated, plus
    the field errors pydantic had already found (``prior``), so all surface together."""

    def __init__(self, problems: list[tuple[Loc, str]], prior: list[ErrorDetails] | None = None):
        self.problems = problems
        self.prior = prior or []
        super().__init__("; ".join(f"{format_loc(loc)}: {why}" for loc, why in problems))


_BOUNDS = {
    "greater_than_equal": ">=",
    "greater_than": ">",
    "less_than_equal": "<=",
    "less_than": "<",
}
_TYPES = {
    "model_type": "a mapping of settings",
    "model_attributes_type": "a mapping of settings",
    "dict_type": "a mapping of settings",
    "tuple_type": "a list",
    "list_type": "a list",
    "string_type": "a string",
}


def _got(value: Any) -> str:
    text = repr(value)
    return f"(got {text if len(text) <= 60 else text[:57] + '...'})"


def _reason(error: ErrorDetails, root: type[BaseModel]) -> str:
    """A short reason for one pydantic error, in the words of the settings file."""
    kind, loc, ctx, value = error["type"], error["loc"], error.get("ctx", {}), error.get("input")
    if kind in _BOUNDS:
        return f"must be {_BOUNDS[kind]} {next(iter(ctx.values()), '?')} {_got(value)}"
    if kind in _TYPES:
        return f"must be {_TYPES[kind]} (got {type(value).__name__})"
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        parent = annotation_at(root, loc[:-1])
        names = list(parent.model_fields) if _is_model(parent) else []
        hint = did_you_mean(str(loc[-1]), names) or f"; valid keys: {', '.join(names)}"
        return f"unknown key {loc[-1]!r}{hint}"
    if kind == "literal_error":
        declared = annotation_at(root, loc)
        choices = [str(c) for c in get_args(declared)] if get_origin(declared) is Literal else []
        hint = did_you_mean(value, choices) if isinstance(value, str) else ""
        return f"must be one of: {', '.join(choices) or ctx.get('expected')} {_got(value)}{hint}"
    if kind == "too_short":
        return f"needs at least {ctx.get('min_length')} entry (got {ctx.get('actual_length')})"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    return f"{error['msg'].replace('Input should be', 'must be')} {_got(value)}"


def _flatten(
    errors: Iterable[ErrorDetails], root: type[BaseModel], prefix: Loc = ()
) -> list[tuple[Loc, str]]:
    out: list[tuple[Loc, str]] = []
    for error in errors:
        loc = (*prefix, *error["loc"])
        ctx = error.get("ctx", {})
        if error["type"] == "too_short" and len(error.get("input") or ()) >= ctx["min_length"]:
            continue  # pydantic counts only the elements that validated; the others are reported
        cause = ctx.get("error")
        if isinstance(cause, Problems):
            out += _flatten(cause.prior, root, loc)
            out += [((*loc, *sub), why) for sub, why in cause.problems]
        else:
            out.append((loc, _reason(error, root)))
    return out


def explain(
    errors: Iterable[ErrorDetails], root: type[BaseModel], origins: Mapping[Loc, str]
) -> list[tuple[str, str]]:
    """pydantic errors of ``root`` -> ``(field path, reason)``, grouped by place (fields in
    declaration order, elements by index), naming the variable that set a value."""
    order = {name: i for i, name in enumerate(root.model_fields)}

    def place(item: tuple[Loc, str]) -> list[tuple[int, int, str]]:
        return [
            (0, seg, "") if isinstance(seg, int) else (1, 0 if depth else order.get(seg, 0), seg)
            for depth, seg in enumerate(item[0])
        ]

    def setter(loc: Loc) -> str:
        names = [var for path, var in origins.items() if loc[: len(path)] == path]
        return f" (set by {names[-1]})" if names else ""

    ordered = sorted(_flatten(errors, root), key=place)
    return list(dict.fromkeys((format_loc(loc), why + setter(loc)) for loc, why in ordered))
