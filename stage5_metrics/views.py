"""The JSON of ``/v1/metrics`` and ``/v1/dashboard``: figures over a span, from two snapshots.

A count over a span is the difference of two cumulative values, a rate that count over the
span's seconds (Prometheus' ``increase()`` and ``rate()``), and a percentile is interpolated
inside the histogram bucket it falls in (``histogram_quantile()``), so it is as exact as the
buckets are narrow (``metrics.LATENCY_BUCKETS``).
"""

from __future__ import annotations

import math
from typing import Any

from stage5_metrics.stage_counts import TIERS
from stage5_metrics.window import Snapshot, Window


# --8<-- [start:quantile]
def quantile(a: dict[float, float], b: dict[float, float], q: float) -> float | None:
    """The q-quantile (0..1) of the observations between two snapshots of a histogram, in ms."""
    bounds = sorted(b)
    counts = [b[x] - a.get(x, 0.0) for x in bounds]  # cumulative: requests at or below each bound
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if math.isinf(bound):  # above the last bound: say the last bound, as Prometheus does
                return round(lower * 1e3, 3)
            return round((lower + (bound - lower) * (rank - below) / (count - below)) * 1e3, 3)
        lower, below = bound, count
    return None


# --8<-- [end:quantile]


class _Delta:
    """What happened between two snapshots."""

    def __init__(self, a: Snapshot, b: Snapshot) -> None:
        self.a, self.b = a, b
        self.seconds = max(b.at - a.at, 1e-3)

    def __call__(self, key: str) -> float:
        return self.b.values.get(key, 0.0) - self.a.values.get(key, 0.0)

    def statuses(self) -> dict[str, int]:
        found = {k.split()[1]: round(self(k)) for k in self.b.values if k.startswith("requests_total ")}
        return {status: n for status, n in sorted(found.items()) if n}

    def per_s(self, key: str) -> float:
        return round(self(key) / self.seconds, 2)

    def mean_ms(self, histogram: str) -> float | None:
        count = self(f"{histogram}_count")
        return round(self(f"{histogram}_sum") / count * 1e3, 3) if count else None

    def latency(self, q: float) -> float | None:
        return quantile(self.a.latency, self.b.latency, q)

    def cache(self) -> tuple[float, float]:
        """Texts found in either tier, and texts looked up (a Redis lookup follows a memory miss)."""
        hits = self("cache_hits_total memory") + self("cache_hits_total redis")
        return hits, self("cache_hits_total memory") + self("cache_misses_total memory")


def _ratio(part: float, whole: float, digits: int = 4) -> float | None:
    return round(part / whole, digits) if whole else None


def summary(a: Snapshot, b: Snapshot) -> dict[str, Any]:
    """Everything a person asks about a span: rates, latency, cache, batches, rejections, model time."""
    d = _Delta(a, b)
    statuses = d.statuses()
    requests = sum(statuses.values())
    hits, lookups = d.cache()
    batches = d("batch_size_texts_count")
    sizes = sorted(b.sizes)
    cumulative = [b.sizes[x] - a.sizes.get(x, 0.0) for x in sizes]
    spent, by_cache = d("batch_inference_seconds_sum"), d("cache_saved_model_seconds_total")
    return {
        "seconds": round(d.seconds, 1),
        "requests": requests,
        "requests_per_s": round(requests / d.seconds, 2),
        "texts": round(d("texts_total")),
        "texts_per_s": d.per_s("texts_total"),
        "tokens": round(d("tokens_total")),
        "statuses": statuses,
        "latency_ms": {
            "p50": d.latency(0.50),
            "p95": d.latency(0.95),
            "p99": d.latency(0.99),
            "mean": d.mean_ms("request_duration_seconds"),
        },
        "queue_ms_mean": d.mean_ms("queue_wait_seconds"),
        "cache": {
            "hits": round(hits),
            "misses": round(lookups - hits),
            "hit_rate": _ratio(hits, lookups),
            "deduplicated": round(d("deduplicated_texts_total")),
        },
        "batches": {
            "count": round(batches),
            "avg_size": _ratio(d("batch_size_texts_sum"), batches, 2),
            "size_distribution": {  # by bucket: one per size up to 32
                f"{bound:g}": round(n - before)
                for bound, n, before in zip(sizes, cumulative, [0.0, *cumulative], strict=False)
                if n - before
            },
            "tiers": {t: round(d(f"batches_total {t}")) for t in TIERS},
            "padding_ratio": _ratio(d("batch_padding_tokens_total"), d("batch_tokens_sum")),
            "inference_ms_mean": d.mean_ms("batch_inference_seconds"),
        },
        "rejections": {
            "overload": statuses.get("503", 0) + statuses.get("429", 0),
            "deadline": statuses.get("504", 0),
            "disconnect": round(d("rejected_requests_total disconnect")),
        },
        "savings": {
            "model_s_spent": round(spent, 3),
            "model_s_saved_by_cache": round(by_cache, 3),
            "saved_fraction": _ratio(by_cache, by_cache + spent),  # of what it would have spent without
        },
    }


def point(t: int, a: Snapshot, b: Snapshot) -> dict[str, Any]:
    """One point of the dashboard's charts: the step from ``a`` to ``b``."""
    d = _Delta(a, b)
    hits, lookups = d.cache()
    batches = d("batch_size_texts_count")
    return {
        "t": t,
        "seconds": round(d.seconds, 2),  # the step's length (the one under way is shorter)
        "requests_per_s": round(sum(d.statuses().values()) / d.seconds, 2),
        "texts_per_s": d.per_s("texts_total"),
        "p50_ms": d.latency(0.50),
        "p95_ms": d.latency(0.95),
        "p99_ms": d.latency(0.99),
        "hit_rate": _ratio(hits, lookups),
        "avg_batch": _ratio(d("batch_size_texts_sum"), batches, 2),
        "queue_depth_max": round(b.depth_max),
        "tiers": {tier: round(d(f"batches_total {tier}")) for tier in TIERS},
    }


def series(window: Window, seconds: int = 300) -> list[dict[str, Any]]:
    """A point per step over the last ``seconds`` (or since the start), oldest first."""
    return [point(t, a, b) for t, a, b in window.spans(seconds)]
