"""The gateway's side of its upstream replicas, apart from the sessions themselves: the
HTTP client the relays share, the start-up reachability check of every replica, the
health re-checks of ejected ones, and the scraping of each engine's own figures.

Engine scraping cannot die: every replica is scraped by its own task, each scrape is
bounded in size (:data:`ENGINE_METRICS_MAX_BYTES`) and time
(:data:`ENGINE_METRICS_TIMEOUT_S`, on the injected clock), so a slow or huge page holds
up only its own replica. A page that fails, or whose figures are not finite numbers,
leaves the replica without figures for that scrape; it is counted
(``headroom_engine_scrape_errors_total{pool, replica, reason}``) and logged once per
replica and reason until the replica answers again. A listener that raises is logged and
counted the same way, and the scrape goes on. A scrape task that ends any other way than
by a reload or :meth:`Upstreams.stop` (killed, or a bug) is logged and started again
after one interval. ``headroom_engine_figures_age_seconds`` shows how old each replica's
figures are, so a replica whose figures stop coming is seen.

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
import math
from collections.abc import Callable, Coroutine
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from proxy.clock import Clock, clock_timeout
from proxy.relay.failover import Unreachable, open_tcp
from proxy.settings import Settings

if TYPE_CHECKING:
    from proxy.metering.series import Metrics

__all__ = [
    "ENGINE_METRICS_MAX_BYTES",
    "ENGINE_METRICS_PARSE_INLINE_BYTES",
    "ENGINE_METRICS_TIMEOUT_S",
    "ENGINE_SCRAPE_ERROR_REASONS",
    "EngineFigures",
    "EnginePageError",
    "HealthTarget",
    "NoEngineFigures",
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

#: The longest one replica's scrape (connect, read and parse) may take, on the gateway's
#: clock; past it the scrape is abandoned (reason ``timeout``). A page that dribbles in
#: never trips a per-read timeout, so the bound is on the whole scrape.
ENGINE_METRICS_TIMEOUT_S = 2.0

#: The ``reason`` label of ``headroom_engine_scrape_errors_total``: the page took longer
#: than :data:`ENGINE_METRICS_TIMEOUT_S`; the connection failed; the page was over
#: :data:`ENGINE_METRICS_MAX_BYTES`; it was not Prometheus text; an engine figure on it was
#: NaN or infinite; a scrape listener raised; anything else (logged with its traceback).
ENGINE_SCRAPE_ERROR_REASONS = (
    "timeout", "unreachable", "too_large", "unparseable", "not_finite", "listener", "error",
)  # fmt: skip

_ENGINE_NAMES = {
    "vllm:num_requests_waiting": 0,
    "vllm:num_requests_running": 1,
    "vllm:kv_cache_usage_perc": 2,
}


class NoEngineFigures(ValueError):
    """A page without vLLM figures: an engine that exports none (not an error)."""


class EnginePageError(ValueError):
    """An engine page whose figures cannot be used; ``reason`` is one of
    :data:`ENGINE_SCRAPE_ERROR_REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def parse_engine_metrics(text: str) -> EngineFigures:
    """(waiting, running, KV usage 0..1) from a vLLM ``/metrics`` page, summed over
    label sets (one engine may report per model). Raises :class:`NoEngineFigures` if
    none is there, :class:`EnginePageError` (``not_finite``) if one is NaN or infinite,
    and ValueError if the page is not Prometheus text."""
    values = [0.0, 0.0, 0.0]
    seen = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            index = _ENGINE_NAMES.get(sample.name)
            if index is not None:
                if not math.isfinite(sample.value):
                    raise EnginePageError(
                        "not_finite", f"{sample.name} is {sample.value}, not a finite number"
                    )
                values[index] += sample.value
                seen = True
    if not seen:
        raise NoEngineFigures("no vLLM engine metrics on that page")
    return values[0], values[1], values[2]


def _too_large(url: str, what: str) -> EnginePageError:
    """The error for an engine page over :data:`ENGINE_METRICS_MAX_BYTES`."""
    return EnginePageError(
        "too_large",
        f"engine metrics page {url} {what} (limit {ENGINE_METRICS_MAX_BYTES})",
    )


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
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self._gate = gate
        #: The HTTP transport (None: httpx's own); tests inject one.
        self._transport = transport
        self._urls: dict[tuple[str, str], tuple[str, str]] = {}
        #: Each replica's latest engine figures (absent: not scraped, or not a vLLM page).
        self.engine: dict[tuple[str, str], EngineFigures] = {}
        #: When (on :attr:`clock`) each replica's scrape last gave figures.
        self._figures_at: dict[tuple[str, str], float] = {}
        #: Called after each replica's scrape with its figures (None: none this time).
        self._scrape_listeners: list[Callable[[str, str, EngineFigures | None], None]] = []
        #: (pool, replica, reason) already logged; a scrape with figures clears its own.
        self._reported: set[tuple[str, str, str]] = set()
        #: Set once the start-up reachability check of every replica has finished.
        self.replicas_checked = asyncio.Event()
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._rechecks: dict[tuple[str, str], asyncio.Task[None]] = {}
        #: Each configured replica's scrape loop, while scraping is on.
        self._scrapers: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._metrics = metrics
        if metrics is not None:
            metrics.bind_engine_scrape(self.figure_ages)
        self.started = False
        self.apply(settings)
        gate.on_health_change(self._on_health_change)

    def apply(self, settings: Settings) -> None:
        """Take a (reloaded) configuration: replicas' URLs, intervals, timeouts. A
        replica that left keeps its URLs (its running sessions may still need them), and
        its scraping stops with its figures. Scraping turned on by a reload starts now
        (a replica added, its own loop); turned off, each loop ends after its pass."""
        self.settings = settings
        for pool in settings.pools:
            for r in pool.replicas:
                self._urls[(pool.name, r.name)] = (r.url, r.ws_url)
        wanted = set(self._replica_keys())
        for key in set(self._scrapers) - wanted:
            self._scrapers.pop(key).cancel()
        for key in set(self.engine) | set(self._figures_at):
            if key not in wanted:
                self.engine.pop(key, None)
                self._figures_at.pop(key, None)
        if self.started:
            self._start_scraping()

    def _replica_keys(self) -> list[tuple[str, str]]:
        return [(pool.name, r.name) for pool in self.settings.pools for r in pool.replicas]

    def _start_scraping(self) -> None:
        if self.settings.health.engine_metrics_interval_s <= 0:
            return
        for key in self._replica_keys():
            if key not in self._scrapers:
                self._start_scraper(key, delay=0.0)

    def _start_scraper(self, key: tuple[str, str], *, delay: float) -> None:
        task = self._spawn(self._scrape_loop(key, delay))
        self._scrapers[key] = task
        task.add_done_callback(partial(self._scraper_ended, key))

    def _scraper_ended(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        """The supervisor: a replica's scrape loop that ended otherwise than by a reload
        (scraping off, the replica gone) or :meth:`stop` is logged and started again
        after one interval."""
        if self._scrapers.get(key) is not task:
            return  # the replica left, or its loop was replaced
        del self._scrapers[key]
        if task.cancelled():
            error: BaseException | None = None
            what = "was cancelled"
        else:
            error = task.exception()
            if error is None:
                return  # scraping turned off by a reload
            what = f"failed ({error!r})"
        interval = self.settings.health.engine_metrics_interval_s
        if not self.started or interval <= 0:
            return
        log.error(
            "the engine scrape of replica %s/%s %s; it starts again in %g s",
            key[0], key[1], what, interval, exc_info=error,
        )  # fmt: skip
        self._start_scraper(key, delay=interval)

    def on_scrape(self, listener: Callable[[str, str, EngineFigures | None], None]) -> None:
        """Call ``listener(pool, replica, figures or None)`` after each replica's scrape."""
        self._scrape_listeners.append(listener)

    def ws_url(self, pool: str, replica: str) -> str:
        """The replica's WebSocket base URL; raises KeyError for a replica not configured."""
        return self._urls[(pool, replica)][1]

    def http_url(self, pool: str, replica: str) -> str:
        """The replica's HTTP base URL; raises KeyError for a replica not configured."""
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
        """Whether any replica's engine scrape loop is running."""
        return any(not task.done() for task in self._scrapers.values())

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

    async def _scrape_loop(self, key: tuple[str, str], delay: float) -> None:
        """Every ``health.engine_metrics_interval_s`` (after ``delay``): scrape one
        replica's engine figures, so dashboards can show the engine's queue (near zero)
        beside the listeners' gaps (not). Ends when the interval is set to 0 by a
        reload."""
        if delay > 0:
            await _sleep(self.clock, delay)
        while True:
            interval = self.settings.health.engine_metrics_interval_s
            if interval <= 0:
                return
            await self.scrape_replica(*key)
            await _sleep(self.clock, interval)

    async def scrape_once(self) -> None:
        """One scrape of every configured replica, side by side."""
        await asyncio.gather(*(self.scrape_replica(*key) for key in self._replica_keys()))

    async def scrape_replica(self, pool: str, replica: str) -> None:
        """One scrape of the replica's page, within :data:`ENGINE_METRICS_TIMEOUT_S` and
        :data:`ENGINE_METRICS_MAX_BYTES`. A page that fails, is not a vLLM page or has a
        figure that is not finite removes the replica's figures (a stale queue is worse
        than none); every failure but the one of a page without vLLM figures is counted.
        Raises nothing but the cancellation of the calling task."""
        key = (pool, replica)
        url = self.http_url(pool, replica) + "/metrics"
        figures: EngineFigures | None = None
        try:
            async with clock_timeout(self.clock, ENGINE_METRICS_TIMEOUT_S):
                body = await self._read_metrics(url)
                if len(body) > ENGINE_METRICS_PARSE_INLINE_BYTES:
                    figures = await asyncio.to_thread(parse_engine_metrics, body)
                else:
                    figures = parse_engine_metrics(body)
        except NoEngineFigures:
            pass
        except EnginePageError as exc:
            self._scrape_error(key, exc.reason, str(exc))
        except (TimeoutError, httpx.TimeoutException):
            self._scrape_error(
                key, "timeout", f"{url} gave no whole page within {ENGINE_METRICS_TIMEOUT_S:g} s"
            )
        except httpx.HTTPError as exc:
            self._scrape_error(key, "unreachable", f"{url}: {exc!r}")
        except ValueError as exc:
            self._scrape_error(key, "unparseable", f"{url} is not Prometheus text: {exc}")
        except Exception as exc:
            self._scrape_error(key, "error", f"{url}: {exc!r}", exc)
        if figures is None:
            self.engine.pop(key, None)
        else:
            self.engine[key] = figures
            self._figures_at[key] = self.clock.now()
            self._reported = {r for r in self._reported if r[:2] != key or r[2] == "listener"}
        self._scraped(pool, replica, figures)

    def figure_ages(self) -> list[tuple[str, str, float]]:
        """(pool, replica, seconds since its scrape last gave figures) of each configured
        replica that has given figures, while scraping is on."""
        if self.settings.health.engine_metrics_interval_s <= 0:
            return []
        now = self.clock.now()
        return [
            (pool, replica, max(0.0, now - at))
            for (pool, replica) in self._replica_keys()
            if (at := self._figures_at.get((pool, replica))) is not None
        ]

    def _scrape_error(
        self, key: tuple[str, str], reason: str, message: str, exc: BaseException | None = None
    ) -> None:
        """Count a failed scrape; log it once per replica and reason until the replica
        gives figures again (a listener's error: once per replica; ``exc``: logged with
        its traceback)."""
        pool, replica = key
        if self._metrics is not None:
            self._metrics.child(self._metrics.engine_scrape_errors, pool, replica, reason).inc()
        if (pool, replica, reason) in self._reported:
            return
        self._reported.add((pool, replica, reason))
        if reason == "listener":
            outcome = "the scrape goes on; logged once for this replica"
        else:
            outcome = "its figures are dropped; logged once until it gives figures again"
        log.warning(
            "engine scrape of replica %s/%s (%s): %s; %s", pool, replica, reason, message,
            outcome, exc_info=exc,
        )  # fmt: skip

    async def _read_metrics(self, url: str) -> str:
        """The body of ``url`` as text, read up to :data:`ENGINE_METRICS_MAX_BYTES`;
        raises :class:`EnginePageError` (after closing the response unread) past it."""
        # identity: the bound is on the page itself, never on a compressed form of it
        headers = {"accept-encoding": "identity"}
        timeout = ENGINE_METRICS_TIMEOUT_S
        async with self.http.stream("GET", url, headers=headers, timeout=timeout) as response:
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
        """Tell every listener; one that raises is counted and logged, and the others
        are still told."""
        for listener in self._scrape_listeners:
            try:
                listener(pool, replica, figures)
            except Exception as exc:
                self._scrape_error(
                    (pool, replica), "listener", f"scrape listener {listener!r} raised", exc
                )
