"""Streams the engine runs that Headroom did not admit (proxy/admission/reconcile.py), on a fake
clock with the in-process gate: the configuration's rules, the sustained difference,
the floors, the hold time, a reload, and what a refusal says. The end-to-end run
against a simulated engine is tests/integration/test_engine_reconcile.py."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.clock import FakeClock
from proxy.errors import ConfigError, Refused, refusal_for
from proxy.runtime import Runtime
from proxy.settings import Settings, settings_from_mapping


def _data(cap: int = 6, **pool: Any) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": False},
        "health": {"engine_metrics_interval_s": 5},
        "pools": [{
            "name": "main",
            "replicas": [{"name": "gpu0", "url": "http://127.0.0.1:9", "max_sessions": cap},
                         {"name": "gpu1", "url": "http://127.0.0.1:9", "max_sessions": cap}],
            "engine_reconcile": True, "engine_reconcile_hold_s": 30, **pool,
        }],
        "routes": [{"path": "/ws", "pool": "main", "protocol": "passthrough-ws"}],
    }  # fmt: skip


def _settings(cap: int = 6, **pool: Any) -> Settings:
    return settings_from_mapping(_data(cap, **pool), env={})


def _caps(rt: Runtime) -> dict[str, int]:
    return {r.name: r.cap for r in rt.gate.statistics()["main"].replicas}


def _scrape(rt: Runtime, gpu0: float | None, gpu1: float | None = 0.0) -> None:
    """One engine scrape, as Upstreams reports it: (waiting, running, KV) or None."""
    for replica, n in (("gpu0", gpu0), ("gpu1", gpu1)):
        rt._on_engine_scrape("main", replica, None if n is None else (1.0, n - 1.0, 0.5))


def test_reconcile_needs_engine_scraping_and_a_hold_past_two_scrapes() -> None:
    data = _data()
    data["health"] = {"engine_metrics_interval_s": 0}
    with pytest.raises(ConfigError, match=r"pools\[0\]\.engine_reconcile: needs the engine"):
        settings_from_mapping(data, env={})
    with pytest.raises(ConfigError, match="engine_reconcile_hold_s: must be more than two"):
        _settings(engine_reconcile_hold_s=10)
    assert _settings(engine_reconcile_hold_s=10.5).pools[0].engine_reconcile
    off = _settings(engine_reconcile=False, engine_reconcile_hold_s=1)
    assert not off.pools[0].engine_reconcile


def test_a_sustained_difference_takes_slots_and_a_lower_one_gives_them_back() -> None:
    clock = FakeClock()
    rt = Runtime(_settings(), clock=clock)
    _scrape(rt, 3)  # one scrape is not sustained
    assert _caps(rt) == {"gpu0": 6, "gpu1": 6}
    assert rt.reconcile.unadmitted("main", "gpu0") == 3
    _scrape(rt, 2)
    assert _caps(rt) == {"gpu0": 4, "gpu1": 6}  # the smaller of the two
    _scrape(rt, 5)
    assert _caps(rt)["gpu0"] == 4  # min(2, 5)
    _scrape(rt, 5)
    assert _caps(rt)["gpu0"] == 1  # 6 - 5
    _scrape(rt, 0)
    assert _caps(rt)["gpu0"] == 6  # back at the first scrape without them


def test_the_cap_falls_to_one_at_most_and_never_ends_a_running_session() -> None:
    rt = Runtime(_settings(), clock=FakeClock())
    leases = [rt.gate.enter("main") for _ in range(6)]  # 3 on each replica
    assert {lease.replica for lease in leases} == {"gpu0", "gpu1"}  # type: ignore[union-attr]
    # gpu0 runs its 3 sessions and 5 more; gpu1 its 3 and 20 more.
    _scrape(rt, 8, 23)
    _scrape(rt, 8, 23)
    assert rt.reconcile.taken("main", "gpu0") == 5 and _caps(rt) == {"gpu0": 1, "gpu1": 1}
    assert rt.gate.active == 6  # nothing evicted
    # A session that ends is not replaced while the other streams run: the cap is not
    # floored at the sessions held (that floor would hand each freed slot out again).
    leases[0].release()  # type: ignore[union-attr]
    with pytest.raises(Refused) as refused:
        rt.gate.enter("main")
    assert refused.value.reason == "pool_full"
    for lease in leases[1:]:
        lease.release()  # type: ignore[union-attr]
    lease = rt.gate.enter("main")  # below the cap of 1 again: one session
    assert not isinstance(lease, Refused)
    lease.release()  # type: ignore[union-attr]


def test_without_a_confirming_scrape_the_reduction_lapses_after_the_hold_time() -> None:
    clock = FakeClock()
    rt = Runtime(_settings(), clock=clock)
    _scrape(rt, 4)
    _scrape(rt, 4)
    assert _caps(rt)["gpu0"] == 2
    _scrape(rt, None)  # one failed scrape between two that agree: the slots stay taken
    _scrape(rt, 4)
    assert _caps(rt)["gpu0"] == 2
    clock.advance(29)
    _scrape(rt, None)  # the page failed: the metric goes, the reduction stays for now
    assert rt.reconcile.unadmitted("main", "gpu0") is None and _caps(rt)["gpu0"] == 2
    clock.advance(1)
    assert _caps(rt)["gpu0"] == 6
    _scrape(rt, 4)  # sustained again only after two scrapes
    assert _caps(rt)["gpu0"] == 6


def test_a_reload_keeps_the_reduction_and_switching_it_off_restores_the_cap() -> None:
    rt = Runtime(_settings(), clock=FakeClock())
    _scrape(rt, 2)
    _scrape(rt, 2)
    assert _caps(rt)["gpu0"] == 4
    rt.apply(_settings(cap=8))  # a reload does not hand out the held slots
    assert _caps(rt) == {"gpu0": 6, "gpu1": 8}
    rt.apply(_settings(cap=8, engine_reconcile=False))
    assert _caps(rt) == {"gpu0": 8, "gpu1": 8}
    _scrape(rt, 3)
    _scrape(rt, 3)
    assert _caps(rt)["gpu0"] == 8  # off: shown, not applied
    assert rt.reconcile.unadmitted("main", "gpu0") == 3


def test_a_capacity_refusal_says_why_and_keeps_its_reason() -> None:
    rt = Runtime(_settings(), clock=FakeClock())
    full = refusal_for("pool_full", retry_after_s=3, pool="main")
    assert rt.explain_refusal(full) is full  # nothing taken: unchanged
    _scrape(rt, 2)
    _scrape(rt, 2)
    explained = rt.explain_refusal(full)
    assert isinstance(explained, Refused) and type(explained) is type(full)
    assert explained.reason == "pool_full" and explained.retry_after_s == full.retry_after_s
    assert explained.message.startswith(full.message)
    assert "The engine runs streams Headroom did not admit" in explained.message
    assert "(2 on gpu0)" in explained.message
    assert explained.body()["error"]["code"] == "pool_full"
    draining = refusal_for("draining", retry_after_s=1, pool="main")
    assert rt.explain_refusal(draining) is draining


def test_headroom_check_says_which_pools_reconcile() -> None:
    from proxy.settings.summary import summary

    assert "engine_reconcile: streams the engine runs" in summary(_settings())
    assert "lapsing 30 s after" in summary(_settings())
    assert "engine_reconcile" not in summary(_settings(engine_reconcile=False))
