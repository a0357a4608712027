"""proxy.speedups: which per-chunk modules run compiled, and setup.py's list of them."""

from __future__ import annotations

import os
import runpy
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from proxy import speedups
from proxy.speedups import HOT_MODULES, STALE_AFTER_S, BuildStatus, build_status, module_state

REPO = Path(__file__).resolve().parents[2]
SUFFIX = EXTENSION_SUFFIXES[0]


def _pair(tmp_path: Path, source_age: float, compiled_age: float) -> str:
    source, compiled = tmp_path / "meter.py", tmp_path / f"meter{SUFFIX}"
    source.write_text("x = 1\n")
    compiled.write_bytes(b"\x7fELF")
    now = 1_700_000_000.0
    os.utime(source, (now - source_age, now - source_age))
    os.utime(compiled, (now - compiled_age, now - compiled_age))
    return str(compiled)


def test_a_py_file_is_interpreted() -> None:
    assert module_state("/site/proxy/meter.py") == "interpreted"
    assert module_state("") == "interpreted"


def test_an_extension_module_is_compiled_unless_its_source_was_edited_after_it(
    tmp_path: Path,
) -> None:
    # built after the edit, or written in the same moment as its source by an install
    assert module_state(_pair(tmp_path, source_age=100.0, compiled_age=50.0)) == "compiled"
    assert module_state(_pair(tmp_path, source_age=0.0, compiled_age=STALE_AFTER_S / 2)) == (
        "compiled"
    )
    # the source edited after the in-place build
    stale = _pair(tmp_path, source_age=0.0, compiled_age=STALE_AFTER_S + 60.0)
    assert module_state(stale) == "stale"
    # no source beside it (a wheel that ships only the extension)
    (tmp_path / "meter.py").unlink()
    assert module_state(stale) == "compiled"


def test_build_status_reports_every_hot_module_once() -> None:
    status = build_status()
    assert sorted(status.compiled + status.interpreted) == sorted(HOT_MODULES)
    assert set(status.stale) <= set(status.compiled)


@pytest.mark.parametrize(
    ("status", "line", "code"),
    [
        (BuildStatus((), HOT_MODULES, ()), "interpreted (0 of 14 compiled)", 1),
        (BuildStatus(HOT_MODULES, (), ()), "compiled with mypyc: 14 of 14", 0),
        (
            BuildStatus(HOT_MODULES[1:], HOT_MODULES[:1], ()),
            f"13 of 14 (interpreted: {HOT_MODULES[0]})",
            1,
        ),
        (BuildStatus(HOT_MODULES, (), HOT_MODULES[:1]), "compiled with mypyc: 14 of 14", 1),
    ],
)
def test_require_compiled_fails_unless_all_are_compiled_and_fresh(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    status: BuildStatus,
    line: str,
    code: int,
) -> None:
    monkeypatch.setattr(speedups, "build_status", lambda: status)
    assert speedups.main(["--require-compiled"]) == code
    assert speedups.main([]) == 0
    out, err = capsys.readouterr()
    assert line in out
    assert ("stale: " in err) == bool(status.stale)


def test_setup_py_compiles_exactly_the_hot_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    setup = runpy.run_path(str(REPO / "setup.py"), run_name="setup_under_test")
    assert setup["hot_modules"]() == list(HOT_MODULES)
    for name in HOT_MODULES:
        assert (REPO / (name.replace(".", "/") + ".py")).is_file(), name
    monkeypatch.delenv("HEADROOM_MYPYC", raising=False)
    assert setup["ext_modules"]() == []  # the default install is pure Python
    monkeypatch.setenv("HEADROOM_MYPYC", "yes")
    with pytest.raises(SystemExit, match="HEADROOM_MYPYC must be 0 or 1"):
        setup["ext_modules"]()
