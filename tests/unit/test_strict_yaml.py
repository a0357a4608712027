"""A key repeated in one YAML mapping is refused on every configuration load path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from proxy.errors import ConfigError
from proxy.settings import load_settings, strict_yaml

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
    from proxy.process.cli import main

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


# -- the event path and the node path give one answer -------------------------------------

#: Documents the event path builds itself and documents it leaves to the node path
#: (anchors, merges, tags, complex keys, repeated keys, several documents, errors).
DOCUMENTS = [
    "a: 1\nb: [1, 2]\n", "[1, 2]", "x", "", "# only a comment\n", "---\n", "--- x\n...\n",
    "a: {b: {c: [1, {d: e}]}}\n", "- - - 1\n", "a:\n", "{a: , b: ~, c: null, d: Null}",
    "a: yes\nb: No\nc: on\nd: OFF\ne: true\nf: y\n", "a: 0x1f\nb: 0o17\nc: 1_000\nd: 1:30\n",
    "a: 017\nb: -0\nc: +12\n", "a: 1.5\nb: .inf\nc: -.Inf\nd: .nan\ne: 1e3\nf: 6.8523015e+5\n",
    "a: 2001-12-14\nb: 2001-12-14t21:59:43.10-05:00\nc: 2001-12-14 21:59:43.10\n",
    "when: 2001-13-45\n", "a: !!binary aGVsbG8=\n", "a: !!str 12\nb: !!int '7'\nc: !!float 1\n",
    "a: !!set {x, y}\n", "a: !!omap [x: 1]\n", "a: !custom 1\n", "! a: ! 1\n",
    "a: 'quoted: yes'\nb: \"esc\\u00e9\\n\"\nc: |\n  lit\n  eral\nd: >\n  fol\n  ded\n",
    "'1': a\n1: b\n", "1: a\n'1': b\n", "{1: a, 1.0: b}", "{true: 1, 1: 2}", "{.nan: 1, .nan: 2}",
    "base: &b {cap: 4, url: u}\nreplica:\n  <<: *b\n  cap: 8\n", "a: &x 1\nb: *x\n",
    "a: &x [1]\nb: *x\n", "a: &x [*x]\n", "? [1, 2]\n: v\n", "? {a: 1}\n: v\n", "=: 1\n", "a: =\n",
    "{a: 1, a: 2}", "a: 1\nb: {c: 1}\na: 2\n", "- {x: 1, x: 1}\n", "a: 1\n---\nb: 2\n",
    "a: [1\nb", "a: b: c\n", "\ta: 1\n", "a: *missing\n", "é: ü\n", "a: \"\\x\"\n",
    "[" * 150 + "]" * 150, "[" * 2000 + "]" * 2000, "a: " + "{b: " * 120 + "1" + "}" * 120,
]  # fmt: skip


def _outcome(load: Any) -> tuple[str, str]:
    """What a load gave: the value's repr with its type, or the error's type and text."""
    try:
        value = load()
    except Exception as exc:  # the errors are compared, whatever they are
        return type(exc).__name__, str(exc)
    return type(value).__name__, repr(value)


def _node_path(text: str) -> tuple[str, str]:
    def load() -> Any:
        loader = strict_yaml.StrictLoader(text)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()

    return _outcome(load)


@pytest.mark.parametrize("text", DOCUMENTS)
def test_load_gives_what_the_node_based_loader_gives(text: str) -> None:
    assert _outcome(lambda: strict_yaml.load(text)) == _node_path(text)


@pytest.mark.parametrize("text", [d for d in DOCUMENTS if "&" not in d and "!" not in d])
def test_without_repeated_keys_load_gives_what_safe_load_gives(text: str) -> None:
    node = _node_path(text)
    if not node[0].endswith("Error"):
        assert _outcome(lambda: strict_yaml.load(text)) == _outcome(lambda: yaml.safe_load(text))


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
    st.text(max_size=12), st.sampled_from(["yes", "off", "~", "1:30", "0x1f", "2001-12-14",
                                           "<<", "=", ".inf", "1_000", "", " lead", "a: b"]),
)  # fmt: skip
_keys = st.one_of(st.text(max_size=8), st.integers(), st.booleans())
_documents = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=4),
    max_leaves=25,
)


@given(data=_documents, flow=st.sampled_from([None, True, False]))
def test_dumped_documents_load_as_the_node_based_loader_loads_them(data: Any, flow: Any) -> None:
    text = yaml.safe_dump(data, default_flow_style=flow, allow_unicode=True)
    assert _outcome(lambda: strict_yaml.load(text)) == _node_path(text)


def test_the_shipped_configurations_take_the_event_path() -> None:
    """The example configurations are plain documents: built from the events, not
    deferred to the node path."""
    root = Path(__file__).resolve().parents[2]
    files = sorted((root / "config").glob("*.yaml"))
    assert files
    for path in files:
        text = path.read_text()
        assert strict_yaml._from_events(text) == yaml.safe_load(text), path.name


def test_an_error_names_the_file() -> None:
    with pytest.raises(yaml.MarkedYAMLError) as info:
        strict_yaml.load("a: [1\nb", name="headroom.yaml")
    assert info.value.problem_mark is not None
    assert info.value.problem_mark.name == "headroom.yaml"
    assert 'in "headroom.yaml", line' in str(info.value)
