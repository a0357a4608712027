"""Reading the configuration: one YAML file, the ``HEADROOM_*`` environment over it
(rules in :mod:`proxy.settings.environment`), validation into
:class:`~proxy.settings.schema.Settings`,
and whether a new configuration may replace the running one live.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from pydantic import ValidationError

from proxy.errors import ConfigError
from proxy.settings import strict_yaml
from proxy.settings.environment import (
    CONFIG_VAR,
    Loc,
    apply_env,
    did_you_mean,
    explain,
    format_loc,
)
from proxy.settings.fields import is_loopback
from proxy.settings.schema import Settings
from proxy.settings.sources import Layer, layers_for

_FILE = "<file>"
_TOP = "<top level>"
_MAX_PROBLEMS = 50  # an aliased YAML list can multiply one mistake thousands of times
#: A bound on the file read: a configuration is a few kilobytes.
MAX_CONFIG_BYTES = 4 * 1024 * 1024


def settings_from_mapping(
    data: Mapping[str, Any],
    *,
    env: Mapping[str, str] | None = None,
    source: str | None = None,
    layers: Sequence[Layer] = (),
) -> Settings:
    """Validate ``data`` (the shape of the YAML file) with ``layers`` (the ``.env`` file
    and the secret files, lowest first: :mod:`proxy.settings.sources`) and then ``env``
    applied over it.

    ``env`` defaults to ``os.environ``; pass ``{}`` to ignore the environment. ``source``
    names where ``data`` came from in error messages. Raises :class:`ConfigError` only.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(
            [(_TOP, f"must be a mapping of settings (got {type(data).__name__})")], source
        )
    fields = list(Settings.model_fields)
    # Unknown top-level keys are reported here, where their path is the top level.
    problems = [
        (_TOP, f"unknown key {key!r}{did_you_mean(str(key), fields)}")
        for key in data
        if not isinstance(key, str) or key not in fields
    ]
    known = {key: value for key, value in data.items() if isinstance(key, str) and key in fields}
    environ = os.environ if env is None else env
    merged: dict[str, Any] = known
    origins: dict[Loc, str] = {}
    unshown: dict[str, str] = {}  # a hidden source's description of an entry -> its text
    applied = True
    for layer in (*layers, Layer(environ, str, hidden=False)):
        try:
            merged, set_here = apply_env(layer.entries, merged, Settings)
        except ConfigError as exc:  # an entry that cannot be applied
            problems += [(layer.describe(name), why) for name, why in exc.problems]
            applied = False
            continue
        # what this source set replaces whatever a lower one set at or below that path
        origins = {
            loc: name
            for loc, name in origins.items()
            if not any(loc[: len(path)] == path for path in set_here)
        }
        for path, name in set_here.items():
            origins[path] = layer.describe(name)
            if layer.hidden:
                unshown[layer.describe(name)] = layer.entries[name].strip()
    if applied:
        try:
            settings = Settings.model_validate(merged)
        except ValidationError as exc:
            problems += _hide_values(explain(exc.errors(), Settings, origins), unshown)
    if len(problems) > _MAX_PROBLEMS:
        hidden = len(problems) - _MAX_PROBLEMS
        problems = [*problems[:_MAX_PROBLEMS], ("...", f"{hidden} more problems not shown")]
    if problems:
        raise ConfigError(problems, source)
    return settings


_NOT_SHOWN = "<not shown>"
_SHORTEST_HIDDEN = 4


def _hide_values(
    problems: list[tuple[str, str]], hidden: Mapping[str, str]
) -> list[tuple[str, str]]:
    """The problems with the values that came from a secret file or the ``.env`` file
    taken out of the reasons (``hidden``: an entry's description -> its text). A problem
    at a place such an entry set shows no input; elsewhere (a check across sections
    quoting a name) the text is replaced wherever it appears quoted, or bare when it is
    long enough not to be mistaken for a word or number of the message."""
    out = []
    for path, reason in problems:
        cut = reason.rfind(" (set by ")
        body, setter = (reason[:cut], reason[cut:]) if cut >= 0 else (reason, "")
        if any(setter == f" (set by {described})" for described in hidden):
            body = re.sub(r" \(got .*\)$", f" (got {_NOT_SHOWN})", body)
        for text in hidden.values():
            body = body.replace(repr(text), _NOT_SHOWN)
            if len(text) >= _SHORTEST_HIDDEN:
                body = body.replace(text, _NOT_SHOWN)
        out.append((path, body + setter))
    return out


def load_settings(
    path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None
) -> Settings:
    """Load the YAML file at ``path`` (default: ``$HEADROOM_CONFIG``), then apply the
    ``.env`` file, the secret files and ``env`` over it (:mod:`proxy.settings.sources`).

    ``env`` defaults to ``os.environ``. Raises :class:`ConfigError` only.
    """
    environ = os.environ if env is None else env
    if path is None:
        path = next((v for k, v in environ.items() if k.upper() == CONFIG_VAR and v), None)
        if path is None:
            raise ConfigError(
                [(_FILE, f"no configuration file: pass --config FILE or set {CONFIG_VAR}")]
            )
    source = os.fspath(path)
    text = read_config_text(source)
    return settings_from_text(text, env=environ, source=source)


def read_config_text(source: str) -> str:
    """The text of the configuration file ``source``. Raises :class:`ConfigError` only
    (missing, unreadable, not UTF-8, or larger than any configuration)."""
    try:
        with open(source, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(
                [(_FILE, f"larger than {MAX_CONFIG_BYTES} bytes: not a configuration file")],
                source,
            )
        return raw.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(
            [(_FILE, f"no such file: {source} (check --config / {CONFIG_VAR})")], source
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([(_FILE, f"not UTF-8 text (byte {exc.start})")], source) from None
    except OSError as exc:
        raise ConfigError(
            [(_FILE, f"cannot read {source}: {exc.strerror or exc}")], source
        ) from None


def settings_from_text(
    text: str, *, env: Mapping[str, str] | None = None, source: str = _FILE
) -> Settings:
    """Validate the YAML ``text`` of a configuration file, ``env`` applied over it (as
    :func:`load_settings`, with the ``.env`` file and secret files ``env`` points at).
    Raises :class:`ConfigError` only."""
    environ = os.environ if env is None else env
    data = _parse_yaml(text, source)
    return settings_from_mapping(data, env=environ, source=source, layers=layers_for(environ))


def cut_short_problems(text: str) -> list[tuple[str, str]]:
    """Why ``text`` looks like a file cut short by a partial write (empty when it does
    not). A file ends with a newline (every editor and YAML writer ends it so); one that
    ends inside a line -- the usual result of a write stopped at a buffer boundary -- may
    still parse, with a key list or a key's restrictions silently shortened. A reload
    refuses it whole."""
    if text and not text.endswith("\n"):
        last = text.rsplit("\n", 1)[-1]
        line = text.count("\n") + 1
        return [(
            _FILE,
            f"does not end with a newline (line {line} stops at {last[-40:]!r}), as a file "
            "cut short by a partial write does; refused whole, the running configuration "
            "stays. Write the file to a temporary name and rename it, and end it with a "
            "newline",
        )]  # fmt: skip
    return []


def _parse_yaml(text: str, source: str) -> Any:
    try:
        data = strict_yaml.load(text)
    except strict_yaml.DuplicateKeyError as exc:
        # A repeated key is an error, never "the last one wins": for a hard cap like
        # max_sessions the silently kept value could be ten times the measured ceiling.
        mark = exc.problem_mark
        assert mark is not None
        found = strict_yaml.key_path(text, mark.index)
        where = f"line {mark.line + 1}, column {mark.column + 1}"
        loc = format_loc(found) if found else where
        reason = f"{exc.problem}" + (f" ({where})" if found else "")
        raise ConfigError([(loc, reason)], source) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else _FILE
        context = f" ({exc.context})" if exc.context and exc.problem else ""
        raise ConfigError(
            [(where, f"invalid YAML: {exc.problem or exc}{context}")], source
        ) from None
    except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise ConfigError([(_FILE, f"invalid YAML: {exc}")], source) from None
    if data is None:
        raise ConfigError([(_TOP, "the file is empty; it needs at least pools and routes")], source)
    return data


def reload_problems(
    old: Settings, new: Settings, *, admin_bound: str | None = None
) -> list[tuple[str, str]]:
    """Why the valid configuration ``new`` must not replace the running ``old`` live, as
    ``(field path, reason)``; empty when the reload is safe.

    * Client authentication may be turned off only explicitly (``auth: {enabled:
      false}``): a file without ``auth`` is what a truncated write looks like.
    * ``admin_bound`` is the host the running admin listener is bound to (None: no admin
      listener). Addresses change only on restart, and so does dropping the admin key: a
      reload may change the key (it applies at once) but not remove it while the listener
      runs, on loopback or not, and the key in force stays until the restart.
    """
    problems: list[tuple[str, str]] = []
    if old.auth is not None and new.auth is None and not new.auth_disabled:
        problems.append((
            "auth",
            "missing, which would turn client authentication off; refused, the running "
            "configuration stays. A file cut short by a partial write looks the same: write "
            "the file to a temporary name and rename it. To turn authentication off on "
            "purpose, write auth: {enabled: false}",
        ))  # fmt: skip
    if admin_bound is not None and not is_loopback(admin_bound) and not new.admin.api_key_sha256:
        problems.append((
            "admin.api_key_sha256",
            f"required: the admin listener stays bound to {admin_bound} until a restart, "
            "so a reload cannot remove its key (to drop the key, set admin.host: 127.0.0.1 "
            "and restart)",
        ))  # fmt: skip
    elif admin_bound is not None and old.admin.api_key_sha256 and not new.admin.api_key_sha256:
        problems.append((
            "admin.api_key_sha256",
            "removed: the admin listener would answer without a key; refused, the running "
            "configuration and its admin key stay. Dropping the admin key needs a restart",
        ))  # fmt: skip
    return problems
