"""The one counting system: a Prometheus registry per app, served as text at ``GET /metrics``.

Every figure stage 5 shows comes from this registry: ``/metrics`` renders it for Prometheus,
and ``window.py`` reads its running totals for ``/v1/metrics``, ``/v1/dashboard`` and the page.

Every name starts with ``embedserve_`` and ends with its unit. Labels take a handful of
values each (route templates, status codes, three tiers, two cache tiers): never a text, a
request id or a client address, which would make a new time series per request.

Events are counted when they happen, with prometheus-client's ``Counter`` and ``Histogram``:
once per request and once per batch, never once per text. What the earlier stages count
anyway is read only when collected (``stage_counts.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
)
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from stage5_metrics.stage_counts import PREFIX, TIERS, StageCountsCollector

T = TypeVar("T", bound=Collector)
EMBED_ROUTES = frozenset({"/v1/embed", "/v1/embeddings"})  # the traffic the JSON views count
STATIC_ROUTE = "/dashboard/static"  # the page's files: one label for all of them

# Latency buckets about 1.5x apart, so the dashboard's percentiles (interpolated inside a
# bucket, as Prometheus' histogram_quantile does) come out within a fraction of a bucket.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02,
                   0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)  # fmt: skip
_QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_INFERENCE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# One bucket per size up to 32 (MAX_BATCH_SIZE's default), so the size chart shows each size.
_SIZE_BUCKETS = (*range(1, 33), 48, 64, 128, 256)
_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


# --8<-- [start:metrics]
class Metrics:
    """One registry per app (no global state, so tests can build many apps in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        for default in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(default)  # process_*, python_info, python_gc_*: the client's defaults
        self.earlier_stages = StageCountsCollector()  # stages 3 and 4's own counts, read when collected
        r.register(self.earlier_stages)

        self._own: list[Collector] = [self.earlier_stages]  # what the window samples

        def own(metric: T) -> T:
            self._own.append(metric)
            return metric

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return own(Counter(f"{PREFIX}_{name}", doc, labels, registry=r))

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
            return own(Histogram(f"{PREFIX}_{name}", doc, labels, buckets=buckets, registry=r))

        # Once per request, by the middleware.
        self.requests = counter(
            "requests", "HTTP requests answered, by route and status code.", "route", "status"
        )
        self.duration = histogram(
            "request_duration_seconds", "Time from request to response, by route.", LATENCY_BUCKETS, "route"
        )
        # Once per embedding request, from the backend's typed result.
        self.texts = counter("texts", "Texts embedded (in requests answered 200).")
        self.tokens = counter("tokens", "Tokens embedded, special tokens included.")
        self.queue_wait = histogram(
            "queue_wait_seconds",
            "Time a request's texts waited for the model (requests that reached it).",
            _QUEUE_BUCKETS,
        )
        # Once per batch, from stage 3's batch record.
        self.batches = counter("batches", "Batches run, by the load tier that formed them.", "tier")
        self.batch_errors = counter("batch_errors", "Batches whose model call raised.")
        self.batch_size = histogram("batch_size_texts", "Texts per batch.", _SIZE_BUCKETS)
        self.batch_tokens = histogram(
            "batch_tokens", "Padded tokens per batch (rows x longest row).", _TOKEN_BUCKETS
        )
        self.padding = histogram(
            "batch_padding_ratio", "Share of a batch's tokens that are padding.", _RATIO_BUCKETS
        )
        self.padding_tokens = counter(
            "batch_padding_tokens", "Padding tokens the model computed, summed over batches."
        )
        self.inference = histogram("batch_inference_seconds", "Model time per batch.", _INFERENCE_BUCKETS)
        # An estimate, the one figure here that is not a count (savings.py says how it is made).
        self.cache_saved = counter(
            "cache_saved_model_seconds",
            "Model time the cache saved: each hit priced as a model call of its own (overhead + tokens).",
        )
        for tier in TIERS:  # known label values start at 0, so a rate over them starts at once
            self.batches.labels(tier)

    # --8<-- [end:metrics]

    # --8<-- [start:requests]
    # --8<-- [start:observe]
    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, status).inc()
        self.duration.labels(route).observe(seconds)

    # --8<-- [end:observe]

    def observe_result(self, texts: int, tokens: int, queue_s: float | None, saved_by_cache_s: float) -> None:
        self.texts.inc(texts)
        self.tokens.inc(tokens)
        if queue_s is not None:  # None: the request never reached the queue (all cache hits)
            self.queue_wait.observe(queue_s)
        if saved_by_cache_s:
            self.cache_saved.inc(saved_by_cache_s)

    # --8<-- [end:requests]

    def observe_batch(
        self, size: int, padded: int, real: int, tier: str, seconds: float, failed: bool
    ) -> None:
        self.batches.labels(tier or "none").inc()  # none: BATCHER=textbook, one window for every batch
        if failed:
            self.batch_errors.inc()
        self.batch_size.observe(size)
        self.batch_tokens.observe(padded)
        self.padding.observe((padded - real) / padded if padded else 0.0)
        self.padding_tokens.inc(padded - real)
        self.inference.observe(seconds)

    def own_families(self) -> Iterator[Metric]:
        """This app's ``embedserve_*`` families only (not the process collectors): what the window samples."""
        for collector in self._own:
            yield from collector.collect()
