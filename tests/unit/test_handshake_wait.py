"""``queue.max_handshake_wait_s``: the setting's contract and the pool core's bound on one
waiter (the relay's use of it: tests/integration/test_ws_handshake_wait.py)."""

from __future__ import annotations

import pytest

from proxy.admission import PoolCore
from proxy.admission.decisions import Enqueue, QueuePolicy, Reject, ReplicaSpec
from proxy.settings import QueueSettings
from proxy.settings.topology import HANDSHAKE_WAIT_S
from tests.unit.test_settings import has, load, problems, valid


def queue_of(data: dict[str, object]) -> QueueSettings:
    return load(data).pool("tts-main").queue


def test_the_default_is_5_s_or_max_wait_s_if_that_is_shorter() -> None:
    data = valid()
    assert queue_of(data).max_handshake_wait_s is None
    assert queue_of(data).handshake_wait_s == HANDSHAKE_WAIT_S == 5
    data["pools"][0]["queue"] = {"max_depth": 4, "max_wait_s": 3}
    assert queue_of(data).handshake_wait_s == 3
    data["pools"][0]["queue"] = {"max_depth": 4, "max_wait_s": 10, "max_handshake_wait_s": 0}
    assert queue_of(data).handshake_wait_s == 0


def test_a_handshake_wait_longer_than_max_wait_s_fails_naming_the_field() -> None:
    data = valid()
    data["pools"][0]["queue"] = {"max_depth": 4, "max_wait_s": 5, "max_handshake_wait_s": 8}
    found = problems(data)
    assert has(found, "pools[0].queue.max_handshake_wait_s", "longer than max_wait_s (5 s)")


def test_a_malformed_handshake_wait_fails_naming_the_field() -> None:
    data = valid()
    data["pools"][0]["queue"]["max_handshake_wait_s"] = -1
    assert has(problems(data), "pools[0].queue.max_handshake_wait_s", ">= 0")
    data["pools"][0]["queue"]["max_handshake_wait_s"] = "soon"
    assert has(problems(data), "pools[0].queue.max_handshake_wait_s", "number")


def test_the_environment_sets_it_and_the_same_check_applies() -> None:
    env = {"HEADROOM_POOLS__0__QUEUE__MAX_HANDSHAKE_WAIT_S": "2.5"}
    assert load(valid(), env).pool("tts-main").queue.handshake_wait_s == 2.5
    env = {"HEADROOM_POOLS__0__QUEUE__MAX_HANDSHAKE_WAIT_S": "11"}
    assert has(problems(valid(), env), "pools[0].queue.max_handshake_wait_s", "max_wait_s")
    # A pool without a queue section, given a short max_wait_s from the environment:
    # the unset handshake wait follows it down rather than failing.
    env = {"HEADROOM_POOLS__1__QUEUE__MAX_WAIT_S": "2"}
    assert load(valid(), env).pool("asr-main").queue.handshake_wait_s == 2


def full_core(max_wait_s: float = 10) -> PoolCore:
    core = PoolCore("tts", [ReplicaSpec("gpu0", 1)], QueuePolicy(4, max_wait_s))
    core.arrive(0.0)  # the one slot
    return core


def test_a_waiters_own_bound_sets_its_deadline_and_it_is_refused_queue_timeout() -> None:
    core = full_core()
    plain = core.arrive(1.0)
    bounded = core.arrive(1.0, max_wait_s=4)
    longer = core.arrive(1.0, max_wait_s=60)  # never past the pool's
    assert isinstance(plain, Enqueue) and isinstance(bounded, Enqueue)
    assert isinstance(longer, Enqueue)
    assert (plain.deadline, bounded.deadline, longer.deadline) == (11.0, 5.0, 11.0)
    assert core.next_deadline() == 5.0
    assert core.expire(4.9) == []
    (refused,) = core.expire(5.0)
    assert (refused.ticket, refused.reason, refused.queue_position) == (
        bounded.ticket, "queue_timeout", 2,
    )  # fmt: skip
    assert refused.retry_after_s >= 1
    assert core.waiting(5.0) == [plain.ticket, longer.ticket]


@pytest.mark.parametrize(("pool_wait", "own"), [(10, 0), (0, 5)])
def test_no_wait_at_all_refuses_at_once_as_a_pool_without_a_queue(
    pool_wait: float, own: float
) -> None:
    decision = full_core(pool_wait).arrive(1.0, max_wait_s=own)
    assert isinstance(decision, Reject) and decision.reason == "pool_full"
