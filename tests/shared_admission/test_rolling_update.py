"""A rolling update on the shared backend: the old gateway drains with live sessions while
a new one starts on the same Redis; the new one admits only into slots that are free."""

from __future__ import annotations

import asyncio

import pytest

from proxy.errors import DrainingRefused, Refused
from tests.shared_admission.conftest import Backend, eventually


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
async def test_new_gateway_admits_only_into_slots_the_draining_one_frees(
    backend: Backend,
) -> None:
    old = await backend.gate(caps=(2, 1), depth=0)
    live = [await old.acquire("tts") for _ in range(3)]  # every slot of the pool
    old.drain()
    with pytest.raises(DrainingRefused):
        await old.acquire("tts")
    new = await backend.gate(caps=(2, 1), depth=0)
    with pytest.raises(Refused) as info:
        await new.acquire("tts")
    assert info.value.reason == "pool_full"  # the draining gateway's sessions still count
    await old.renew()  # the old gateway keeps renewing its leases while it drains
    with pytest.raises(Refused):
        await new.acquire("tts")
    idle = asyncio.create_task(old.wait_idle())
    live[1].release()  # one session on gpu1 ends
    await backend.settle()
    taken = await new.acquire("tts")
    assert taken.replica == live[1].replica
    with pytest.raises(Refused):
        await new.acquire("tts")
    for lease in (live[0], live[2]):
        lease.release()
    await asyncio.wait_for(idle, 5)
    await backend.settle()
    more = [await new.acquire("tts") for _ in range(2)]
    with pytest.raises(Refused):
        await new.acquire("tts")
    for lease in [taken, *more]:
        lease.release()
    await eventually(lambda: new.active == 0)
