"""The sources of settings below the environment: a directory of secret files and a
``.env`` file, read with pydantic-settings and applied by the same overlay as the
``HEADROOM_*`` environment (:mod:`proxy.settings.environment`).

Each entry is a setting named like its variable: a file ``headroom_admission__redis__url``
in the secrets directory (a mounted Kubernetes or Docker secret) or a line
``HEADROOM_ADMISSION__REDIS__URL=...`` in the ``.env`` file sets ``admission.redis.url``.
Names are case-insensitive, ``__`` nests, a numeric segment indexes a list, and a value
is read as YAML except where the setting is a string -- the variable rules, unchanged.
Entries without the ``HEADROOM_`` prefix are ignored (``/run/secrets`` holds other
programs' secrets too).

Precedence, highest first: the environment, a secret file, the ``.env`` file, the YAML
file, the defaults. Each source is applied over the result of the ones below it, as the
environment is applied over the file: a whole section set by a higher source replaces
what a lower one set inside it.

Where they are:

* ``HEADROOM_SECRETS_DIR`` names the secrets directory; unset, ``/run/secrets`` is used
  when it is a directory; empty, no directory is read. A named directory that does not
  exist is an error.
* ``HEADROOM_ENV_FILE`` (or ``headroom serve|check --env-file FILE``) names the ``.env``
  file; there is none by default. A named file that does not exist is an error.

These two and ``HEADROOM_CONFIG`` are read from the process environment only.

A problem with an entry names the file (and the line's name, for the ``.env`` file) and
never shows the value: secret files and ``.env`` files hold passwords.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    NestedSecretsSettingsSource,
    SecretsSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from proxy.errors import ConfigError
from proxy.settings.environment import ENV_FILE_VAR, LOCATORS, SECRETS_DIR_VAR

__all__ = [
    "DEFAULT_SECRETS_DIR",
    "ENV_FILE_VAR",
    "LOCATORS",
    "MAX_SOURCE_BYTES",
    "SECRETS_DIR_VAR",
    "Layer",
    "layers_for",
    "read_env_file",
    "read_secrets_dir",
]

DEFAULT_SECRETS_DIR = Path("/run/secrets")
#: The most a secrets directory (all its files) or a ``.env`` file may hold.
MAX_SOURCE_BYTES = 1 << 20


class _Entries(BaseSettings):
    """No fields: the sources are read for their entries, which the overlay applies."""

    model_config = SettingsConfigDict(case_sensitive=True)


@dataclass(frozen=True)
class Layer:
    """One source's entries (name as written -> text), how a problem names an entry, and
    whether its values may be shown in messages."""

    entries: Mapping[str, str]
    describe: Callable[[str], str]
    hidden: bool


def _lookup(env: Mapping[str, str], name: str) -> str | None:
    return next((v for k, v in env.items() if k.upper() == name), None)


def _locators_misplaced(entries: Mapping[str, str], describe: Callable[[str], str]) -> None:
    misplaced = [name for name in entries if name.upper() in LOCATORS]
    if misplaced:
        raise ConfigError([
            (describe(name), "is read from the process environment only, not from this file")
            for name in misplaced
        ])  # fmt: skip


def read_secrets_dir(path: Path) -> dict[str, str]:
    """Every secret file under ``path`` by name (relative to ``path``), text stripped."""
    where = f"secrets directory {path} ({SECRETS_DIR_VAR})"
    if not path.is_dir():
        why = "is not a directory" if path.exists() else "does not exist"
        raise ConfigError([(where, why)])
    try:
        source = NestedSecretsSettingsSource(
            SecretsSettingsSource(_Entries, secrets_dir=path),
            secrets_dir=path,
            secrets_dir_missing="error",
            secrets_dir_max_size=MAX_SOURCE_BYTES,
            secrets_case_sensitive=True,
        )
    except SettingsError as exc:
        raise ConfigError([(where, str(exc))]) from None
    except UnicodeDecodeError:
        raise ConfigError([(where, "holds a file that is not UTF-8 text")]) from None
    except OSError as exc:
        raise ConfigError([(where, f"cannot be read: {exc.strerror or exc}")]) from None
    return {name: value or "" for name, value in source.env_vars.items()}


def read_env_file(path: Path) -> dict[str, str]:
    """The ``.env`` file's entries by name as written (a bare ``NAME`` line is empty)."""
    where = f"env file {path} ({ENV_FILE_VAR})"
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ConfigError([(where, "does not exist")]) from None
    except OSError as exc:
        raise ConfigError([(where, f"cannot be read: {exc.strerror or exc}")]) from None
    if not path.is_file():
        raise ConfigError([(where, "is not a file")])
    if size > MAX_SOURCE_BYTES:
        raise ConfigError([(where, f"is larger than {MAX_SOURCE_BYTES} bytes")])
    try:
        source = DotEnvSettingsSource(_Entries, env_file=path, case_sensitive=True)
    except UnicodeDecodeError:
        raise ConfigError([(where, "is not UTF-8 text")]) from None
    except OSError as exc:
        raise ConfigError([(where, f"cannot be read: {exc.strerror or exc}")]) from None
    return {name: value or "" for name, value in source.env_vars.items()}


def layers_for(env: Mapping[str, str]) -> list[Layer]:
    """The sources ``env`` points at, lowest precedence first: the ``.env`` file, then the
    secrets directory. Raises :class:`ConfigError` naming the file that cannot be used."""
    layers: list[Layer] = []
    env_file = _lookup(env, ENV_FILE_VAR)
    if env_file:
        path = Path(env_file)
        entries = read_env_file(path)
        describe: Callable[[str], str] = lambda name: f"{name} in env file {path}"  # noqa: E731
        _locators_misplaced(entries, describe)
        layers.append(Layer(entries, describe, hidden=True))
    named = _lookup(env, SECRETS_DIR_VAR)
    directory = Path(named) if named else None
    if named is None and DEFAULT_SECRETS_DIR.is_dir():
        directory = DEFAULT_SECRETS_DIR
    if directory is not None:
        entries = read_secrets_dir(directory)
        root = directory
        describe = lambda name: f"secret file {os.path.join(root, name)}"  # noqa: E731
        _locators_misplaced(entries, describe)
        layers.append(Layer(entries, describe, hidden=True))
    return layers
