"""Reload rounds over the control channels of ``serve --workers`` (proxy.process.worker_control),
with workers in this process: every worker applies a file or none does."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from proxy.errors import ConfigError
from proxy.process import worker_control
from proxy.process.reload_rounds import ReloadRounds
from proxy.process.worker_control import (
    MAX_MESSAGE_BYTES,
    Channel,
    WorkerControl,
    read_start,
    start_frame,
)
from proxy.settings.loading import MAX_CONFIG_BYTES


class Target:
    """A worker's gateway: validates by ``refuse`` / applies by ``fail``, and records."""

    def __init__(self, refuse: bool = False, fail: bool = False) -> None:
        self.refuse, self.fail = refuse, fail
        self.validated: list[str] = []
        self.applied: list[Any] = []

    def validate_reload(self, text: str, source: str) -> Any:
        self.validated.append(text)
        if self.refuse:
            raise ConfigError([("pools[0].replicas[0].max_sessions", "must be >= 1")])
        return ("settings", text)

    def apply_reload(self, settings: Any) -> list[str]:
        if self.fail:
            raise RuntimeError("boom")
        self.applied.append(settings)
        return ["pool main: updated"]


class Set:
    def __init__(self, rounds: ReloadRounds) -> None:
        self.rounds = rounds
        self.controls: list[WorkerControl] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.silent: list[socket.socket] = []
        self.splits: list[str] = []

    def add(self, target: Target | None) -> None:
        """A worker; ``None``: one whose loop never answers (its end is read by nobody)."""
        index = len(self.controls) + len(self.silent)
        ours, theirs = socket.socketpair()
        self.rounds.add(index, 1000 + index, ours)
        if target is None:
            self.silent.append(theirs)
            return
        control = WorkerControl(target, theirs, index, f"host-{1000 + index}-abc")
        self.controls.append(control)
        self.tasks.append(asyncio.ensure_future(control.run()))


@pytest.fixture
async def workers(tmp_path: Path) -> AsyncIterator[Set]:
    path = tmp_path / "headroom.yaml"
    path.write_text("pools: []\n")
    holder: list[Set] = []
    rounds = ReloadRounds(
        str(path), draining=lambda: False, on_split=lambda m: holder[0].splits.append(m),
        deadline_s=0.5,
    )  # fmt: skip
    made = Set(rounds)
    holder.append(made)
    yield made
    await rounds.close()
    for task in made.tasks:
        task.cancel()
    await asyncio.gather(*made.tasks, return_exceptions=True)
    for control in made.controls:
        control.channel.close()
    for sock in made.silent:
        sock.close()


async def test_every_worker_applies_the_same_text_and_the_answer_lists_them(workers: Set) -> None:
    a, b = Target(), Target()
    workers.add(a)
    workers.add(b)
    answer = await workers.rounds.reload("test")
    assert answer.status == 200, answer.body
    assert answer.body["generation"] == 1
    assert a.applied == b.applied == [("settings", "pools: []\n")]
    views = answer.body["workers"]
    seen = [(w["index"], w["applied"], w["generation"]) for w in views]
    assert seen == [(0, True, 1), (1, True, 1)]
    assert views[1]["gateway"] == "host-1001-abc"
    assert {w["config_sha256"] for w in views} == {answer.body["config_sha256"]}
    assert [c.generation for c in workers.controls] == [1, 1]


async def test_a_worker_refusing_the_file_leaves_every_worker_as_it_was(workers: Set) -> None:
    a, b = Target(), Target(refuse=True)
    workers.add(a)
    workers.add(b)
    answer = await workers.rounds.reload("test")
    assert answer.status == 503  # not every worker refused: they disagree on the file
    assert "worker 1 (pid 1001)" in answer.body["error"]["message"]
    assert a.validated and not a.applied and not b.applied
    assert [w["applied"] for w in answer.body["workers"]] == [False, False]
    # the next round starts from the same generation: nothing moved
    b.refuse = False
    assert (await workers.rounds.reload("test")).body["generation"] == 1


async def test_a_file_every_worker_refuses_is_answered_400_with_its_problems(
    workers: Set,
) -> None:
    workers.add(Target(refuse=True))
    workers.add(Target(refuse=True))
    answer = await workers.rounds.reload("test")
    assert answer.status == 400
    assert answer.body["problems"] == [
        {"field": "pools[0].replicas[0].max_sessions", "reason": "must be >= 1"}
    ]


async def test_a_worker_that_does_not_answer_means_nothing_is_applied(workers: Set) -> None:
    a = Target()
    workers.add(a)
    workers.add(None)
    answer = await workers.rounds.reload("test")
    assert answer.status == 503
    assert "worker 1 (pid 1001): did not answer within 0.5 s" in answer.body["error"]["message"]
    assert a.validated and not a.applied
    assert workers.controls[0].generation == 0


async def test_a_worker_failing_to_apply_what_the_others_applied_ends_the_set(
    workers: Set,
) -> None:
    a, b = Target(), Target(fail=True)
    workers.add(a)
    workers.add(b)
    answer = await workers.rounds.reload("test")
    assert answer.status == 500
    assert answer.body["error"]["type"] == "workers_disagree"
    assert [w["applied"] for w in answer.body["workers"]] == [True, False]
    assert "applying failed" in answer.body["workers"][1]["reason"]
    (split,) = workers.splits
    assert "worker 1 (pid 1001)" in split and "draining every worker" in split


async def test_a_worker_asks_and_gets_the_answer_of_the_round(workers: Set) -> None:
    a, b = Target(), Target()
    workers.add(a)
    workers.add(b)
    answer = await workers.controls[0].request_reload()
    assert answer.status == 200
    assert [w["pid"] for w in answer.body["workers"]] == [1000, 1001]
    assert a.applied and b.applied


async def test_a_file_cut_short_reaches_no_worker(workers: Set, tmp_path: Path) -> None:
    a = Target()
    workers.add(a)
    (tmp_path / "headroom.yaml").write_text("pools: []\nroutes: [")
    answer = await workers.rounds.reload("test")
    assert answer.status == 400
    assert "does not end with a newline" in answer.body["problems"][0]["reason"]
    assert not a.validated


async def test_a_fault_while_validating_is_an_answer_and_the_channel_lives_on(
    workers: Set,
) -> None:
    a, b = Target(), Target()
    workers.add(a)
    workers.add(b)
    b.validate_reload = lambda text, source: 1 / 0  # type: ignore[method-assign]
    answer = await workers.rounds.reload("test")
    assert answer.status == 503
    assert "validating failed: ZeroDivisionError" in answer.body["error"]["message"]
    assert not a.applied
    del b.validate_reload  # the class's again
    assert (await workers.rounds.reload("test")).status == 200
    assert a.applied and b.applied


def test_a_worker_reads_its_start_text_and_nothing_after_it() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(start_frame("pools: []\n") + b'{"op": "prepare"}\n')
        assert read_start(theirs) == "pools: []\n"
        assert theirs.recv(100) == b'{"op": "prepare"}\n'  # left for the channel


def test_a_start_text_cut_short_is_a_config_error() -> None:
    ours, theirs = socket.socketpair()
    with theirs:
        with ours:
            ours.sendall(start_frame("pools: []\n")[:-3])
        with pytest.raises(ConfigError, match="sent no configuration"):
            read_start(theirs)


async def test_a_late_answer_to_an_aborted_round_is_not_taken_for_the_next(
    workers: Set,
) -> None:
    """Worker 1 answers round 1 after its deadline, while round 2 (the same generation,
    since round 1 applied nothing) waits: that late yes must not count as its answer to
    round 2, which it refuses."""
    late = threading.Event()
    a, b = Target(), Target()
    answers = a.validate_reload

    def a_validates(text: str, source: str) -> Any:
        if len(a.validated) == 1:  # round 2 is out: now let worker 1 answer round 1
            late.set()
        return answers(text, source)

    def b_validates(text: str, source: str) -> Any:
        b.validated.append(text)
        if len(b.validated) == 1:
            late.wait(30)
            return ("settings", text)
        raise ConfigError([("pools", "refused the second time")])

    a.validate_reload = a_validates  # type: ignore[method-assign]
    b.validate_reload = b_validates  # type: ignore[method-assign]
    workers.add(a)
    workers.add(b)
    first = await workers.rounds.reload("test")
    assert first.status == 503 and "did not answer" in first.body["error"]["message"]
    second = await workers.rounds.reload("test")
    assert second.status == 503, second.body
    assert "refused the second time" in second.body["error"]["message"]
    assert not a.applied and not b.applied and not workers.splits


async def test_a_line_longer_than_any_message_closes_the_channel() -> None:
    ours, theirs = socket.socketpair()
    channel = Channel(theirs)
    await channel.open()
    pad = "a" * (3 * MAX_CONFIG_BYTES)
    writer = asyncio.ensure_future(asyncio.to_thread(ours.sendall, f'{{"pad":"{pad}"}}\n'.encode()))
    try:
        assert await channel.receive() is None
    finally:
        ours.close()
        await asyncio.gather(writer, return_exceptions=True)
        channel.close()


async def test_the_largest_file_of_quotes_reaches_every_worker_parsed_off_the_loop(
    workers: Set, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[int] = []

    def decode(line: bytes) -> Any:
        threads.append(threading.get_ident())
        return json.loads(line)

    monkeypatch.setattr(worker_control, "_decode", decode)
    line = '# "\\' * 255 + "\t\n"  # every character but the '#' and spaces escapes to two
    text = line * (MAX_CONFIG_BYTES // len(line))
    (tmp_path / "headroom.yaml").write_text(text)
    a = Target()
    workers.add(a)
    answer = await workers.rounds.reload("test")
    assert answer.status == 200, answer.body
    assert a.applied == [("settings", text)]
    assert any(t != threading.get_ident() for t in threads)  # the prepare line


async def test_a_file_that_escapes_past_the_channel_is_refused_before_any_worker_sees_it(
    workers: Set, tmp_path: Path
) -> None:
    a = Target()
    workers.add(a)
    (tmp_path / "headroom.yaml").write_text("# " + "\x01" * (MAX_CONFIG_BYTES // 2) + "\n")
    answer = await workers.rounds.reload("test")
    assert answer.status == 400
    assert "control characters" in answer.body["problems"][0]["reason"]
    assert not a.validated


async def test_a_reply_too_large_for_the_channel_is_a_failure_and_the_channel_lives_on(
    workers: Set,
) -> None:
    a, b = Target(), Target()
    huge = ["pool main: " + "x" * 1024] * (MAX_MESSAGE_BYTES // 1024)
    b.apply_reload = lambda settings: huge  # type: ignore[method-assign]
    workers.add(a)
    workers.add(b)
    answer = await workers.rounds.reload("test")
    assert answer.status == 500
    assert answer.body["error"]["type"] == "workers_disagree"
    assert f"over {MAX_MESSAGE_BYTES} bytes" in answer.body["workers"][1]["reason"]
    del b.apply_reload  # the class's again
    assert (await workers.rounds.reload("test")).status == 200


async def test_a_reason_with_a_lone_surrogate_crosses_the_channel() -> None:
    ours, theirs = socket.socketpair()
    sender, receiver = Channel(ours), Channel(theirs)
    await sender.open()
    await receiver.open()
    try:
        sender.send({"op": "prepared", "reason": "bad \udc80 name é"})
        assert await receiver.receive() == {"op": "prepared", "reason": "bad \udc80 name é"}
    finally:
        sender.close()
        receiver.close()
