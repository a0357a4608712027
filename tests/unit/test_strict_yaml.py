"""A key repeated in one YAML mapping is refused on every configuration load path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from proxy import strict_yaml
from proxy.errors import ConfigError
from proxy.settings import load_settings

CAPPED = """\
pools:
  - name: main
    replicas:
      - name: gpu0
        url: http://127.0.0.1:9
        max_sessions: 4
        max_sessions: 40
routes:
  - {path: /x, pool: main, protocol: passthrough-ws}
"""


def test_plain_safe_load_keeps_the_last_value_which_is_the_hazard() -> None:
    assert yaml.safe_load(CAPPED)["pools"][0]["replicas"][0]["max_sessions"] == 40


def test_duplicate_key_names_the_key_and_both_lines() -> None:
    with pytest.raises(strict_yaml.DuplicateKeyError) as info:
        strict_yaml.load(CAPPED)
    err = info.value
    assert err.key == "max_sessions" and err.first_line == 6
    assert err.problem_mark is not None and err.problem_mark.line + 1 == 7
    assert isinstance(err, yaml.MarkedYAMLError)  # existing YAML error handlers catch it


@pytest.mark.parametrize(
    "text",
    [
        "{a: 1, a: 2}",
        "a: 1\nb: {c: 1}\na: 2\n",
        "- {x: 1, x: 1}\n",
        "{1: a, 1: b}",
        "{true: 1, on: 2}",
    ],
)
def test_every_kind_of_repetition_is_refused(text: str) -> None:
    with pytest.raises(strict_yaml.DuplicateKeyError):
        strict_yaml.load(text)


def test_merge_keys_are_overrides_not_duplicates() -> None:
    text = "base: &b {cap: 4, url: u}\nreplica:\n  <<: *b\n  cap: 8\n"
    assert strict_yaml.load(text)["replica"] == {"cap": 8, "url": "u"}


def test_distinct_keys_and_other_documents_load_as_safe_load_does() -> None:
    for text in ("a: 1\nb: [1, 2]\n", "[1, 2]", "x", "", "a: &x [1]\nb: *x\n"):
        assert strict_yaml.load(text) == yaml.safe_load(text)


def test_key_path_finds_the_repeated_key() -> None:
    index = CAPPED.rindex("max_sessions")
    assert strict_yaml.key_path(CAPPED, index) == ("pools", 0, "replicas", 0, "max_sessions")
    assert strict_yaml.key_path(CAPPED, 1) is None
    assert strict_yaml.key_path("a: &x [*x]\n", 99) is None  # self-referencing alias: no loop


def test_serve_check_and_reload_refuse_a_repeated_cap(tmp_path: Path) -> None:
    # serve, check and reload all read the file through load_settings.
    path = tmp_path / "headroom.yaml"
    path.write_text(CAPPED)
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    ((where, why),) = info.value.problems
    assert where == "pools[0].replicas[0].max_sessions"
    assert "duplicate key 'max_sessions' (first at line 6)" in why and "line 7" in why


def test_cli_check_fails_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from proxy.cli import main

    path = tmp_path / "headroom.yaml"
    path.write_text(CAPPED)
    assert main(["check", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "pools[0].replicas[0].max_sessions: duplicate key 'max_sessions'" in err


def test_environment_values_refuse_repeated_keys(tmp_path: Path) -> None:
    path = tmp_path / "headroom.yaml"
    path.write_text(CAPPED.replace("        max_sessions: 40\n", ""))
    assert load_settings(path, env={}).pools[0].replicas[0].max_sessions == 4
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={"HEADROOM_LISTEN": "{port: 1, port: 2}"})
    ((where, why),) = info.value.problems
    assert where == "HEADROOM_LISTEN" and "duplicate key 'port'" in why


def test_probe_workloads_and_config_edits_refuse_repeated_keys() -> None:
    from proxy.probe.config_edit import ConfigEditError, set_max_sessions
    from proxy.probe.workload import WorkloadError, load_workload

    with pytest.raises(WorkloadError, match="duplicate key 'requests'"):
        load_workload("requests: [{text: a}]\nrequests: [{text: b}]\n", "w.yaml")
    with pytest.raises(ConfigEditError, match="duplicate key 'max_sessions'"):
        set_max_sessions(CAPPED, "main", "gpu0", 3)
