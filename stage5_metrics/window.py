"""Statistics for people: the last minute and since start, from per-second slots.

Prometheus keeps cumulative counters and leaves "per minute" to the server that scrapes
it. ``/v1/metrics``, ``/v1/dashboard`` and the dashboard page have no such server, so this
module keeps one slot per second for the last ``keep_s`` seconds and folds older slots into
one running total. Recording is a few integer additions; the work (merging, percentiles)
happens when someone asks, every few seconds at most.

Latency percentiles come from log-spaced buckets 10 % wide, so they are exact to within
10 % and two windows merge by adding counts (an average of percentiles would be wrong).
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

# Upper bounds in ms: 0.05 ms .. ~200 s, each 10 % above the last.
_BOUNDS: list[float] = [0.05 * 1.1**i for i in range(160)]
_LAST = len(_BOUNDS) - 1
TIERS = ("low", "medium", "high")


def bucket_of(ms: float) -> int:
    return min(bisect_left(_BOUNDS, ms), _LAST)


def percentile(histogram: dict[int, int], q: float) -> float | None:
    """The q-quantile (0..1) of a bucket histogram, as the bucket's upper bound in ms."""
    total = sum(histogram.values())
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for index in sorted(histogram):
        seen += histogram[index]
        if seen >= rank:
            return round(_BOUNDS[index], 3)
    return round(_BOUNDS[max(histogram)], 3)


@dataclass(slots=True)
class Slot:
    """Everything counted in one second (or, merged, in any span)."""

    second: int = 0
    requests: int = 0  # embedding requests (POST /v1/embed, /v1/embeddings), any status
    texts: int = 0  # texts answered (status 200)
    tokens: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    latency: dict[int, int] = field(default_factory=dict)  # bucket index -> requests
    latency_ms: float = 0.0
    queue_ms: float = 0.0
    queued: int = 0  # requests that went to the model (queue_ms counts for these)
    cache_hits: int = 0
    cache_misses: int = 0
    saved_cache_ms: float = 0.0
    batches: int = 0
    batch_texts: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    tiers: dict[str, int] = field(default_factory=dict)
    padded_tokens: int = 0
    real_tokens: int = 0
    model_ms: float = 0.0
    saved_batch_ms: float = 0.0
    queue_depth_max: int = 0

    def merge(self, other: Slot) -> None:
        for f in fields(self):
            if f.name == "second":
                continue
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, dict):
                for key, value in theirs.items():
                    mine[key] = mine.get(key, 0) + value
            elif f.name == "queue_depth_max":
                self.queue_depth_max = max(mine, theirs)
            else:
                setattr(self, f.name, mine + theirs)


def _ratio(part: float, whole: float, digits: int = 4) -> float | None:
    return round(part / whole, digits) if whole else None


class Window:
    """Per-second slots for the last ``keep_s`` seconds, plus the total of everything older."""

    def __init__(self, keep_s: int = 300, clock: Callable[[], float] = time.time) -> None:
        self.keep_s = keep_s
        self.clock = clock
        self.started = clock()
        self._slots: deque[Slot] = deque()
        self._older = Slot(second=-1)

    # --8<-- [start:slots]
    def _slot(self) -> Slot:
        now = int(self.clock())
        if not self._slots or self._slots[-1].second != now:
            self._slots.append(Slot(second=now))
            self._expire(now)
        return self._slots[-1]

    def _expire(self, now: int) -> None:
        while self._slots and self._slots[0].second <= now - self.keep_s:
            self._older.merge(self._slots.popleft())

    # --8<-- [end:slots]
    # -- recording (the hot path: once per request, once per batch) --------------
    def record_request(
        self,
        status: int,
        total_ms: float,
        texts: int = 0,
        tokens: int = 0,
        cache_hits: int = 0,
        cache_misses: int = 0,
        queue_ms: float | None = None,
        saved_cache_ms: float = 0.0,
    ) -> None:
        s = self._slots[-1] if self._slots and self._slots[-1].second == int(self.clock()) else self._slot()
        s.requests += 1
        s.statuses[status] = s.statuses.get(status, 0) + 1
        index = min(bisect_left(_BOUNDS, total_ms), _LAST)
        s.latency[index] = s.latency.get(index, 0) + 1
        s.latency_ms += total_ms
        if status == 200:
            s.texts += texts
            s.tokens += tokens
        s.cache_hits += cache_hits
        s.cache_misses += cache_misses
        s.saved_cache_ms += saved_cache_ms
        if queue_ms is not None:
            s.queue_ms += queue_ms
            s.queued += 1

    def record_batch(
        self,
        size: int,
        padded_tokens: int,
        real_tokens: int,
        tier: str,
        inference_ms: float,
        saved_ms: float,
        queue_depth: int,
    ) -> None:
        s = self._slot()
        s.batches += 1
        s.batch_texts += size
        s.batch_sizes[size] = s.batch_sizes.get(size, 0) + 1
        s.tiers[tier] = s.tiers.get(tier, 0) + 1
        s.padded_tokens += padded_tokens
        s.real_tokens += real_tokens
        s.model_ms += inference_ms
        s.saved_batch_ms += saved_ms
        s.queue_depth_max = max(s.queue_depth_max, queue_depth)

    # -- reading (for /v1/metrics, /v1/dashboard) -----------------------------------
    def merged(self, seconds: float | None = None) -> tuple[Slot, float]:
        """All counts of the last ``seconds`` (None: since start) and the span they cover."""
        now = self.clock()
        self._expire(int(now))
        total = Slot()
        if seconds is None:
            total.merge(self._older)
            span = now - self.started
        else:
            span = min(seconds, now - self.started)
        for slot in self._slots:
            if seconds is None or slot.second > now - seconds:
                total.merge(slot)
        return total, max(span, 1e-3)

    def summary(self, seconds: float | None = None) -> dict[str, Any]:
        s, span = self.merged(seconds)
        lookups = s.cache_hits + s.cache_misses
        spent_s = s.model_ms / 1e3
        saved_s = (s.saved_cache_ms + s.saved_batch_ms) / 1e3
        return {
            "seconds": round(span, 1),
            "requests": s.requests,
            "requests_per_s": round(s.requests / span, 2),
            "texts": s.texts,
            "texts_per_s": round(s.texts / span, 2),
            "tokens": s.tokens,
            "statuses": {str(k): v for k, v in sorted(s.statuses.items())},
            "latency_ms": {
                "p50": percentile(s.latency, 0.50),
                "p95": percentile(s.latency, 0.95),
                "p99": percentile(s.latency, 0.99),
                "mean": round(s.latency_ms / s.requests, 3) if s.requests else None,
            },
            "queue_ms_mean": round(s.queue_ms / s.queued, 3) if s.queued else None,
            "cache": {
                "hits": s.cache_hits,
                "misses": s.cache_misses,
                "hit_rate": _ratio(s.cache_hits, lookups),
            },
            "batches": {
                "count": s.batches,
                "avg_size": _ratio(s.batch_texts, s.batches, 2),
                "size_distribution": {str(k): v for k, v in sorted(s.batch_sizes.items())},
                "tiers": {t: s.tiers.get(t, 0) for t in TIERS},
                "padding_ratio": _ratio(s.padded_tokens - s.real_tokens, s.padded_tokens),
                "inference_ms_mean": round(s.model_ms / s.batches, 3) if s.batches else None,
            },
            "rejections": {
                "overload": s.statuses.get(503, 0) + s.statuses.get(429, 0),
                "deadline": s.statuses.get(504, 0),
            },
            "savings": {
                "model_s_spent": round(spent_s, 3),
                "model_s_saved_by_cache": round(s.saved_cache_ms / 1e3, 3),
                "model_s_saved_by_batching": round(s.saved_batch_ms / 1e3, 3),
                "saved_fraction": _ratio(saved_s, saved_s + spent_s),
            },
        }

    def series(self, seconds: int = 300, step: int = 5) -> list[dict[str, Any]]:
        """Points every ``step`` seconds over the last ``seconds`` (or since start), for the charts."""
        clock = self.clock()
        now = int(clock)
        self._expire(now)
        first = (now - seconds) // step * step + step
        first = max(first, int(self.started) // step * step)  # nothing to draw before the start
        points = {t: Slot(second=t) for t in range(first, now + 1, step)}
        for slot in self._slots:
            start = slot.second // step * step
            if start in points:
                points[start].merge(slot)
        out = []
        for t, p in points.items():
            span = max(min(t + step, clock) - max(t, self.started), 1e-3)
            lookups = p.cache_hits + p.cache_misses
            out.append(
                {
                    "t": t,
                    "requests_per_s": round(p.requests / span, 2),
                    "texts_per_s": round(p.texts / span, 2),
                    "p50_ms": percentile(p.latency, 0.50),
                    "p95_ms": percentile(p.latency, 0.95),
                    "p99_ms": percentile(p.latency, 0.99),
                    "hit_rate": _ratio(p.cache_hits, lookups),
                    "avg_batch": _ratio(p.batch_texts, p.batches, 2),
                    "queue_depth_max": p.queue_depth_max if p.batches else None,
                    "tiers": {k: p.tiers.get(k, 0) for k in TIERS},
                    "saved_cache_s": round(p.saved_cache_ms / 1e3, 4),
                    "saved_batch_s": round(p.saved_batch_ms / 1e3, 4),
                    "spent_s": round(p.model_ms / 1e3, 4),
                }
            )
        return out
