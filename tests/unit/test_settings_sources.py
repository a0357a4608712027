"""Secret files and the ``.env`` file: read with pydantic-settings, applied by the
``HEADROOM_*`` overlay, below the environment; problems name the file, never the value."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from proxy.errors import ConfigError
from proxy.process import cli
from proxy.settings import load_settings, sources
from tests.unit.test_settings import valid

URL = "redis://:s3cret-pass@redis.internal:6379/0"


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "headroom.yaml"
    path.write_text(yaml.safe_dump(valid()))
    return path


def secrets_dir(tmp_path: Path, **files: str) -> Path:
    directory = tmp_path / "secrets"
    directory.mkdir(exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


def env_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "headroom.env"
    path.write_text(text)
    return path


def refusal(config: Path, env: dict[str, str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_settings(config, env=env)
    return info.value


def test_a_secret_file_sets_the_redis_url(config: Path, tmp_path: Path) -> None:
    directory = secrets_dir(tmp_path, headroom_admission__redis__url=URL + "\n")
    s = load_settings(config, env={"HEADROOM_SECRETS_DIR": str(directory)})
    assert s.admission.redis.url == URL


def test_an_env_file_sets_the_redis_url(config: Path, tmp_path: Path) -> None:
    path = env_file(tmp_path, f"# shared\nHEADROOM_ADMISSION__REDIS__URL={URL}\n")
    s = load_settings(config, env={"HEADROOM_ENV_FILE": str(path)})
    assert s.admission.redis.url == URL


def test_a_kubernetes_secret_volume_is_read_through_its_links(config: Path, tmp_path: Path) -> None:
    # A Secret volume: each key a link into ..data, itself a link to a timestamped dir.
    directory = tmp_path / "mounted"
    stamped = directory / "..2026_12_02_17_00_00.1"
    stamped.mkdir(parents=True)
    (stamped / "headroom_admission__redis__url").write_text(URL)
    (directory / "..data").symlink_to(stamped.name)
    (directory / "headroom_admission__redis__url").symlink_to(
        "..data/headroom_admission__redis__url"
    )
    s = load_settings(config, env={"HEADROOM_SECRETS_DIR": str(directory)})
    assert s.admission.redis.url == URL


def test_precedence_is_env_then_secret_then_env_file_then_file(
    config: Path, tmp_path: Path
) -> None:
    data = {**valid(), "listen": {"port": 7001}, "log_level": "error", "drain_timeout_s": 5}
    data["admission"] = {"redis": {"key_prefix": "file:"}}
    config.write_text(yaml.safe_dump(data))
    dotenv = env_file(
        tmp_path,
        "HEADROOM_LISTEN__PORT=7002\nHEADROOM_LOG_LEVEL=warning\n"
        "HEADROOM_ADMISSION__REDIS__KEY_PREFIX=dotenv:\n",
    )
    directory = secrets_dir(tmp_path, HEADROOM_LISTEN__PORT="7003", headroom_log_level="debug")
    env = {"HEADROOM_ENV_FILE": str(dotenv), "HEADROOM_SECRETS_DIR": str(directory)}
    s = load_settings(config, env={**env, "HEADROOM_LISTEN__PORT": "7004"})
    assert s.listen.port == 7004  # env over secret
    assert s.log_level == "debug"  # secret over .env
    assert s.admission.redis.key_prefix == "dotenv:"  # .env over file
    assert s.drain_timeout_s == 5  # the file where nothing else says
    assert load_settings(config, env=env).listen.port == 7003


def test_a_whole_section_from_a_higher_source_replaces_a_lower_sources_part(
    config: Path, tmp_path: Path
) -> None:
    directory = secrets_dir(tmp_path, headroom_admission__redis__key_prefix="secret:")
    env = {"HEADROOM_SECRETS_DIR": str(directory), "HEADROOM_ADMISSION": "{backend: memory}"}
    assert load_settings(config, env=env).admission.redis.key_prefix == "headroom:"


@pytest.mark.parametrize("kind", ["secret", "dotenv"])
def test_a_misspelt_name_is_refused_naming_the_file(
    kind: str, config: Path, tmp_path: Path
) -> None:
    if kind == "secret":
        directory = secrets_dir(tmp_path, headroom_admision__redis__url=URL)
        env = {"HEADROOM_SECRETS_DIR": str(directory)}
        where = f"secret file {directory / 'headroom_admision__redis__url'}"
    else:
        path = env_file(tmp_path, f"HEADROOM_ADMISION__REDIS__URL={URL}\n")
        env = {"HEADROOM_ENV_FILE": str(path)}
        where = f"HEADROOM_ADMISION__REDIS__URL in env file {path}"
    err = refusal(config, env)
    assert err.problems == [(where, "'admision' is not a setting; did you mean 'admission'?")]
    assert "s3cret" not in str(err)


@pytest.mark.parametrize("kind", ["secret", "dotenv"])
def test_a_bad_value_is_refused_naming_the_file_never_the_value(
    kind: str, config: Path, tmp_path: Path
) -> None:
    bad = {"admission__redis__url": "http://:s3cret-pass@h/0", "listen__port": "s3cret-port"}
    if kind == "secret":
        directory = secrets_dir(tmp_path, **{f"headroom_{k}": v for k, v in bad.items()})
        env = {"HEADROOM_SECRETS_DIR": str(directory)}
        by = {k: f"(set by secret file {directory / ('headroom_' + k)})" for k in bad}
    else:
        text = "".join(f"HEADROOM_{k.upper()}={v}\n" for k, v in bad.items())
        path = env_file(tmp_path, text)
        env = {"HEADROOM_ENV_FILE": str(path)}
        by = {k: f"(set by HEADROOM_{k.upper()} in env file {path})" for k in bad}
    err = refusal(config, env)
    found = dict(err.problems)
    assert found["admission.redis.url"] == (
        "must use redis://, rediss:// (TLS), unix://, or redis+cluster:// "
        "(rediss+cluster:// for TLS) for a Redis Cluster " + by["admission__redis__url"]
    )
    assert found["listen.port"].startswith("must be a valid integer")
    assert found["listen.port"].endswith("(got <not shown>) " + by["listen__port"])
    assert "s3cret" not in str(err)


def test_a_value_shown_by_a_validator_is_hidden_too(config: Path, tmp_path: Path) -> None:
    path = env_file(tmp_path, "HEADROOM_POOLS__0__NAME=has space s3cret\n")
    err = refusal(config, {"HEADROOM_ENV_FILE": str(path)})
    assert "s3cret" not in str(err)
    assert any(p == "pools[0].name" and "<not shown>" in why for p, why in err.problems)


def test_missing_sources_are_refused_by_name(config: Path, tmp_path: Path) -> None:
    gone = tmp_path / "nowhere"
    err = refusal(config, {"HEADROOM_SECRETS_DIR": str(gone)})
    assert err.problems == [(f"secrets directory {gone} (HEADROOM_SECRETS_DIR)", "does not exist")]
    err = refusal(config, {"HEADROOM_ENV_FILE": str(gone)})
    assert err.problems == [(f"env file {gone} (HEADROOM_ENV_FILE)", "does not exist")]
    file = env_file(tmp_path, "")
    err = refusal(config, {"HEADROOM_SECRETS_DIR": str(file)})
    assert err.problems == [
        (f"secrets directory {file} (HEADROOM_SECRETS_DIR)", "is not a directory")
    ]


def test_an_oversized_env_file_is_refused(config: Path, tmp_path: Path) -> None:
    path = env_file(tmp_path, "# " + "x" * sources.MAX_SOURCE_BYTES + "\n")
    err = refusal(config, {"HEADROOM_ENV_FILE": str(path)})
    assert err.problems == [
        (f"env file {path} (HEADROOM_ENV_FILE)", f"is larger than {sources.MAX_SOURCE_BYTES} bytes")
    ]


def test_locators_are_not_read_from_the_files(config: Path, tmp_path: Path) -> None:
    path = env_file(tmp_path, "HEADROOM_CONFIG=other.yaml\n")
    err = refusal(config, {"HEADROOM_ENV_FILE": str(path)})
    assert err.problems == [
        (
            f"HEADROOM_CONFIG in env file {path}",
            "is read from the process environment only, not from this file",
        )
    ]


def test_other_programs_secrets_are_ignored(config: Path, tmp_path: Path) -> None:
    directory = secrets_dir(tmp_path, db_password="x", token="y")
    (directory / "kubernetes.io").mkdir()
    (directory / "kubernetes.io" / "token").write_text("z")
    env = {"HEADROOM_SECRETS_DIR": str(directory)}
    assert load_settings(config, env=env) == load_settings(config, env={})


def test_the_default_secrets_dir_is_read_when_present_and_empty_turns_it_off(
    config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = secrets_dir(tmp_path, headroom_admission__redis__url=URL)
    monkeypatch.setattr(sources, "DEFAULT_SECRETS_DIR", directory)
    assert load_settings(config, env={}).admission.redis.url == URL
    off = load_settings(config, env={"HEADROOM_SECRETS_DIR": ""})
    assert off.admission.redis.url == "redis://127.0.0.1:6379/0"
    monkeypatch.setattr(sources, "DEFAULT_SECRETS_DIR", tmp_path / "absent")
    assert load_settings(config, env={}).admission.redis.url == "redis://127.0.0.1:6379/0"


def test_check_reads_the_env_file_flag(
    config: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("HEADROOM_ENV_FILE", "")  # restored after the test; main sets it
    monkeypatch.setenv("HEADROOM_SECRETS_DIR", "")
    path = env_file(tmp_path, "HEADROOM_LISTEN__PORT=7123\n")
    assert cli.main(["check", "--config", str(config), "--env-file", str(path)]) == 0
    assert os.environ["HEADROOM_ENV_FILE"] == str(path)
    assert "7123" in capsys.readouterr().out


def test_check_summarises_readiness_metrics_and_tracing(config: Path) -> None:
    from proxy.settings import summary

    plain = summary(load_settings(config, env={"HEADROOM_SECRETS_DIR": ""}))
    assert "ops     readiness upstream; /metrics on admin listener; traces off" in plain
    env = {
        "HEADROOM_SECRETS_DIR": "",
        "HEADROOM_READINESS": "self",
        "HEADROOM_METRICS__CLIENT_PORT": "true",
        "HEADROOM_TRACING": "{enabled: true, endpoint: 'http://otel:4318/v1/traces'}",
    }
    line = next(x for x in summary(load_settings(config, env=env)).splitlines() if x[:3] == "ops")
    assert line == (
        "ops     readiness self; /metrics on admin listener and client listener; "
        "traces OTLP to http://otel:4318/v1/traces, sampled 1, as headroom"
    )
