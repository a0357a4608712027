"""Shared fixtures: real servers on 127.0.0.1 port 0."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from proxy.app import create_app
from proxy.clock import Clock
from proxy.process.gateway import uvicorn_options
from proxy.process.serving import RunningServer, running_server
from proxy.runtime import Runtime
from proxy.settings import Settings, settings_from_mapping
from tests import hypothesis_profiles

#: Every test's result is reported under its name, even when building its report fails;
#: a test marked ``alone`` has the machine to itself.
pytest_plugins = ("tests.report_guard", "tests.machine_share")

#: "ci" (full example counts) under CI, "dev" (a quarter) otherwise: see the module.
HYPOTHESIS_PROFILE = hypothesis_profiles.load()


def pytest_report_header() -> str:
    return f"hypothesis examples: {HYPOTHESIS_PROFILE} profile (tests/hypothesis_profiles.py)"


class Proxy:
    def __init__(self, server: RunningServer, runtime: Runtime) -> None:
        self.server = server
        self.runtime = runtime

    @property
    def http_url(self) -> str:
        return self.server.http_url

    @property
    def ws_url(self) -> str:
        return self.server.ws_url

    @property
    def gate(self) -> Any:
        return self.runtime.gate

    def metric(self, name: str, **labels: str) -> float:
        value = self.runtime.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def proxy_settings(
    replicas: list[tuple[str, str, int]],
    routes: list[dict[str, Any]],
    *,
    queue: dict[str, Any] | None = None,
    **top: Any,
) -> Settings:
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": False},
        # With the admin listener off, tests scrape /metrics on the client listener; the
        # default (admin listener only) is tested in tests/integration/test_metrics_listener.py
        "metrics": {"client_port": True},
        "pools": [
            {
                "name": "main",
                "replicas": [{"name": n, "url": u, "max_sessions": c} for n, u, c in replicas],
                "queue": queue or {"max_depth": 0, "max_wait_s": 10},
                "fallback": {"voice": "lite-1", "pool": None, "url": None},
            }
        ],
        "routes": routes,
    }
    data.update(top)
    return settings_from_mapping(data, env={})


@pytest.fixture
async def start_proxy() -> AsyncIterator[Callable[[Settings], Any]]:
    """Start a Headroom proxy for given settings; on teardown, check no slot leaked."""
    stack = contextlib.AsyncExitStack()
    proxies: list[Proxy] = []

    async def start(settings: Settings, clock: Clock | None = None, **uvicorn: Any) -> Proxy:
        """``uvicorn``: options over Headroom's own (e.g. ``ws=`` another protocol)."""
        runtime = Runtime(settings, clock=clock)
        app = create_app(runtime)
        server = await stack.enter_async_context(
            running_server(app, **{**uvicorn_options(settings, app), **uvicorn})
        )
        proxy = Proxy(server, runtime)
        proxies.append(proxy)
        # The start-up reachability check runs beside start-up; a test starts from
        # its outcome (a dead replica already ejected), not from a race with it.
        await asyncio.wait_for(runtime.replicas_checked.wait(), 30)
        return proxy

    async with stack:
        yield start
    for proxy in proxies:
        assert proxy.gate.active == 0, f"leaked slots: {proxy.gate!r}"
        assert proxy.gate.queued == 0, f"queue not empty: {proxy.gate!r}"


#: Tests that start processes, soak, fuzz or measure: marked ``slow`` so
#: ``pytest -m "not slow"`` is a quick inner loop (README, "Tests"). CI runs all. Each
#: entry is a directory, a module or one test (its node id without parameters).
SLOW = (
    "tests/bench/",  # benchmarks: real load for seconds
    "tests/probe/test_e2e.py",  # the probe against a simulator process, end to end
    "tests/chaos/test_soak_short.py",  # a soak under injected faults
    "tests/fuzz/",  # fuzz campaigns, live stacks included
    "tests/sim/test_validate.py",  # the capacity model against simulated runs
    "tests/sim/test_colocation.py",  # co-located engines under load
    "tests/shared_admission/test_workers.py",  # gateway worker processes
    "tests/shared_admission/test_worker_reload.py",  # reloads of gateway worker processes
    # reservations claimed on either of `headroom serve --workers 2`'s workers:
    "tests/shared_admission/test_gateway_reservations.py::test_reserve_then_claim_on_any_worker",
    "tests/shared_admission/test_crash.py",  # gateway processes killed mid-session
    # `headroom serve` processes, one per busy listener:
    "tests/integration/test_operations.py::test_busy_port_fails_with_one_line_naming_the_address",
    # the whole ASR demo (simulated GPU, gateway, capacity model) served and queried:
    "tests/integration/test_demo.py::test_every_route_the_asr_demo_banner_lists_is_served",
    # a `python -m proxy.sim` process, served and stopped by SIGINT:
    "tests/sim/test_cli.py::test_serve_prints_one_url_per_gpu_serves_and_stops_on_sigint",
    # the SageMaker entrypoint's processes (Headroom and a stand-in engine):
    "tests/deploy/test_deploy_sagemaker.py::test_sigterm_drains_headroom_before_stopping_vllm",
    "tests/deploy/test_deploy_sagemaker.py::test_engine_batch_follows_the_cap_including_env",
    "tests/deploy/test_deploy_sagemaker.py::test_engine_exit_stops_headroom_and_fails",
    "tests/deploy/test_deploy_sagemaker.py::test_invalid_config_stops_before_starting_anything",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
