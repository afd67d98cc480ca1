"""What the earlier stages count anyway, as Prometheus families, read only when collected.

Queue depth, batches in flight, the load tier and all of stage 4's counters (cache hits and
misses by tier, Redis errors, evictions, de-duplicated texts, rejections) already exist in
stages 3 and 4. ``StageCountsCollector`` reads them, as one ``StageCounts``, when Prometheus
scrapes or the window samples (once a second) and turns them into gauges and counters, instead
of mirroring every increment: no work on the request path. The app reads them
(``MetricsBackend.stage_counts`` in ``app.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "embedserve"
TIERS = ("low", "medium", "high")


@dataclass
class StageCounts:
    """What the earlier stages count, right now; the app takes it (zeros before the model loads)."""

    queue_depth: int = 0
    in_flight: int = 0
    tier: str = "low"
    active: int = 0  # requests inside the backend
    max_queue: int = 0
    cache_hits: dict[str, int] = field(default_factory=lambda: {"memory": 0, "redis": 0})
    cache_misses: dict[str, int] = field(default_factory=lambda: {"memory": 0, "redis": 0})
    cache_errors: dict[str, int] = field(default_factory=lambda: {"timeout": 0})
    cache_evictions: int = 0
    cache_expirations: int = 0
    deduplicated: int = 0
    rejected: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("overload", "deadline", "disconnect"), 0)
    )
    dropped_texts: int = 0
    slot_busy_s: dict[str, float] = field(default_factory=dict)  # model slot -> seconds computing
    info: dict[str, str] = field(default_factory=dict)


def _counter(
    name: str, doc: str, label: str, values: dict[str, int] | dict[str, float] | int
) -> CounterMetricFamily:
    family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=[label] if label else None)
    for value_label, value in values.items() if isinstance(values, dict) else [("", values)]:
        family.add_metric([value_label] if label else [], value)
    return family


class StageCountsCollector(Collector):
    """Gauges and counters computed when collected, from what the earlier stages count anyway."""

    def __init__(self) -> None:
        self.source: Callable[[], StageCounts] = StageCounts  # the app points it at its backend

    def collect(self) -> Iterator[Metric]:
        s = self.source()
        yield GaugeMetricFamily(
            f"{PREFIX}_queue_depth_texts", "Texts waiting for the model now.", s.queue_depth
        )
        yield GaugeMetricFamily(f"{PREFIX}_batches_in_flight", "Batches inside the model now.", s.in_flight)
        tier = GaugeMetricFamily(
            f"{PREFIX}_load_tier", "The batcher's load tier now (1 for the current one).", labels=["tier"]
        )
        for name in TIERS:
            tier.add_metric([name], 1.0 if name == s.tier else 0.0)
        yield tier
        for name, doc, label, values in (
            ("cache_hits", "Texts found in the cache, by tier.", "tier", s.cache_hits),
            ("cache_misses", "Texts not found in the cache, by tier.", "tier", s.cache_misses),
            ("cache_errors", "Redis lookups or writes that failed, by kind (the request was still answered).",
             "kind", s.cache_errors),
            ("cache_evictions", "Memory entries pushed out by CACHE_MAX_ITEMS or CACHE_MAX_BYTES.", "",
             s.cache_evictions),
            ("cache_expirations", "Memory entries found past CACHE_TTL_S.", "", s.cache_expirations),
            ("deduplicated_texts", "Texts answered by another request's computation (single-flight).", "",
             s.deduplicated),
            ("rejected_requests", "Requests refused or dropped: overload (queue full), deadline (504), "
             "disconnect (client left).", "reason", s.rejected),
            ("dropped_texts", "Queued texts skipped before the model (caller cancelled or deadline passed).",
             "", s.dropped_texts),
            ("model_slot_busy_seconds", "Seconds each model slot spent computing; its rate is the slot's "
             "utilisation (1.0: never idle).", "slot", s.slot_busy_s),
        ):  # fmt: skip
            yield _counter(name, doc, label, values)
        if s.info:
            info = GaugeMetricFamily(
                f"{PREFIX}_model_info", "The served model (always 1).", labels=list(s.info)
            )
            info.add_metric(list(s.info.values()), 1.0)
            yield info
