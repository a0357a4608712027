"""A pytest plugin (loaded by tests/conftest.py): every test's result is reported under its
name, even when building its report fails.

Two things can make building a report raise, and an exception there is an internal error
that stops the run (or, under pytest-xdist, the worker, with no summary of what failed):

- On CPython 3.11 the garbage collector runs inside object allocation, so it can run a
  finalizer while ``ast.parse`` is building the tree pytest uses to show a failing line.
  A finalizer that raises reaches ``sys.unraisablehook``; pytest's hook formats that
  exception with ``traceback``, which parses source with ``ast.parse`` too, and the inner
  parse resets the interpreter-wide recursion counter of the outer one, which then fails
  with ``SystemError: AST constructor recursion depth mismatch`` (a CPython bug; from 3.12
  the collector runs between bytecodes, never inside ``ast.parse``).
  A test that fails before its clean-up leaves such objects behind: an asyncio
  subprocess transport whose event loop has closed raises "Event loop is closed" when
  collected. So no garbage is collected while a report is built; what was left is
  collected afterwards and pytest reports its finalizer's exception as usual.
- A plugin's hook wrapper may raise while the report passes through it (for example a
  warning, an error under ``filterwarnings = error``, from an import it makes only once a
  test has failed). Such an exception becomes a failed report naming the test, the phase,
  that exception and the phase's own exception.
"""

from __future__ import annotations

import gc
import traceback
from collections.abc import Generator

import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    collecting = gc.isenabled()
    gc.disable()
    try:
        return (yield)
    except Exception as error:
        return unbuilt_report(item, call, error)
    finally:
        if collecting:
            gc.enable()


def unbuilt_report(
    item: pytest.Item, call: pytest.CallInfo[None], error: Exception
) -> pytest.TestReport:
    """A failed report for ``item``'s ``call.when`` phase, whose report could not be built
    because of ``error``: both exceptions as plain tracebacks."""
    parts = [f"building the {call.when} report of {item.nodeid} raised:\n", plain(error)]
    if call.excinfo is not None:
        parts += [f"\nthe {call.when} phase itself raised:\n", plain(call.excinfo.value)]
    return pytest.TestReport(
        item.nodeid,
        item.location,
        dict.fromkeys(item.keywords, 1),
        "failed",
        "".join(parts),
        call.when,
        duration=call.duration,
        start=call.start,
        stop=call.stop,
        user_properties=item.user_properties,
    )


def plain(error: BaseException) -> str:
    try:
        return "".join(traceback.format_exception(error))
    except Exception:
        return f"{type(error).__name__}: {error}\n"
