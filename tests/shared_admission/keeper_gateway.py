"""A gateway process for the keeper tests: ``python -m tests.shared_admission.keeper_gateway
URL CAP TTL RENEW MARGIN process|thread``.

It takes every slot of pool ``tts`` (one replica, ``CAP`` slots) on the shared gate
with the chosen lease keeper, prints ``ready <keeper pid or 0>``, then obeys one command
a line on stdin:

* ``gil SECONDS`` -- libc ``sleep`` called through :class:`ctypes.PyDLL`, which keeps
  the GIL for the whole call (no thread of this process runs), then ``stalled <s>``;
* ``check`` -- lets the loop run the overdue timers and one tick, then
  ``fenced <count>`` (sessions the gate would have cut);
* ``exit`` -- releases the leases and stops the gate.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
import time

from proxy.admission import QueuePolicy, ReplicaSpec
from proxy.admission.keeper_process import KeeperConfig, ProcessKeeper
from proxy.admission.lease_keeper import Keeper, LeaseKeeper
from proxy.admission.redis_backend import RedisAdmission
from proxy.admission.shared_gate import SharedGate, SharedPoolSpec
from proxy.clock import LoopClock


def hold_the_gil(seconds: int) -> None:
    """A C call that never releases the GIL: PyDLL calls keep it held."""
    libc = ctypes.PyDLL(None)
    libc.sleep(ctypes.c_uint(seconds))


async def main(url: str, cap: int, ttl: float, renew: float, margin: float, kind: str) -> None:
    backend = RedisAdmission(url, gateway_id="gwa", lease_ttl_s=ttl, timeout_s=0.5)
    keeper: Keeper
    if kind == "process":
        keeper = ProcessKeeper(KeeperConfig(url, "headroom:", ttl, 0.5, renew, margin))
    else:
        renewer = backend.lease_renewer()
        keeper = LeaseKeeper(renewer.keep, interval_s=renew, close=renewer.close)
    pool = SharedPoolSpec("tts", (ReplicaSpec("gpu0", cap),), QueuePolicy(0, 1))
    gate = SharedGate([pool], backend=backend, clock=LoopClock(), lease_ttl_s=ttl,
                      renew_interval_s=renew, fence_margin_s=margin, keeper=keeper)  # fmt: skip
    fenced: list[str] = []
    gate.on_fence(lambda pool, why: fenced.append(why))
    await gate.start()
    leases = [await gate.acquire("tts") for _ in range(cap)]
    await gate.renew()
    if isinstance(keeper, ProcessKeeper):
        for _ in range(2000):
            if keeper.running():
                break
            await asyncio.sleep(0.01)
        else:
            raise RuntimeError("the keeper process did not start")
    pid = keeper.pid if isinstance(keeper, ProcessKeeper) else 0
    print(f"ready {pid}", flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
        if not line or line[0] == "exit":
            break
        if line[0] == "gil":
            started = time.monotonic()
            hold_the_gil(int(line[1]))
            print(f"stalled {time.monotonic() - started:.3f}", flush=True)
        elif line[0] == "check":
            await asyncio.sleep(margin + renew)  # overdue fence timers, then a tick
            await gate.renew()
            print(f"fenced {len(fenced)}", flush=True)
    for lease in leases:
        lease.release()
    await gate.stop()


if __name__ == "__main__":
    u, c, t, r, m, k = sys.argv[1:7]
    asyncio.run(main(u, int(c), float(t), float(r), float(m), k))
