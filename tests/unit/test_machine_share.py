"""tests/machine_share.py: a test marked ``alone`` waits while anything holds the lock
shared (a test on another worker, a CI build), and the other tests do not wait for each
other. A pytest run of its own, with the lock file in a directory of the test's own."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

TESTS = """
from pathlib import Path
import pytest

def test_1_shares():
    Path({out!r}, "shared").write_text("ran")

@pytest.mark.alone
def test_2_alone():
    Path({out!r}, "alone").write_text("ran")
"""


def wait_for(path: Path, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_an_alone_test_waits_for_the_shared_holders_and_the_others_do_not(
    tmp_path: Path,
) -> None:
    tmp, out, suite = tmp_path / "tmp", tmp_path / "out", tmp_path / "suite"
    for d in (tmp, out, suite):
        d.mkdir()
    (suite / "conftest.py").write_text('pytest_plugins = ("tests.machine_share",)\n')
    (suite / "test_order.py").write_text(TESTS.format(out=str(out)))
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    lock = subprocess.run(
        [sys.executable, "-m", "tests.machine_share"], env=env, cwd=ROOT,
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert Path(lock).parent == tmp
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_SH)  # as a test on the other worker holds it
        run = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
             "no:randomly", "-o", "markers=alone: the machine to itself", str(suite)],
            env=env, cwd=suite, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            assert wait_for(out / "shared", 60.0), "a shared test waited for a shared holder"
            # the alone test comes next and must not start while the lock is held
            assert not wait_for(out / "alone", 1.0), "the alone test ran beside a holder"
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
        output, _ = run.communicate(timeout=60)
    assert run.returncode == 0, output
    assert (out / "alone").read_text() == "ran"
