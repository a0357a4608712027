"""The gateway's side of its upstream replicas, apart from the sessions themselves: the
HTTP client the relays share, the start-up reachability check of every replica, the
health re-checks of ejected ones, and the scraping of each engine's own figures.

:class:`Upstreams` is owned by :class:`~proxy.runtime.Runtime` (started and stopped
with it) and talks to admission through two calls only (:class:`HealthTarget`): it is
told when a replica is ejected (``on_health_change``) and restores it
(``set_healthy``). Every wait runs on the injected clock (:mod:`proxy.clock`), so the
re-check and scrape loops are tested without sleeping (``tests/unit/test_upstreams.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from proxy.clock import Clock
from proxy.relay.failover import Unreachable, open_tcp
from proxy.settings import Settings

__all__ = [
    "ENGINE_METRICS_MAX_BYTES",
    "ENGINE_METRICS_PARSE_INLINE_BYTES",
    "EngineFigures",
    "HealthTarget",
    "Upstreams",
    "parse_engine_metrics",
]

log = logging.getLogger("headroom.upstreams")

#: (waiting, running, KV cache usage 0..1) of one engine, from its ``/metrics`` page.
EngineFigures = tuple[float, float, float]

#: The largest engine ``/metrics`` body read: past it the scrape stops reading, logs a
#: warning and counts the replica as having no figures. A vLLM page is histograms and
#: gauges per served model; this leaves room for many models while bounding memory.
ENGINE_METRICS_MAX_BYTES = 4 * 1024 * 1024

#: Bodies up to this size are parsed on the event loop; larger ones in a worker thread
#: (:func:`asyncio.to_thread`), so a long page never stalls the sessions' relays.
ENGINE_METRICS_PARSE_INLINE_BYTES = 64 * 1024

_ENGINE_NAMES = {
    "vllm:num_requests_waiting": 0,
    "vllm:num_requests_running": 1,
    "vllm:kv_cache_usage_perc": 2,
}


def parse_engine_metrics(text: str) -> EngineFigures:
    """(waiting, running, KV usage 0..1) from a vLLM ``/metrics`` page, summed over
    label sets (one engine may report per model). Raises ValueError if none is there."""
    values = [0.0, 0.0, 0.0]
    seen = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            index = _ENGINE_NAMES.get(sample.name)
            if index is not None:
                values[index] += sample.value
                seen = True
    if not seen:
        raise ValueError("no vLLM engine metrics on that page")
    return values[0], values[1], values[2]


def _too_large(url: str, what: str) -> ValueError:
    """Log an engine page over :data:`ENGINE_METRICS_MAX_BYTES`; the error to raise."""
    log.warning(
        "engine metrics page %s %s (limit %d); its figures are dropped",
        url, what, ENGINE_METRICS_MAX_BYTES,
    )  # fmt: skip
    return ValueError(f"engine metrics page {url} {what}")


class HealthTarget(Protocol):
    """What :class:`Upstreams` needs from the gate (in-process or shared)."""

    def set_healthy(self, pool: str, replica: str, healthy: bool) -> None: ...

    def on_health_change(self, listener: Callable[[str, str, bool], None]) -> None: ...


async def _sleep(clock: Clock, seconds: float) -> None:
    """``asyncio.sleep`` on ``clock`` (a fake clock's test moves it)."""
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake() -> None:
        if not future.done():
            future.set_result(None)

    handle = clock.call_at(clock.now() + seconds, wake)
    try:
        await future
    finally:
        handle.cancel()


class Upstreams:
    """The replicas' URLs, the shared upstream HTTP client, health checks and engine
    scraping of one gateway. :meth:`apply` takes a reloaded configuration."""

    def __init__(
        self,
        settings: Settings,
        gate: HealthTarget,
        clock: Clock,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self._gate = gate
        #: The HTTP transport (None: httpx's own); tests inject one.
        self._transport = transport
        self._urls: dict[tuple[str, str], tuple[str, str]] = {}
        #: Each replica's latest engine figures (absent: not scraped, or not a vLLM page).
        self.engine: dict[tuple[str, str], EngineFigures] = {}
        #: Called after each replica's scrape with its figures (None: none this time).
        self._scrape_listeners: list[Callable[[str, str, EngineFigures | None], None]] = []
        #: Set once the start-up reachability check of every replica has finished.
        self.replicas_checked = asyncio.Event()
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._rechecks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._scraper: asyncio.Task[None] | None = None
        self.started = False
        self.apply(settings)
        gate.on_health_change(self._on_health_change)

    def apply(self, settings: Settings) -> None:
        """Take a (reloaded) configuration: replicas' URLs, intervals, timeouts. A
        replica that left keeps its URLs (its running sessions may still need them).
        Scraping turned on by a reload starts now; turned off, it ends after its pass."""
        self.settings = settings
        for pool in settings.pools:
            for r in pool.replicas:
                self._urls[(pool.name, r.name)] = (r.url, r.ws_url)
        if self.started:
            self._start_scraping()

    def _start_scraping(self) -> None:
        if self.settings.health.engine_metrics_interval_s > 0 and (
            self._scraper is None or self._scraper.done()
        ):
            self._scraper = self._spawn(self.scrape_engines())

    def on_scrape(self, listener: Callable[[str, str, EngineFigures | None], None]) -> None:
        """Call ``listener(pool, replica, figures or None)`` after each replica's scrape."""
        self._scrape_listeners.append(listener)

    def ws_url(self, pool: str, replica: str) -> str:
        return self._urls[(pool, replica)][1]

    def http_url(self, pool: str, replica: str) -> str:
        return self._urls[(pool, replica)][0]

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Open the HTTP client; check every replica and start scraping (in the
        background: start-up is never blocked on an upstream)."""
        limits = self.settings.limits
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=limits.upstream_connect_timeout_s,
                read=limits.idle_timeout_s or None,
                write=limits.idle_timeout_s or None,
                pool=limits.upstream_connect_timeout_s,
            ),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            follow_redirects=False,
            trust_env=False,
            transport=self._transport,
        )
        self.started = True
        self._spawn(self.check_replicas())
        self._start_scraping()

    async def stop(self) -> None:
        """Cancel the checks, re-checks and scraping, then close the HTTP client."""
        self.started = False
        tasks = list(self._rechecks.values()) + list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def http(self) -> httpx.AsyncClient:
        """The upstream HTTP client (HTTP sessions, health re-checks, scraping)."""
        if self._client is None:
            raise RuntimeError("upstreams not started")
        return self._client

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- health -------------------------------------------------------------------------

    async def check_replicas(self) -> None:
        """At start-up, before any client can fail on them: eject every replica whose
        TCP port refuses or does not accept within ``limits.upstream_connect_timeout_s``
        (the same test a session's connect makes; the re-check restores it). Runs beside
        start-up, never blocking it; ``/readyz`` waits for :attr:`replicas_checked`."""
        try:
            checks = [
                self.check_replica(pool.name, r.name, r.url)
                for pool in self.settings.pools
                for r in pool.replicas
            ]
            reachable = await asyncio.gather(*checks)
        finally:
            self.replicas_checked.set()
        log.info("replicas checked at start-up: %d of %d reachable", sum(reachable),
                 len(reachable))  # fmt: skip

    async def check_replica(self, pool: str, replica: str, url: str) -> bool:
        """Whether the replica's TCP port accepted (if not, it is ejected)."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        timeout = self.settings.limits.upstream_connect_timeout_s
        try:
            sock = await open_tcp(host, port, clock=self.clock, timeout=timeout)
        except Unreachable as exc:
            log.warning(
                "replica %s/%s is unreachable at start-up (%s:%d: %s): ejected until its "
                "health check answers", pool, replica, host, port, exc,
            )  # fmt: skip
            with contextlib.suppress(LookupError):  # removed by a reload meanwhile
                self._gate.set_healthy(pool, replica, False)
            return False
        sock.close()
        return True

    def _on_health_change(self, pool: str, replica: str, healthy: bool) -> None:
        key = (pool, replica)
        if not healthy and key not in self._rechecks and self.started:
            task = asyncio.ensure_future(self.recheck(pool, replica))
            self._rechecks[key] = task
            task.add_done_callback(lambda _t: self._rechecks.pop(key, None))

    @property
    def scraping(self) -> bool:
        """Whether the engine scraping loop is running."""
        return self._scraper is not None and not self._scraper.done()

    @property
    def rechecking(self) -> list[tuple[str, str]]:
        """The ejected replicas being re-checked."""
        return list(self._rechecks)

    async def recheck(self, pool: str, replica: str) -> None:
        """Probe an ejected replica's ``/health`` every ``health.recheck_interval_s``
        until it answers below 500, then restore it. The interval and the URL are read
        for each probe, so a reload applies to the next one."""
        while True:
            interval = self.settings.health.recheck_interval_s
            await _sleep(self.clock, interval)
            url = self.http_url(pool, replica) + "/health"  # a reload may move it
            try:
                response = await self.http.get(url, timeout=min(interval, 5.0))
            except Exception as exc:
                # httpx errors, and whatever else the HTTP stack raises while a
                # connection is reset under it (the chaos soak found one): the probe
                # must outlive them all, or the replica would stay ejected for good.
                log.info("replica %s/%s still unreachable: %r", pool, replica, exc)
                continue
            if response.status_code < 500:
                self._gate.set_healthy(pool, replica, True)
                return

    # -- engine metrics -------------------------------------------------------------------

    async def scrape_engines(self) -> None:
        """Every ``health.engine_metrics_interval_s``: re-export each replica's own vLLM
        figures, so dashboards can show the engine's queue (near zero) beside the
        listeners' gaps (not). Stops when the interval is set to 0 by a reload."""
        while True:
            interval = self.settings.health.engine_metrics_interval_s
            if interval <= 0:
                return
            await self.scrape_once()
            await _sleep(self.clock, interval)

    async def scrape_once(self) -> None:
        """One pass over every configured replica; a page that fails or has no vLLM
        figures removes the replica's figures (a stale queue is worse than none)."""
        for pool in self.settings.pools:
            for r in pool.replicas:
                try:
                    body = await self._read_metrics(r.url + "/metrics")
                    if len(body) > ENGINE_METRICS_PARSE_INLINE_BYTES:
                        figures = await asyncio.to_thread(parse_engine_metrics, body)
                    else:
                        figures = parse_engine_metrics(body)
                except (httpx.HTTPError, ValueError):
                    self.engine.pop((pool.name, r.name), None)
                    self._scraped(pool.name, r.name, None)
                    continue
                self.engine[(pool.name, r.name)] = figures
                self._scraped(pool.name, r.name, figures)

    async def _read_metrics(self, url: str) -> str:
        """The body of ``url`` as text, read up to :data:`ENGINE_METRICS_MAX_BYTES`;
        raises ValueError (after closing the response unread) past it."""
        # identity: the bound is on the page itself, never on a compressed form of it
        headers = {"accept-encoding": "identity"}
        async with self.http.stream("GET", url, headers=headers, timeout=2.0) as response:
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > ENGINE_METRICS_MAX_BYTES:
                raise _too_large(url, f"declares {declared} bytes")
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > ENGINE_METRICS_MAX_BYTES:
                    raise _too_large(url, f"is longer than {ENGINE_METRICS_MAX_BYTES} bytes")
                chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", errors="replace")

    def _scraped(self, pool: str, replica: str, figures: EngineFigures | None) -> None:
        for listener in self._scrape_listeners:
            listener(pool, replica, figures)
