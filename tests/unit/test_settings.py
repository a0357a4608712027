"""The settings contract: what loads, what is refused and how the refusal reads."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import pydantic
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.errors import ConfigError
from proxy.settings import (
    HTTP_ROUTE_PROTOCOLS,
    WS_ROUTE_PROTOCOLS,
    Protocol,
    Settings,
    load_settings,
    settings_from_mapping,
    summary,
    ws_base,
)
from tests.hypothesis_profiles import examples

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"
KEY_HASH = "de67e4f90ff14fcfe89b77afac4c0029a3a28f9b4b684851d8a5c9a5290d81b8"


def valid() -> dict[str, Any]:
    """A fresh, valid configuration with two pools and three routes."""
    return {
        "pools": [
            {
                "name": "tts-main",
                "replicas": [
                    {"name": "gpu0", "url": "http://10.0.0.5:8000", "max_sessions": 12},
                    {"name": "gpu1", "url": "http://10.0.0.6:8000", "max_sessions": 12},
                ],
                "queue": {"max_depth": 32, "max_wait_s": 10},
                "fallback": {"voice": "lite-female-1"},
            },
            {
                "name": "asr-main",
                "replicas": [{"name": "gpu2", "url": "http://10.0.0.7:8000", "max_sessions": 16}],
            },
        ],
        "routes": [
            {
                "path": "/v1/audio/speech/stream",
                "pool": "tts-main",
                "protocol": "vllm-omni-speech-ws",
            },
            {"path": "/v1/audio/speech", "pool": "tts-main", "protocol": "openai-speech-http"},
            {"path": "/v1/realtime", "pool": "asr-main", "protocol": "vllm-realtime"},
        ],
    }


def load(data: Any, env: dict[str, str] | None = None) -> Settings:
    return settings_from_mapping(data, env=env or {})


def problems(data: Any, env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        load(data, env)
    return info.value.problems


def has(found: list[tuple[str, str]], path: str, reason: str) -> bool:
    return any(p == path and reason in r for p, r in found)


def at(*keys: Any) -> Callable[[Any], None]:
    """A mutation setting ``data[k0][k1]...[kn-1] = kn``."""

    def mutate(data: Any) -> None:
        target = data
        for key in keys[:-2]:
            target = target[key]
        target[keys[-2]] = keys[-1]

    return mutate


INVALID: list[tuple[str, Callable[[Any], None], str, str]] = [
    (
        "duplicate pool name",
        at("pools", 1, "name", "tts-main"),
        "pools[1].name",
        "duplicate pool name 'tts-main' (also pools[0].name)",
    ),
    (
        "duplicate replica name",
        at("pools", 0, "replicas", 1, "name", "gpu0"),
        "pools[0].replicas[1].name",
        "duplicate replica name 'gpu0'",
    ),
    (
        "max_sessions 0",
        at("pools", 0, "replicas", 1, "max_sessions", 0),
        "pools[0].replicas[1].max_sessions",
        "must be >= 1 (got 0)",
    ),
    (
        "route to unknown pool",
        at("routes", 2, "pool", "tts-lite"),
        "routes[2].pool",
        "unknown pool 'tts-lite'; defined pools: tts-main, asr-main",
    ),
    (
        "unknown protocol",
        at("routes", 0, "protocol", "vllm-omni-speech"),
        "routes[0].protocol",
        "did you mean 'vllm-omni-speech-ws'?",
    ),
    (
        "ftp url",
        at("pools", 0, "replicas", 0, "url", "ftp://10.0.0.5"),
        "pools[0].replicas[0].url",
        "must use http:// or https://",
    ),
    (
        "url without host",
        at("pools", 0, "replicas", 0, "url", "http:///v1"),
        "pools[0].replicas[0].url",
        "must include a host",
    ),
    (
        "url with query",
        at("pools", 0, "replicas", 0, "url", "http://10.0.0.5:8000/?x=1"),
        "pools[0].replicas[0].url",
        "no query",
    ),
    (
        "url with bad port",
        at("pools", 0, "replicas", 0, "url", "http://10.0.0.5:99999"),
        "pools[0].replicas[0].url",
        "not a valid URL",
    ),
    (
        "negative queue depth",
        at("pools", 0, "queue", "max_depth", -1),
        "pools[0].queue.max_depth",
        "must be >= 0 (got -1)",
    ),
    (
        "negative queue wait",
        at("pools", 0, "queue", "max_wait_s", -0.5),
        "pools[0].queue.max_wait_s",
        "must be >= 0",
    ),
    (
        "refusal close on HTTP",
        at("routes", 1, "refusal", "close"),
        "routes[1].refusal",
        "needs a WebSocket protocol",
    ),
    (
        "queue feedback on HTTP",
        at("routes", 1, "queue_feedback", True),
        "routes[1].queue_feedback",
        "needs a WebSocket protocol; openai-speech-http is HTTP",
    ),
    (
        "sagemaker without inner",
        at("routes", 2, "protocol", "sagemaker-bidi"),
        "routes[2].inner_protocol",
        "required for sagemaker-bidi",
    ),
    (
        "inner on plain route",
        at("routes", 2, "inner_protocol", "vllm-realtime"),
        "routes[2].inner_protocol",
        "only valid with protocol sagemaker-bidi",
    ),
    (
        "fallback to itself",
        at("pools", 0, "fallback", "pool", "tts-main"),
        "pools[0].fallback.pool",
        "must name another pool",
    ),
    (
        "fallback to unknown pool",
        at("pools", 0, "fallback", "pool", "tts-lite"),
        "pools[0].fallback.pool",
        "unknown pool 'tts-lite'",
    ),
    (
        "unknown nested key",
        at("pools", 0, "replicas", 0, "max_session", 3),
        "pools[0].replicas[0].max_session",
        "did you mean 'max_sessions'?",
    ),
    (
        "unknown top-level key",
        at("rootes", []),
        "<top level>",
        "unknown key 'rootes'; did you mean 'routes'?",
    ),
    (
        "admin off loopback without key",
        at("admin", {"host": "0.0.0.0"}),
        "admin.api_key_sha256",
        "required when the admin listener is bound to 0.0.0.0",
    ),
    (
        "uppercase sha256",
        at("auth", {"keys": [{"name": "a", "sha256": KEY_HASH.upper()}]}),
        "auth.keys[0].sha256",
        "64 lowercase hex",
    ),
    (
        "short sha256",
        at("admin", {"api_key_sha256": "abc"}),
        "admin.api_key_sha256",
        "64 lowercase hex",
    ),
    (
        "auth key for unknown pool",
        at("auth", {"keys": [{"name": "a", "sha256": KEY_HASH, "pools": ["tts"]}]}),
        "auth.keys[0].pools[0]",
        "unknown pool 'tts'",
    ),
    ("no pools", at("pools", []), "pools", "at least 1"),
    (
        "missing url",
        lambda d: d["pools"][0]["replicas"][0].pop("url"),
        "pools[0].replicas[0].url",
        "is required",
    ),
    (
        "duplicate route path",
        at("routes", 1, "path", "/v1/realtime"),
        "routes[2].path",
        "duplicate route path '/v1/realtime' (also routes[1].path)",
    ),
    (
        "path without slash",
        at("routes", 0, "path", "v1/realtime"),
        "routes[0].path",
        "must start with '/'",
    ),
    ("bad pool name", at("pools", 1, "name", "asr main"), "pools[1].name", "letters, digits"),
    ("guard mode", at("guard", {"mode": "block"}), "guard.mode", "off, observe, enforce"),
    ("infinite timeout", at("drain_timeout_s", float("inf")), "drain_timeout_s", "finite"),
    ("port clash", at("admin", {"port": 8080}), "admin.port", "clashes with listen.port"),
    (
        "sample rate",
        at("routes", 0, "audio", {"sample_rate": 4000}),
        "routes[0].audio.sample_rate",
        "must be >= 8000",
    ),
    ("pools not a list", at("pools", {"name": "x"}), "pools", "must be a list"),
]


@pytest.mark.parametrize(
    ("mutate", "path", "reason"), [case[1:] for case in INVALID], ids=[case[0] for case in INVALID]
)
def test_invalid_settings_name_the_field(
    mutate: Callable[[Any], None], path: str, reason: str
) -> None:
    data = valid()
    mutate(data)
    found = problems(data)
    assert has(found, path, reason), found


def test_all_problems_are_reported_at_once() -> None:
    data = valid()
    data["pools"][0]["replicas"][1]["max_sessions"] = 0
    data["pools"][1]["queue"] = {"max_depth": -1}
    data["routes"][2]["pool"] = "tts-lite"
    data["log_level"] = "verbose"
    found = problems(data)
    assert [p for p, _ in found] == [
        "log_level",
        "pools[0].replicas[1].max_sessions",
        "pools[1].queue.max_depth",
        "routes[2].pool",
    ]
    message = str(ConfigError(found, "x.yaml"))
    assert message.startswith("invalid configuration in x.yaml:\n  log_level: must be one of")


def test_sha256_value_is_never_echoed() -> None:
    secret = "my-real-api-key-pasted-by-mistake"
    data = valid()
    data["auth"] = {"keys": [{"name": "a", "sha256": secret}]}
    assert secret not in str(problems(data))


def write(tmp_path: Path, text: str, name: str = "headroom.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_yaml_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "listen:\n  port: 8080\n pools: [\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    ((where, reason),) = info.value.problems
    assert where.startswith("line 3, column ")
    assert "invalid YAML" in reason
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("- a\n- b\n", "must be a mapping of settings (got list)"),
        ("just text\n", "must be a mapping of settings (got str)"),
        ("", "the file is empty"),
        ("when: 2001-13-45\n", "invalid YAML"),
    ],
)
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, text), env={})
    assert reason in info.value.problems[0][1]


def test_missing_unreadable_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_settings(tmp_path / "absent.yaml", env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path, env={})
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"listen: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_settings(binary, env={})


def test_path_comes_from_headroom_config(tmp_path: Path) -> None:
    path = write(tmp_path, yaml.safe_dump(valid()))
    assert load_settings(env={"HEADROOM_CONFIG": str(path)}).total_slots == 40
    with pytest.raises(ConfigError, match="pass --config FILE or set HEADROOM_CONFIG"):
        load_settings(env={})


def test_loaded_settings_api(tmp_path: Path) -> None:
    data = valid()
    data["pools"][0]["replicas"][0]["url"] = "https://10.0.0.5:8443/base/"
    s = load(data)
    assert s.pool("tts-main").total_slots == 24
    assert s.total_slots == 40
    assert s.pool("tts-main").replicas[0].url == "https://10.0.0.5:8443/base"
    assert s.pool("tts-main").replicas[0].ws_url == "wss://10.0.0.5:8443/base"
    with pytest.raises(KeyError):
        s.pool("nope")
    route = s.route_for_path("/v1/realtime?model=x")
    assert route is not None
    assert route.pool == "asr-main"
    assert route.is_websocket
    assert s.route_for_path("/v1/audio/speech") is not None
    assert not s.route_for_path("/v1/audio/speech").is_websocket  # type: ignore[union-attr]
    assert s.route_for_path("/nope") is None
    assert s.listen.port == 8080
    assert s.admin.host == "127.0.0.1"
    assert s.guard.mode == "observe"
    assert s.pool("asr-main").queue.max_depth == 0
    assert s.pool("asr-main").queue.max_wait_s == 10
    assert s.limits.max_message_bytes == 4 * 1024 * 1024
    assert s.auth is None
    assert s.warnings() == []


def test_settings_are_frozen_and_comparable() -> None:
    s = load(valid())
    with pytest.raises(pydantic.ValidationError):
        s.listen.port = 1  # type: ignore[misc]
    assert isinstance(s.pools, tuple)
    assert s == load(valid())
    assert hash(s) == hash(load(valid()))
    changed = load(valid(), {"HEADROOM_POOLS__0__REPLICAS__0__MAX_SESSIONS": "6"})
    assert changed != s
    assert changed.pools[1] == s.pools[1]


def test_ws_base() -> None:
    assert ws_base("http://10.0.0.5:8000") == "ws://10.0.0.5:8000"
    assert ws_base("HTTPS://host/x") == "wss://host/x"
    with pytest.raises(ValueError, match="not an http"):
        ws_base("ftp://host")


def test_protocol_sets_partition_the_protocols() -> None:
    assert set(get_args(Protocol)) == WS_ROUTE_PROTOCOLS | HTTP_ROUTE_PROTOCOLS
    assert not WS_ROUTE_PROTOCOLS & HTTP_ROUTE_PROTOCOLS


def test_warnings_for_unused_pool_and_useless_feedback() -> None:
    data = valid()
    data["routes"][2]["pool"] = "tts-main"
    data["routes"][2]["queue_feedback"] = True
    data["pools"][0]["queue"]["max_depth"] = 0
    warnings = load(data).warnings()
    assert any("pool 'asr-main' is used by no route" in w for w in warnings)
    assert any("queue_feedback has no effect" in w for w in warnings)
    data["pools"][0]["fallback"] = {"pool": "asr-main"}
    assert not any("asr-main" in w for w in load(data).warnings())


def test_guard_mode_off_survives_yaml_booleans() -> None:
    data = valid()
    data.update(yaml.safe_load("guard: {mode: off}"))
    assert load(data).guard.mode == "off"


def test_summary_lists_pools_routes_and_listen() -> None:
    text = summary(load(valid(), {"HEADROOM_ROUTES__2__REFUSAL": "close"}))
    assert "listen  0.0.0.0:8080" in text
    assert "tts-main: 2 replica(s), 24 slots; queue up to 32, wait up to 10 s" in text
    assert "gpu0  http://10.0.0.5:8000  12 slots" in text
    assert "fallback voice=lite-female-1" in text
    assert "asr-main: 1 replica(s), 16 slots; no queue" in text
    assert "/v1/realtime -> asr-main  vllm-realtime, refusal close" in text
    assert "40 slots in all" in text
    # the wait of a WebSocket session whose handshake is held (unset: HANDSHAKE_WAIT_S)
    assert "queue up to 32, wait up to 10 s, handshake wait up to 5 s\n" in text
    held = {"HEADROOM_POOLS__0__QUEUE__MAX_HANDSHAKE_WAIT_S": "2.5"}
    assert "wait up to 10 s, handshake wait up to 2.5 s\n" in summary(load(valid(), held))


# -- environment overrides ---------------------------------------------------------------


def test_env_nested_scalar_and_case() -> None:
    s = load(
        valid(),
        {
            "HEADROOM_LISTEN__PORT": "9000",
            "headroom_Admin__Enabled": "false",
            "HEADROOM_GUARD__MODE": "enforce",
            "HEADROOM_METER__PREBUFFER_S": "0.5",
        },
    )
    assert (s.listen.port, s.admin.enabled, s.guard.mode) == (9000, False, "enforce")
    assert s.meter.prebuffer_s == 0.5


def test_env_list_indices() -> None:
    data = valid()
    original = copy.deepcopy(data)
    s = load(
        data,
        {
            "HEADROOM_POOLS__0__QUEUE__MAX_DEPTH": "4",
            "HEADROOM_POOLS__0__REPLICAS__1__MAX_SESSIONS": "8",
            "HEADROOM_POOLS__1__QUEUE__MAX_WAIT_S": "2",
        },
    )
    assert s.pools[0].queue.max_depth == 4
    assert [r.max_sessions for r in s.pools[0].replicas] == [12, 8]
    assert s.pools[1].queue == type(s.pools[1].queue)(max_depth=0, max_wait_s=2)
    assert data == original  # the caller's mapping is not modified


def test_env_whole_values_then_elements() -> None:
    routes = '[{"path": "/v1/realtime", "pool": "asr-main", "protocol": "vllm-realtime"}]'
    s = load(
        valid(),
        {
            "HEADROOM_ROUTES": routes,
            "HEADROOM_ROUTES__0__REFUSAL": "close",
            "HEADROOM_LISTEN": "{host: 127.0.0.1, port: 7000}",
        },
    )
    assert [(r.path, r.refusal) for r in s.routes] == [("/v1/realtime", "close")]
    assert (s.listen.host, s.listen.port) == ("127.0.0.1", 7000)


def test_env_mapping_replaces_the_files_mapping_whole() -> None:
    # A collection from the environment replaces the file's value; it is not merged into
    # it (the overlay used to go through pydantic-settings' deep merge, which kept the
    # file's other keys of a mapping).
    data = valid()
    data["listen"] = {"host": "0.0.0.0", "port": 9000}
    data["admission"] = {"redis": {"key_prefix": "file:"}}
    env = {"HEADROOM_LISTEN": "{host: 127.0.0.1}", "HEADROOM_ADMISSION": "{backend: memory}"}
    s = load(data, env)
    assert (s.listen.host, s.listen.port) == ("127.0.0.1", 8080)
    assert s.admission.redis.key_prefix == "headroom:"
    assert load(data, {"HEADROOM_LISTEN__HOST": "127.0.0.1"}).listen.port == 9000


def test_only_the_loaders_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEADROOM_LISTEN__PORT", "9100")
    assert Settings.model_validate(valid()).listen.port == 8080
    assert settings_from_mapping(valid()).listen.port == 9100


def test_env_strings_stay_verbatim_and_null_unsets() -> None:
    data = valid()
    data["admin"] = {"api_key_sha256": KEY_HASH}
    s = load(
        data,
        {
            "HEADROOM_POOLS__0__REPLICAS__0__NAME": "0",
            "HEADROOM_POOLS__0__FALLBACK__VOICE": " on ",
            "HEADROOM_ADMIN__API_KEY_SHA256": "null",
        },
    )
    assert s.pools[0].replicas[0].name == "0"
    assert s.pools[0].fallback is not None
    assert s.pools[0].fallback.voice == "on"
    assert s.admin.api_key_sha256 is None


def test_env_fills_absent_sections_and_defaults() -> None:
    s = load(
        valid(),
        {
            "HEADROOM_POOLS__1__FALLBACK__VOICE": "v",
            "HEADROOM_METER__CHUNK_DURATIONS_S__0": "0.01",
            "HEADROOM_AUTH": f'{{keys: [{{name: a, sha256: "{KEY_HASH}"}}]}}',
        },
    )
    assert s.pools[1].fallback is not None
    assert s.pools[1].fallback.voice == "v"
    assert s.meter.chunk_durations_s == (0.01, 0.04, 0.08, 0.2, 2.0)
    assert s.auth is not None
    assert s.auth.key_for(KEY_HASH) is not None


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        (
            {"HEADROOM_POOLS__5__QUEUE__MAX_DEPTH": "4"},
            "pools[5] does not exist (pools has 2 element(s), indices 0..1)",
        ),
        ({"HEADROOM_POOLS__0__REPLICAS__2__MAX_SESSIONS": "4"}, "pools[0].replicas[2] does not"),
        ({"HEADROOM_POOLS__NAME": "x"}, "index it with a number, e.g. HEADROOM_POOLS__0__NAME"),
        ({"HEADROOM_AUTH__KEYS__0__NAME": "x"}, "auth.keys[0] does not exist (auth.keys has 0"),
        ({"HEADROOM_LISTN__PORT": "1"}, "'listn' is not a setting; did you mean 'listen'?"),
        ({"HEADROOM_DRAIN_TIMEOUT": "5"}, "did you mean 'drain_timeout_s'?"),
        ({"HEADROOM_LISTEN__": "5"}, "empty name"),
    ],
)
def test_env_bad_paths_name_the_variable(env: dict[str, str], reason: str) -> None:
    found = problems(valid(), env)
    (name,) = env
    assert has(found, name, reason), found


def test_env_bad_values_name_the_variable() -> None:
    found = problems(
        valid(),
        {
            "HEADROOM_POOLS__0__REPLICAS__1__MAX_SESSIONS": "0",
            "HEADROOM_LIMITS__IDLE_TIMEOUT_S": "soon",
            "HEADROOM_LISTEN__PROT": "1",
        },
    )
    assert has(
        found,
        "pools[0].replicas[1].max_sessions",
        "must be >= 1 (got 0) (set by HEADROOM_POOLS__0__REPLICAS__1__MAX_SESSIONS)",
    )
    assert has(found, "limits.idle_timeout_s", "(set by HEADROOM_LIMITS__IDLE_TIMEOUT_S)")
    assert has(found, "listen.prot", "did you mean 'port'?")


def test_env_ignores_unrelated_variables() -> None:
    s = load(valid(), {"HEADROOM_SLOW": "1", "HEADROOM_CONFIG": "x.yaml", "PATH": "/bin"})
    assert s == load(valid())


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HEADROOM_LISTEN__PORT", "9100")
    assert settings_from_mapping(valid()).listen.port == 9100
    monkeypatch.setenv("HEADROOM_CONFIG", str(write(tmp_path, yaml.safe_dump(valid()))))
    assert load_settings().listen.port == 9100


def test_env_wins_over_file(tmp_path: Path) -> None:
    path = write(tmp_path, yaml.safe_dump({**valid(), "listen": {"port": 8000}}))
    assert load_settings(path, env={"HEADROOM_LISTEN__PORT": "8001"}).listen.port == 8001
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={"HEADROOM_POOLS__9__NAME": "x"})
    assert info.value.source == str(path)


# -- the shipped examples ---------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_loads(path: Path) -> None:
    s = load_settings(path, env={})
    assert s.warnings() == []
    assert summary(s)


def test_example_configs_cover_the_documented_deployments() -> None:
    assert {p.name for p in CONFIG_DIR.glob("*.yaml")} >= {
        "single-gpu.yaml",
        "gateway-4gpu.yaml",
        "sagemaker.yaml",
    }
    gateway = load_settings(CONFIG_DIR / "gateway-4gpu.yaml", env={})
    assert [(p.name, len(p.replicas)) for p in gateway.pools] == [("tts-main", 3), ("asr-main", 1)]
    assert gateway.guard.mode == "enforce"
    assert gateway.auth is not None
    sagemaker = load_settings(CONFIG_DIR / "sagemaker.yaml", env={})
    route = sagemaker.route_for_path("/invocations-bidirectional-stream")
    assert route is not None
    assert (route.protocol, route.inner_protocol, route.refusal, route.relay_path) == (
        "sagemaker-bidi",
        "vllm-realtime",
        "close",
        "/v1/realtime",
    )
    assert sagemaker.pools[0].replicas[0].url == "http://127.0.0.1:8081"


# -- nothing but ConfigError ------------------------------------------------------------

junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=3)
    ),
    max_leaves=12,
)
field_names = st.sampled_from([*Settings.model_fields, "_env_file", "name", "url", "pool"])


def leaves(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into ``node`` (containers and scalars)."""
    out = [path]
    if isinstance(node, dict):
        for key, value in node.items():
            out += leaves(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out += leaves(value, (*path, index))
    return out


def outcome(call: Callable[[], Settings]) -> None:
    """``call`` either succeeds or raises a ConfigError with readable problems."""
    try:
        call()
    except ConfigError as exc:
        found = exc.problems
    else:
        return
    assert found
    assert all(isinstance(path, str) and reason for path, reason in found)


@settings(max_examples=examples(150), deadline=None)
@given(st.dictionaries(field_names | st.text(max_size=6), junk, max_size=5))
def test_junk_mappings_raise_only_config_error(data: dict[str, Any]) -> None:
    outcome(lambda: load(data))


@settings(max_examples=examples(200), deadline=None)
@given(st.data())
def test_corrupted_valid_configs_raise_only_config_error(draw: st.DataObject) -> None:
    data = valid()
    for _ in range(draw.draw(st.integers(1, 3))):
        path = draw.draw(st.sampled_from(leaves(data)[1:]))
        target = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = draw.draw(junk)
    outcome(lambda: load(data))


@settings(max_examples=examples(150), deadline=None)
@given(
    st.dictionaries(
        st.from_regex(
            r"HEADROOM_(LISTEN|POOLS|ROUTES|GUARD|[A-Z_]{0,8})(__[A-Z0-9_]{0,8}){0,3}",
            fullmatch=True,
        ),
        st.text(max_size=20) | st.sampled_from(["[1, {a: 2}]", "{port: x}", "null", "0", "[]"]),
        max_size=4,
    )
)
def test_junk_environment_raises_only_config_error(env: dict[str, str]) -> None:
    outcome(lambda: load(valid(), env))


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.text(max_size=80)
    | st.sampled_from(
        [
            "a: &x [*x]\npools: *x\n",
            "? [a]\n: b\n",
            "x: !!python/object:os.system ls\n",
            "pools: [{name: 1, replicas: {}}]\nroutes: 3\n",
            "%YAML 9.9\n---\na: 1\n",
        ]
    )
)
def test_junk_yaml_raises_only_config_error(text: str) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "junk.yaml"
        path.write_bytes(text.encode("utf-8", "surrogatepass"))
        outcome(lambda: load_settings(path, env={}))


def test_problem_storms_are_capped() -> None:
    data = valid()
    data["pools"][0]["replicas"] = [
        {"name": f"r{i}", "url": "ftp://x", "max_sessions": 1} for i in range(80)
    ]
    found = problems(data)
    assert len(found) == 51
    assert found[-1] == ("...", "30 more problems not shown")


def test_empty_fallback_is_no_fallback() -> None:
    data = valid()
    data["pools"][0]["fallback"] = {}
    assert load(data).pools[0].fallback is None


# -- turning authentication off, and what a reload may not do --------------------------


def with_auth(**auth: Any) -> dict[str, Any]:
    data = valid()
    data["auth"] = auth
    return data


def test_auth_off_must_be_explicit() -> None:
    on = load(with_auth(keys=[{"name": "a", "sha256": KEY_HASH}]))
    assert on.auth is not None and not on.auth_disabled
    absent = load(valid())
    assert absent.auth is None and not absent.auth_disabled
    off = load(with_auth(enabled=False, keys=[{"name": "a", "sha256": KEY_HASH}]))
    assert off.auth is None and off.auth_disabled  # keys kept in the file, not checked
    assert load(with_auth(enabled=False)).auth_disabled
    assert "auth    off (auth.enabled: false)" in summary(off)
    env = {"HEADROOM_AUTH__ENABLED": "false"}
    assert load(with_auth(keys=[{"name": "a", "sha256": KEY_HASH}]), env).auth_disabled
    assert has(problems(with_auth()), "auth.keys", "auth: {enabled: false}")
    assert has(problems(with_auth(keys=[])), "auth.keys", "needs at least 1 key")


def test_reload_may_not_drop_auth_without_saying_so() -> None:
    from proxy.settings import reload_problems

    on = load(with_auth(keys=[{"name": "a", "sha256": KEY_HASH}]))
    off = load(with_auth(enabled=False))
    absent = load(valid())
    ((where, why),) = reload_problems(on, absent)
    assert where == "auth" and "auth: {enabled: false}" in why and "rename" in why
    assert reload_problems(on, off) == []  # explicit
    assert reload_problems(absent, absent) == [] and reload_problems(off, absent) == []
    assert reload_problems(absent, on) == []


def test_reload_keeps_an_admin_key_while_the_listener_is_off_loopback() -> None:
    from proxy.settings import reload_problems

    keyed = valid()
    keyed["admin"] = {"host": "0.0.0.0", "api_key_sha256": KEY_HASH}
    old, plain = load(keyed), load(valid())
    disabled = valid()
    disabled["admin"] = {"enabled": False}
    for new in (plain, load(disabled)):
        ((where, why),) = reload_problems(old, new, admin_bound="0.0.0.0")
        assert where == "admin.api_key_sha256" and "bound to 0.0.0.0" in why
    assert reload_problems(old, old, admin_bound="0.0.0.0") == []
    # On loopback too: a running listener keeps its key until a restart.
    for host in ("127.0.0.1", "::1"):
        ((where, why),) = reload_problems(old, plain, admin_bound=host)
        assert where == "admin.api_key_sha256" and "removed" in why and "restart" in why
    assert reload_problems(old, plain, admin_bound=None) == []  # no admin listener


def admin_block(text: str) -> str:
    """The ``admin:`` section of a YAML file, comments included."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("admin:"))
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i][:1] not in ("", " ", "#")),
        len(lines),
    )
    return "\n".join(lines[start:end])


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_example_admin_listener_is_loopback_and_described_truly(path: Path) -> None:
    # What each listener serves is checked against the running apps in
    # tests/integration/test_operations.py::test_admin_listener_serves_only_admin_endpoints.
    s = load_settings(path, env={})
    assert s.admin.host == "127.0.0.1"
    block = admin_block(path.read_text())
    for endpoint in ("/healthz", "/readyz", "/ping"):
        if endpoint in block:  # only to say it is *not* here
            assert "listener above" in block or ":8080" in block, block
    if "/metrics" in block:  # served here (on the client listener only if configured)
        assert "and /metrics" in block, block
    assert "/admin/" in block or "reload" in block
