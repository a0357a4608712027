"""The machine to itself: a test marked ``alone`` runs with no other test beside it.

Some tests measure a real engine twice and compare the readings (the calibration round
trips in tests/real_engine): on a 2-core machine a test on the other pytest-xdist worker
takes the CPU from the engine while one side measures and not while the other does.
Every test takes a lock on one file for its whole run (set-up, call and tear-down,
module fixtures included): shared by default, exclusive when marked ``alone``. So an
``alone`` test starts once the test running on the other worker has ended, and that
worker's next test waits for it to end. Processes a module fixture left running on the
other worker (an idle engine, a redis-server) stay up; no test drives them meanwhile.

The file is one per user (:func:`lock_path`), so two test runs on one machine share it
too, and anything else that must not run beside such a test can hold it shared:
``.ci/run`` builds its compiled and lowest-versions tiers under
``flock --shared "$(python3 -m tests.machine_share)"``.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["lock_path"]

MARKER = "alone"


def lock_path() -> Path:
    """The lock file every test run of this user on this machine shares."""
    return Path(tempfile.gettempdir()) / f"headroom-tests-{os.getuid()}.lock"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    exclusive = item.get_closest_marker(MARKER) is not None
    with lock_path().open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


if __name__ == "__main__":
    print(lock_path())
