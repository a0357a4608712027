"""The ``--workers`` supervisor's verdict (proxy.process.workers.Supervisor.run), with stand-in
worker processes: no process starts, no signal is sent."""

from __future__ import annotations

import signal

import pytest

from proxy.process.workers import Supervisor


class Worker:
    """A stand-in for a worker's Popen: exits when the test says."""

    def __init__(self, pid: int, returncode: int | None = None) -> None:
        self.pid = pid
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


def _supervisor(*workers: Worker) -> tuple[Supervisor, list[int]]:
    supervisor = Supervisor(None, len(workers), lambda i, fds: [], None)  # type: ignore[arg-type]
    supervisor.processes = list(workers)  # type: ignore[arg-type]
    sent: list[int] = []

    def send(sig: int, skip: int | None = None) -> None:
        sent.append(sig)
        if sig == signal.SIGTERM:  # the others drain and exit 0
            for worker in workers:
                if worker.returncode is None:
                    worker.returncode = 0

    supervisor._send = send  # type: ignore[method-assign]
    return supervisor, sent


async def test_a_worker_that_drained_first_is_not_a_failure_before_its_signal_arrives() -> None:
    """The admin listener's drain: worker 0 asks (SIGUSR2) for the others to drain, drains
    and exits 0. Its exit may be seen before its signal is handled; it is the same
    request, and every worker drained cleanly: exit 0."""
    supervisor, sent = _supervisor(Worker(101, returncode=0), Worker(102))
    assert await supervisor.run() == 0
    assert sent == [signal.SIGTERM]  # the others were drained, once


@pytest.mark.parametrize("code", [1, -9])
async def test_a_worker_that_fails_drains_the_others_and_the_supervisor_fails(code: int) -> None:
    supervisor, sent = _supervisor(Worker(101), Worker(102, returncode=code))
    assert await supervisor.run() == 1
    assert sent == [signal.SIGTERM]


async def test_a_reload_applied_by_some_workers_only_drains_all_and_fails() -> None:
    """The workers would run two configurations (proxy.process.reload_rounds): never served on."""
    supervisor, sent = _supervisor(Worker(101), Worker(102))
    supervisor.on_split("generation 2 was applied by some workers but not by worker 1")
    assert sent == [signal.SIGTERM]
    assert await supervisor.run() == 1  # though every worker drained and exited 0
