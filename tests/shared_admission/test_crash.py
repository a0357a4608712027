"""A gateway process killed with SIGKILL: its slots come back within one lease TTL plus one
renewal interval, and not before its lease has expired."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

from proxy.admission.redis_backend import RedisAdmission, ReplicaView
from tests.redis_support import RedisServer, redis_server
from tests.shared_admission.conftest import seed_generation

__all__ = ["redis_server"]

HOLDER = """
import asyncio, sys
from proxy.admission.redis_backend import RedisAdmission, ReplicaView

async def main():
    store = RedisAdmission(sys.argv[1], gateway_id="doomed", lease_ttl_s=1.0)
    view = [ReplicaView("gpu0", 1)]
    assert (await store.acquire("tts", "doomed:1", view, 0))[0] == "admit"
    print("held", flush=True)
    while True:  # renews like a gateway, every 0.2 s
        await asyncio.sleep(0.2)
        await store.tick("tts", generation="seed", view=view, leases=[("doomed:1", "gpu0")],
                         waiters=[], guards=[], guard_ttl_s=1)

asyncio.run(main())
"""


async def test_slots_of_a_killed_gateway_return_after_its_lease_expires(
    redis_server: RedisServer,
) -> None:
    await seed_generation(redis_server.url)
    survivor = RedisAdmission(redis_server.url, gateway_id="survivor", lease_ttl_s=1.0)
    view = [ReplicaView("gpu0", 1)]
    # started last, so that nothing between its start and the try below can leave it running
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, redis_server.url,
        stdout=asyncio.subprocess.PIPE, cwd=os.getcwd(),
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        assert await holder.stdout.readline() == b"held\n"
        await asyncio.sleep(1.2)  # past one TTL: only renewals keep the lease alive
        assert await survivor.acquire("tts", "survivor:0", view, 0) == ("reject", "pool_full")
        holder.send_signal(signal.SIGKILL)
        await holder.wait()
        killed = time.monotonic()
        n = 0
        while (reply := await survivor.acquire("tts", f"survivor:{n}", view, 0))[0] != "admit":
            assert reply == ("reject", "pool_full")
            assert time.monotonic() - killed < 10, "the slot never came back"
            n += 1
            await asyncio.sleep(0.02)
        reclaim_s = time.monotonic() - killed
        # reported, not asserted on: the machine is shared (expected <= TTL + renewal)
        print(f"reclaim after SIGKILL: {reclaim_s:.2f} s (TTL 1.0 s, renewal 0.2 s)")
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()
        await survivor.close()
