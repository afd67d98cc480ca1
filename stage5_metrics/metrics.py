"""The Prometheus metrics of the server, served as text at ``GET /metrics``.

Every name starts with ``embedserve_`` and ends with its unit. Labels take a handful of
values each (route templates, status codes, three tiers, two cache tiers): never a text, a
request id or a client address, which would make a new time series per request.

Two kinds of metric, two costs:

* events the server sees are counted when they happen: once per request in plain integers
  (``RequestCounters``), once per batch in prometheus-client's own metrics, never per text;
* state the earlier stages already keep (queue depth, in-flight batches, stage 4's cache and
  rejection counters) is read only when Prometheus scrapes, by ``LiveCollector``: no work at
  all on the request path.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "embedserve"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_INFERENCE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass
class LiveState:
    """What ``LiveCollector`` reads at scrape time; the app fills in the functions."""

    queue_depth: Callable[[], int] = lambda: 0
    in_flight: Callable[[], int] = lambda: 0
    tier: Callable[[], str] = lambda: "low"
    # name -> (help, label name or "", {label value or "": count}); from stage 4's stats
    counters: Callable[[], dict[str, tuple[str, str, dict[str, float]]]] = dict
    info: dict[str, str] = field(default_factory=dict)


class LiveCollector(Collector):
    """Gauges and counters computed when scraped, from state the server keeps anyway."""

    def __init__(self, state: LiveState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        s = self.state
        yield GaugeMetricFamily(
            f"{PREFIX}_queue_depth_texts", "Texts waiting for the model now.", value=s.queue_depth()
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_batches_in_flight", "Batches inside the model now.", value=s.in_flight()
        )
        tier = GaugeMetricFamily(
            f"{PREFIX}_load_tier", "The batcher's load tier now (1 for the current one).", labels=["tier"]
        )
        current = s.tier()
        for name in ("low", "medium", "high"):
            tier.add_metric([name], 1.0 if name == current else 0.0)
        yield tier
        for name, (help_text, label, values) in s.counters().items():
            family = CounterMetricFamily(f"{PREFIX}_{name}", help_text, labels=[label] if label else None)
            for value_label, value in values.items():
                family.add_metric([value_label] if label else [], value)
            yield family
        if s.info:
            info = GaugeMetricFamily(
                f"{PREFIX}_model_info", "The served model (always 1).", labels=list(s.info)
            )
            info.add_metric(list(s.info.values()), 1.0)
            yield info


# --8<-- [start:requests]
class RequestCounters(Collector):
    """Per-request counters as plain integers, exposed when Prometheus scrapes.

    prometheus-client's ``Counter`` and ``Histogram`` take a lock on every update (they must be
    thread safe); per request, five of those cost more than a cache hit's whole answer. Here
    only the event loop's thread writes, and ``/metrics`` is read on that same thread, so plain
    integers are safe: an update is a dict lookup and an addition.
    """

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.latency: dict[str, list[int]] = {}  # route -> count per bucket, +Inf last
        self.latency_sum: dict[str, float] = {}
        self.queue = [0] * (len(_QUEUE_BUCKETS) + 1)
        self.queue_sum = 0.0
        self.texts = 0
        self.tokens = 0

    def observe(
        self,
        route: str,
        status: int,
        seconds: float,
        texts: int = 0,
        tokens: int = 0,
        queue_s: float | None = None,
    ) -> None:
        """One answered request; ``texts``, ``tokens`` and ``queue_s`` for the embedding routes."""
        self.texts += texts
        self.tokens += tokens
        if queue_s is not None:
            self.queue[bisect_left(_QUEUE_BUCKETS, queue_s)] += 1
            self.queue_sum += queue_s
        key = (route, status)
        self.requests[key] = self.requests.get(key, 0) + 1
        counts = self.latency.get(route)
        if counts is None:
            counts = self.latency[route] = [0] * (len(_LATENCY_BUCKETS) + 1)
            self.latency_sum[route] = 0.0
        counts[bisect_left(_LATENCY_BUCKETS, seconds)] += 1  # le: the first bound >= seconds
        self.latency_sum[route] += seconds

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            f"{PREFIX}_requests",
            "HTTP requests answered, by route and status code.",
            labels=["route", "status"],
        )
        for (route, status), n in sorted(self.requests.items()):
            requests.add_metric([route, str(status)], n)
        yield requests
        yield CounterMetricFamily(f"{PREFIX}_texts", "Texts embedded (in requests answered 200).", self.texts)
        yield CounterMetricFamily(
            f"{PREFIX}_tokens", "Tokens embedded, special tokens included.", self.tokens
        )
        latency = HistogramMetricFamily(
            f"{PREFIX}_request_duration_seconds", "Time from request to response, by route.", labels=["route"]
        )
        for route, counts in sorted(self.latency.items()):
            latency.add_metric([route], _cumulative(_LATENCY_BUCKETS, counts), self.latency_sum[route])
        yield latency
        queue = HistogramMetricFamily(
            f"{PREFIX}_queue_wait_seconds",
            "Time a request's texts waited for the model (requests that reached it).",
        )
        queue.add_metric([], _cumulative(_QUEUE_BUCKETS, self.queue), self.queue_sum)
        yield queue


def _cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    running = 0
    for bound, n in zip((*bounds, float("inf")), counts, strict=True):
        running += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    return out


# --8<-- [end:requests]


# --8<-- [start:metrics]
class Metrics:
    """One registry per app (no global state, so tests can build many apps in one process)."""

    def __init__(self, live: LiveState) -> None:
        # The `_created` twin of every counter doubles the series and Prometheus does not need it.
        disable_created_metrics()
        r = self.registry = CollectorRegistry()
        for default in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(default)  # process_*, python_info, python_gc_*: the client's defaults
        r.register(LiveCollector(live))
        self.requests = RequestCounters()  # once per request: plain integers
        r.register(self.requests)
        # Once per batch: prometheus-client's own metrics, whose lock costs nothing at this rate.
        self.inference = Histogram(
            f"{PREFIX}_batch_inference_seconds",
            "Model time per batch.",
            buckets=_INFERENCE_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            f"{PREFIX}_batch_size_texts", "Texts per batch.", buckets=_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            f"{PREFIX}_batch_tokens",
            "Padded tokens per batch (rows x longest row).",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.padding = Histogram(
            f"{PREFIX}_batch_padding_ratio",
            "Share of a batch's tokens that are padding.",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.batches = Counter(
            f"{PREFIX}_batches", "Batches run, by the load tier that formed them.", ["tier"], registry=r
        )
        self.batch_errors = Counter(f"{PREFIX}_batch_errors", "Batches whose model call raised.", registry=r)

    def observe_batch(
        self, size: int, padded: int, real: int, tier: str, seconds: float, failed: bool
    ) -> None:
        self.batches.labels(tier).inc()
        if failed:
            self.batch_errors.inc()
            return
        self.batch_size.observe(size)
        self.batch_tokens.observe(padded)
        self.padding.observe((padded - real) / padded if padded else 0.0)
        self.inference.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


# --8<-- [end:metrics]
