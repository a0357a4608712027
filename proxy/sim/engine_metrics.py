"""vLLM's Prometheus metrics, as a simulated GPU reports them on ``/metrics``.

Names and labels follow vLLM (``model_name``, ``engine``): gauges are read from the
engine at scrape time, so they are always the truth; latency histograms are fed from
each engine :class:`~proxy.sim.engine.Step`. Inter-token latency is observed once per
step with the batch size as weight (every sequence in the step waited that long),
which keeps the per-step cost O(1).

A page can be made to lie or to crawl, as a broken engine or exporter would
(:attr:`EngineMetrics.page`, set by ``POST /sim/metrics_page``): ``nan`` reports
``vllm:num_requests_running`` as NaN, ``slow`` sends the page one byte every
``drip_s`` seconds and never ends it while the mode lasts.
"""

from __future__ import annotations

import re
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from proxy.sim.engine import Engine, Step

__all__ = ["PAGE_MODES", "EngineMetrics", "WeightedHistogram"]

#: What ``/metrics`` serves: the truth, a NaN in-flight figure, or a dripping page.
PAGE_MODES = ("honest", "nan", "slow")
_RUNNING = re.compile(rb"^(vllm:num_requests_running(?:\{[^}]*\})?) \S+$", re.MULTILINE)

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_WS_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class WeightedHistogram:
    """A histogram accepting ``observe(value, count)``; exposed by a collector."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.doc = doc
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        if count > 0:
            self.counts[bisect_left(self.bounds, value)] += count
            self.total += value * count

    def family(self, labels: dict[str, str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.doc, labels=list(labels))
        cumulative = []
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            cumulative.append(("+Inf" if bound == float("inf") else repr(bound), running))
        family.add_metric(list(labels.values()), cumulative, self.total)
        return family


class _EngineCollector(Collector):
    def __init__(self, owner: EngineMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        o = self._owner
        stats = o.engine.stats()
        keys, values = list(o.labels), list(o.labels.values())
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             stats.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             stats.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             stats.kv_usage),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, doc, labels=keys)
            gauge.add_metric(values, value)
            yield gauge
        for name, doc, total in (
            ("vllm:generation_tokens", "Number of generation tokens processed.",
             stats.tokens_generated),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
            ("vllm:num_preemptions", "Cumulative number of preemptions.", stats.preemptions),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=keys)
            counter.add_metric(values, total)
            yield counter
        for hist in (o.ttft, o.itl, o.queue_time, o.e2e):
            yield hist.family(o.labels)


class EngineMetrics:
    """The metrics of one simulated GPU, in their own registry."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        #: One of :data:`PAGE_MODES`; ``drip_s``: the seconds between a slow page's bytes.
        self.page = "honest"
        self.drip_s = 1.5
        self.labels = {"model_name": model_name, "engine": "0"}
        self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = WeightedHistogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = WeightedHistogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )  # fmt: skip
        self.queue_time = WeightedHistogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", _REQUEST_BUCKETS,
        )  # fmt: skip
        self.e2e = WeightedHistogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            _REQUEST_BUCKETS,
        )  # fmt: skip
        self.registry.register(_EngineCollector(self))
        self.ws_active = Gauge(
            "vllm:websocket_connections_active",
            "Number of currently active WebSocket connections.",
            registry=self.registry,
        )
        self.ws_total = Counter(
            "vllm:websocket_connections",
            "Total number of WebSocket connections.",
            registry=self.registry,
        )
        self.ws_duration = Histogram(
            "vllm:websocket_connection_duration_seconds",
            "Duration of WebSocket connections in seconds.",
            buckets=_WS_BUCKETS,
            registry=self.registry,
        )

    def render(self) -> bytes:
        """The page as the mode has it (a ``slow`` page's whole text: the app drips it)."""
        body = generate_latest(self.registry)
        if self.page == "nan":
            body = _RUNNING.sub(rb"\1 NaN", body)
        return body

    def on_step(self, step: Step) -> None:
        """Feed one engine step (called by the runner)."""
        if step.batch:
            # Sequences on their first token report TTFT instead of an ITL.
            self.itl.observe(step.duration, step.batch - len(step.first_tokens))
        for _, seconds in step.first_tokens:
            self.ttft.observe(seconds)
        for _, seconds in step.queue_times:
            self.queue_time.observe(seconds)
        for _, seconds in step.finished:
            self.e2e.observe(seconds)

    def websocket_opened(self) -> float:
        self.ws_active.inc()
        self.ws_total.inc()
        return time.monotonic()

    def websocket_closed(self, opened_at: float) -> None:
        self.ws_active.dec()
        self.ws_duration.observe(time.monotonic() - opened_at)
