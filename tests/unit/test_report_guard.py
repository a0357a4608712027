"""tests/report_guard.py: a test whose report cannot be built is still reported by name,
and the run goes on. Each case runs pytest in a subprocess over a small generated suite
whose failing tests make building a report fail the two ways the plugin describes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

INI = """\
[pytest]
filterwarnings = error
markers =
    plugin_raises: the plugin below raises while this test's teardown report passes through it
"""

CONFTEST = '''\
import ast
import gc
import sys
import warnings

import pytest


class Leftover:
    """Cyclic garbage whose finalizer raises, as an asyncio subprocess transport's does
    when it is collected after its event loop closed."""

    def __init__(self):
        self.cycle = self

    def __del__(self):
        raise RuntimeError("Event loop is closed")


armed = False


def leave_garbage_inside_ast_parse(phase, info):
    """At the first collection that starts inside ast.parse once armed, a Leftover is
    left for that collection to free."""
    global armed
    if armed and phase == "start" and sys._getframe(1).f_code is ast.parse.__code__:
        armed = False
        Leftover()


gc.callbacks.append(leave_garbage_inside_ast_parse)


@pytest.fixture
def finalizer_inside_ast_parse():
    """Call it, then fail: a collection runs at every allocation, and the first one
    inside ast.parse (pytest's, showing the failing line) runs a raising finalizer."""
    thresholds = gc.get_threshold()

    def arm():
        global armed
        armed = True
        gc.set_threshold(1)

    yield arm
    global armed
    armed = False
    gc.set_threshold(*thresholds)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.when == "teardown" and item.get_closest_marker("plugin_raises"):
        warnings.warn("an import this plugin makes once a test failed", DeprecationWarning)
'''

TESTS = """\
import pytest


def test_passes():
    pass


def test_fails_while_a_finalizer_raises_inside_ast_parse(finalizer_inside_ast_parse):
    finalizer_inside_ast_parse()
    assert 1 == 2


@pytest.mark.plugin_raises
def test_fails_and_a_plugin_raises_at_its_teardown():
    assert "a" == "b"


def test_fails():
    assert [] == [0]


def test_passes_after_them():
    pass
"""

FAILED = {
    "test_cases.py::test_fails_while_a_finalizer_raises_inside_ast_parse",
    "test_cases.py::test_fails_and_a_plugin_raises_at_its_teardown",
    "test_cases.py::test_fails",
}


def write_suite(directory: Path, tests: str = TESTS) -> None:
    (directory / "pytest.ini").write_text(INI)
    (directory / "conftest.py").write_text(CONFTEST)
    (directory / "test_cases.py").write_text(tests)


def run_pytest(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    # only the plugins named here and the generated conftest: none that this machine has
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", *args],
        cwd=directory, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def summary_names(output: str, label: str) -> set[str]:
    return set(re.findall(rf"^{label} (\S+)", output, re.MULTILINE))


@pytest.mark.parametrize(
    "workers", [[], ["-p", "xdist.plugin", "-n", "2"]], ids=["one-process", "xdist"]
)
def test_every_failure_is_named_and_the_run_goes_on(tmp_path: Path, workers: list[str]) -> None:
    write_suite(tmp_path)
    result = run_pytest(tmp_path, "-p", "tests.report_guard", *workers)
    output = result.stdout + result.stderr
    assert "INTERNALERROR" not in output, output
    assert result.returncode == 1, output
    assert summary_names(output, "FAILED") == FAILED, output
    # the plugin's exception, as an error at the teardown of the test it was reporting on
    assert summary_names(output, "ERROR") == {
        "test_cases.py::test_fails_and_a_plugin_raises_at_its_teardown"
    }, output
    assert "building the teardown report of" in output, output
    # no collection ran inside ast.parse: the finalizer case has pytest's own report
    assert "building the call report of" not in output, output
    assert "SystemError" not in output, output
    assert "an import this plugin makes once a test failed" in output, output
    assert re.search(r"\b3 failed, 2 passed, 1 error\b", output), output


@pytest.mark.skipif(
    sys.version_info[:2] != (3, 11),
    reason="from 3.12 the garbage collector runs between bytecodes, never inside ast.parse",
)
def test_without_the_plugin_a_finalizer_inside_ast_parse_stops_the_run(tmp_path: Path) -> None:
    """The condition the plugin prevents, reproduced: the run stops at the second test,
    and no failure is named."""
    write_suite(tmp_path, TESTS.replace("@pytest.mark.plugin_raises\n", ""))
    result = run_pytest(tmp_path)
    output = result.stdout + result.stderr
    assert "INTERNALERROR> SystemError: AST constructor recursion depth mismatch" in output, output
    assert summary_names(output, "FAILED") == set(), output
    assert re.search(r"^1 passed in ", output, re.MULTILINE), output


def test_without_the_plugin_a_plugin_raising_in_a_report_stops_the_run(tmp_path: Path) -> None:
    write_suite(tmp_path, TESTS.replace("    finalizer_inside_ast_parse()\n", ""))
    result = run_pytest(tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 3, output  # an internal error
    assert "INTERNALERROR> DeprecationWarning: an import this plugin makes" in output, output
    assert summary_names(output, "FAILED") == set(), output
    assert re.search(r"^2 failed, 1 passed in ", output, re.MULTILINE), output
