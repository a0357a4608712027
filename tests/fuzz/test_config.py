"""The configuration loader under hostile files and environments: only ConfigError escapes.

``tests/unit/test_settings.py`` already throws junk mappings, corrupted values, junk
environment variables and junk YAML text at the loader. This module adds what those do
not reach: byte-level damage to a complete, valid configuration file (so the damage lands
inside otherwise valid structure), YAML constructs that expand (aliases) or nest deeply,
and environment variables whose *names* are hostile (list indices with thousands of
digits, odd separators) over a valid file.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from proxy.errors import ConfigError
from proxy.settings import Settings, load_settings, settings_from_mapping
from tests.fuzz.conftest import fuzz_settings

VALID = {
    "listen": {"host": "127.0.0.1", "port": 8080},
    "admin": {"enabled": False},
    "limits": {"max_message_bytes": 65536, "idle_timeout_s": 30},
    "guard": {"mode": "observe"},
    "pools": [
        {
            "name": "tts",
            "replicas": [
                {"name": "gpu0", "url": "http://10.0.0.5:8000", "max_sessions": 12},
                {"name": "gpu1", "url": "https://10.0.0.6:8000", "max_sessions": 12},
            ],
            "queue": {"max_depth": 32, "max_wait_s": 10},
            "fallback": {"voice": "lite", "pool": "lite"},
        },
        {"name": "lite", "replicas": [{"name": "l0", "url": "http://h:1", "max_sessions": 2}]},
    ],
    "routes": [
        {"path": "/v1/audio/speech/stream", "pool": "tts", "protocol": "vllm-omni-speech-ws"},
        {"path": "/v1/audio/speech", "pool": "tts", "protocol": "openai-speech-http"},
        {"path": "/v1/realtime", "pool": "lite", "protocol": "vllm-realtime",
         "refusal": "close", "queue_feedback": True},
    ],
    "auth": {"keys": [{"name": "a", "sha256": "0" * 64, "max_sessions": 3}]},
}  # fmt: skip
VALID_TEXT = yaml.safe_dump(VALID, sort_keys=False).encode()


def readable(exc: ConfigError) -> bool:
    """At least one problem, each a (field path, reason) pair of non-empty text."""
    return bool(exc.problems) and all(
        isinstance(p, str) and isinstance(r, str) and r for p, r in exc.problems
    )


def load_bytes(data: bytes, env: dict[str, str] | None = None) -> Settings | None:
    """Load ``data`` as a configuration file; None if it was refused with a readable
    ConfigError. Anything else escaping is a failure."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "headroom.yaml"
        path.write_bytes(data)
        error: ConfigError | None = None
        try:
            return load_settings(path, env=env or {})
        except ConfigError as exc:
            error = exc
    assert readable(error)
    return None


def test_the_valid_file_loads() -> None:
    settings = load_bytes(VALID_TEXT)
    assert settings is not None and settings.total_slots == 26


@fuzz_settings(300)
@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(VALID_TEXT)), st.integers(0, 8), st.binary(max_size=8)),
        min_size=1,
        max_size=4,
    )
)
def test_damaged_files_raise_only_config_error(edits: list[tuple[int, int, bytes]]) -> None:
    data = bytearray(VALID_TEXT)
    for at, drop, insert in edits:
        at = min(at, len(data))
        data[at : at + drop] = insert
    load_bytes(bytes(data))


@fuzz_settings(40)
@given(
    depth=st.integers(1, 1500),
    where=st.sampled_from(["pools", "routes", "limits", "top", "max_sessions"]),
    opener=st.sampled_from(["[", "{a: "]),
)
def test_deep_nesting_raises_only_config_error(depth: int, where: str, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    nested = opener * depth + "1" + closer * depth
    base = yaml.safe_dump(VALID, sort_keys=False)
    if where == "top":
        text = nested
    elif where == "max_sessions":
        text = base.replace("max_sessions: 12", f"max_sessions: {nested}", 1)
    else:
        text = base + f"\n{where}: {nested}\n" if where not in VALID else base.replace(
            f"{where}:", f"{where}: {nested}\nx_{where}:", 1)  # fmt: skip
    load_bytes(text.encode())


@fuzz_settings(100)
@given(width=st.integers(1, 12), levels=st.integers(1, 9), target=st.sampled_from(
    ["pools", "routes", "replicas", "keys"]))  # fmt: skip
def test_alias_expansion_raises_only_config_error(width: int, levels: int, target: str) -> None:
    """A "billion laughs" document: each level repeats the previous one ``width`` times."""
    lines = ["a0: &a0 [x]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    top = f"*a{levels}"
    if target == "pools":
        lines += [f"pools: {top}", "routes: []"]
    elif target == "routes":
        lines += ["pools: []", f"routes: {top}"]
    elif target == "replicas":
        lines += [f"pools: [{{name: p, replicas: {top}}}]", "routes: []"]
    else:
        lines += ["pools: []", "routes: []", f"auth: {{keys: {top}}}"]
    load_bytes("\n".join(lines).encode())


env_segments = st.one_of(
    st.sampled_from(["POOLS", "ROUTES", "LIMITS", "LISTEN", "PORT", "REPLICAS", "MAX_SESSIONS",
                     "NAME", "URL", "0", "1", "00", "-1", "", "_", "__", "٣"]),
    st.text(alphabet="0123456789", min_size=1, max_size=30),
    st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789", max_size=10),
)  # fmt: skip
env_values = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["[]", "{}", "null", "~", "[1, {a: 2}]", "&a [*a]", "!!binary AAAA",
                     "9" * 5000, "1e400", "-1", "0x10", ".inf", "'", "{port: x}"]),
)  # fmt: skip


@fuzz_settings(400)
@given(env=st.dictionaries(
    st.lists(env_segments, min_size=1, max_size=6).map(lambda s: "HEADROOM_" + "__".join(s)),
    env_values, max_size=5))  # fmt: skip
def test_hostile_environment_raises_only_config_error(env: dict[str, str]) -> None:
    error: ConfigError | None = None
    try:
        settings_from_mapping(VALID, env=env)
    except ConfigError as exc:
        error = exc
    assert error is None or readable(error)


def test_an_environment_index_with_thousands_of_digits_is_a_config_error() -> None:
    """Python refuses int() of more than 4300 digits with ValueError; the loader must
    still answer with a ConfigError naming the variable, not crash the start-up."""
    name = "HEADROOM_POOLS__" + "0" * 5000 + "__NAME"
    with pytest.raises(ConfigError) as caught:
        settings_from_mapping(VALID, env={name: "x"})
    assert readable(caught.value)
    assert any(path.startswith("HEADROOM_POOLS__000") for path, _ in caught.value.problems)
