"""Stage 4's counters: each cache tier's, and what happened to the requests.

Plain integers, read by ``/v1/cache/metrics``; stage 5 exports the same objects to Prometheus.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class CacheStats:
    """Counters of every tier."""

    hits: Counter[str] = field(default_factory=Counter)  # by tier: "memory", "redis"
    misses: Counter[str] = field(default_factory=Counter)  # by tier
    errors: Counter[str] = field(default_factory=Counter)  # Redis: timeout, connection, garbage, error
    skipped: int = 0  # Redis lookups not tried while it is backing off after an error
    evictions: int = 0  # memory entries pushed out by the item or byte bound
    expirations: int = 0  # memory entries found past their TTL
    writes: Counter[str] = field(default_factory=Counter)  # by tier

    def as_dict(self) -> dict[str, Any]:
        tiers = ("memory", "redis")
        return {
            "hits": {t: self.hits[t] for t in tiers},
            "misses": {t: self.misses[t] for t in tiers},
            "writes": {t: self.writes[t] for t in tiers},
            "errors": dict(self.errors),
            "skipped": self.skipped,
            "evictions": self.evictions,
            "expirations": self.expirations,
        }


@dataclass(slots=True)
class Stage4Stats:
    """Every counter of this stage."""

    cache: CacheStats = field(default_factory=CacheStats)
    deduplicated: int = 0  # texts answered by another request's computation
    rejected: int = 0  # requests refused because the queue was full (OVERLOAD_STATUS)
    deadline_exceeded: int = 0  # requests answered 504
    disconnects: int = 0  # requests whose client left first (their queued texts never run)
    bypassed: int = 0  # requests that opted out of the cache
    active: int = 0  # requests inside the backend right now

    def as_dict(self) -> dict[str, Any]:
        names = ("deduplicated", "rejected", "deadline_exceeded", "disconnects", "bypassed", "active")
        return {"cache": self.cache.as_dict(), **{n: getattr(self, n) for n in names}}
