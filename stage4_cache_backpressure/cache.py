"""The stage 4 cache: a key that pins the model, an in-process LRU, a Redis tier in front of both.

* ``cache_key``: SHA-256 of model id, the served ONNX file's digest, the normalize flag
  and the exact text, so a new model (or a re-quantized one) never serves old vectors.
* ``MemoryCache``: an LRU bounded in entries and in bytes, with a TTL. No server needed.
* ``RedisCache``: redis-py asyncio, one connection pool for the process (opened in
  ``start``, closed in ``close``), MGET for lookups and one pipeline of ``SET EX`` for
  writes. It *fails open*: a Redis that is down, slow (CACHE_TIMEOUT_MS) or returns
  garbage costs a miss, a counted error and at most one log line per interval.
* ``Cache``: the two tiers together, the memory tier in front.

Values are float32 bytes (1536 bytes for 384 dims), not JSON lists.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common.settings import Settings

log = logging.getLogger("embedserve.cache")

KEY_PREFIX = "emb:v1:"
# Per-entry bookkeeping the byte bound counts on top of key and value (tuple, dict slot, headers).
ENTRY_OVERHEAD_BYTES = 120


# --8<-- [start:key]
def cache_key(model_id: str, model_sha256: str, normalize: bool, text: str) -> str:
    """The cache key of one text: a different model, file or normalize flag is a different key."""
    digest = hashlib.sha256()
    for part in (model_id, model_sha256, "normalized" if normalize else "raw"):
        digest.update(part.encode())
        digest.update(b"\x00")
    digest.update(text.encode("utf-8", "surrogatepass"))  # the exact text: no strip, no lower
    return KEY_PREFIX + digest.hexdigest()


# --8<-- [end:key]


@dataclass(slots=True)
class CacheStats:
    """Counters of every tier (stage 5 exports them)."""

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


# --8<-- [start:memory]
class MemoryCache:
    """An LRU of float32 bytes, bounded in entries and in bytes, each entry with a TTL."""

    def __init__(
        self,
        max_items: int,
        max_bytes: int,
        ttl_s: float,
        stats: CacheStats,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_items, self.max_bytes, self.ttl_s = max_items, max_bytes, ttl_s
        self.stats, self._clock = stats, clock
        self._data: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_items > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: str) -> bytes | None:
        entry = self._data.get(key)
        if entry is None:
            return None
        expires, value = entry
        if expires <= self._clock():
            self._drop(key)
            self.stats.expirations += 1
            return None
        self._data.move_to_end(key)  # most recently used goes last; eviction takes the first
        return value

    def put(self, key: str, value: bytes) -> None:
        size = _size(key, value)
        if not self.enabled or size > self.max_bytes:
            return
        if key in self._data:
            self._drop(key)
        self._data[key] = (self._clock() + self.ttl_s, value)
        self.bytes += size
        while len(self._data) > self.max_items or self.bytes > self.max_bytes:
            self._drop(next(iter(self._data)))
            self.stats.evictions += 1

    def _drop(self, key: str) -> None:
        _, value = self._data.pop(key)
        self.bytes -= _size(key, value)


def _size(key: str, value: bytes) -> int:
    return len(key) + len(value) + ENTRY_OVERHEAD_BYTES


# --8<-- [end:memory]


# --8<-- [start:redis]
class RedisCache:
    """The shared tier. Every call is bounded by CACHE_TIMEOUT_MS and fails open."""

    def __init__(
        self,
        url: str,
        ttl_s: int,
        timeout_ms: float,
        value_bytes: int,
        stats: CacheStats,
        *,
        max_connections: int = 32,
        backoff_s: float = 1.0,
        log_interval_s: float = 10.0,
    ) -> None:
        self.url, self.ttl_s, self.timeout_s = url, ttl_s, timeout_ms / 1e3
        self.value_bytes, self.stats = value_bytes, stats
        self.max_connections = max_connections
        self.backoff_s, self.log_interval_s = backoff_s, log_interval_s
        self.client: aioredis.Redis | None = None
        self._down_until = 0.0  # after an error, skip Redis for backoff_s instead of paying the timeout
        self._failures_unlogged = 0
        self._last_log = float("-inf")
        self._failing = False

    async def start(self) -> None:
        # ONE pool for the process, opened here (the lifespan), never per request: a new
        # connection per command costs a TCP (and TLS) handshake every time (measured in docs).
        pool = aioredis.BlockingConnectionPool.from_url(
            self.url,
            max_connections=self.max_connections,
            timeout=None,  # waiting for a free connection is bounded by the call's timeout below
            socket_connect_timeout=self.timeout_s,
            socket_timeout=max(self.timeout_s, 1.0),
        )
        self.client = aioredis.Redis.from_pool(pool)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()  # closes the pool's connections too
            self.client = None
            log.info("redis cache pool closed")

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """One MGET; on any failure every key is a miss."""
        if self.client is None or not keys:
            return [None] * len(keys)
        if time.monotonic() < self._down_until:
            self.stats.skipped += 1
            return [None] * len(keys)
        try:
            async with asyncio.timeout(self.timeout_s):
                raw = await self.client.mget(keys)
            if not isinstance(raw, list) or len(raw) != len(keys):
                raise _Garbage(f"MGET returned {type(raw).__name__} for {len(keys)} keys")
        except Exception as exc:
            self._failed(exc)
            return [None] * len(keys)
        self._recovered()
        values: list[bytes | None] = []
        for value in raw:
            if value is not None and (not isinstance(value, bytes) or len(value) != self.value_bytes):
                self._failed(_Garbage(f"value of {len(value)} bytes, expected {self.value_bytes}"))
                value = None  # the model recomputes it and the write below overwrites it
            values.append(value)
        hits = sum(v is not None for v in values)
        self.stats.hits["redis"] += hits
        self.stats.misses["redis"] += len(keys) - hits
        return values

    async def put_many(self, items: dict[str, bytes]) -> None:
        """One pipeline of ``SET key value EX ttl``; a failure only costs the write."""
        if self.client is None or not items or time.monotonic() < self._down_until:
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.client.pipeline(transaction=False) as pipe:
                    for key, value in items.items():
                        pipe.set(key, value, ex=self.ttl_s)
                    await pipe.execute()
        except Exception as exc:
            self._failed(exc)
            return
        self.stats.writes["redis"] += len(items)
        self._recovered()

    def _failed(self, exc: BaseException) -> None:
        kind = _kind(exc)
        self.stats.errors[kind] += 1
        if kind != "garbage":
            self._down_until = time.monotonic() + self.backoff_s
        self._failing = True
        self._failures_unlogged += 1
        now = time.monotonic()
        if now - self._last_log >= self.log_interval_s:  # one line per interval, not one per request
            log.warning(
                "redis cache %s (%s: %s); %d failure(s) since the last report; answering from the model",
                kind,
                type(exc).__name__,
                exc,
                self._failures_unlogged,
            )
            self._last_log, self._failures_unlogged = now, 0

    def _recovered(self) -> None:
        if self._failing:
            self._failing = False
            log.warning("redis cache is answering again")


class _Garbage(Exception):
    pass


def _kind(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, _Garbage):
        return "garbage"
    if isinstance(exc, (ConnectionError, OSError)) or "Connection" in type(exc).__name__:
        return "connection"
    return "error" if isinstance(exc, RedisError) else type(exc).__name__


# --8<-- [end:redis]


# --8<-- [start:tiers]
class Cache:
    """The in-process LRU in front of Redis: hot keys cost no round trip, replicas share the rest."""

    def __init__(self, settings: Settings, dimensions: int, stats: CacheStats | None = None) -> None:
        self.stats = stats or CacheStats()
        self.enabled = settings.cache_enabled
        self.dimensions = dimensions
        self.memory = MemoryCache(
            settings.cache_max_items, settings.cache_max_bytes, settings.cache_ttl_s, self.stats
        )
        url = settings.cache_url.get_secret_value() if settings.cache_url else None
        self.redis = (
            RedisCache(url, settings.cache_ttl_s, settings.cache_timeout_ms, dimensions * 4, self.stats)
            if url and self.enabled
            else None
        )

    async def start(self) -> None:
        if self.redis is not None:
            await self.redis.start()

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.close()

    def get_local(self, keys: Sequence[str]) -> list[np.ndarray | None]:
        """Memory tier only: no await, so it runs before the request joins any queue."""
        if not self.enabled or not self.memory.enabled:
            return [None] * len(keys)
        found = [self.memory.get(k) for k in keys]
        hits = sum(v is not None for v in found)
        self.stats.hits["memory"] += hits
        self.stats.misses["memory"] += len(keys) - hits
        return [None if v is None else self._decode(v) for v in found]

    async def get_remote(self, keys: Sequence[str]) -> list[np.ndarray | None]:
        """Redis tier; what it finds is copied into the memory tier."""
        if self.redis is None or not keys:
            return [None] * len(keys)
        found = await self.redis.get_many(keys)
        out: list[np.ndarray | None] = []
        for key, value in zip(keys, found, strict=True):
            if value is not None:
                self.memory.put(key, value)
            out.append(None if value is None else self._decode(value))
        return out

    async def put(self, keys: Sequence[str], vectors: np.ndarray) -> None:
        """Write both tiers (memory first, synchronously; Redis in one pipeline)."""
        if not self.enabled:
            return
        items = {k: np.asarray(v, dtype="<f4").tobytes() for k, v in zip(keys, vectors, strict=True)}
        if self.memory.enabled:
            for key, value in items.items():
                self.memory.put(key, value)
            self.stats.writes["memory"] += len(items)
        if self.redis is not None:
            await self.redis.put_many(items)

    def _decode(self, value: bytes) -> np.ndarray:
        return np.frombuffer(value, dtype="<f4")

    def config(self) -> dict[str, Any]:
        m = self.memory
        return {
            "enabled": self.enabled,
            "memory": {
                "max_items": m.max_items,
                "max_bytes": m.max_bytes,
                "ttl_s": m.ttl_s,
                "items": len(m),
                "bytes": m.bytes,
            },
            "redis": None
            if self.redis is None
            else {
                "ttl_s": self.redis.ttl_s,
                "timeout_ms": self.redis.timeout_s * 1e3,
                "max_connections": self.redis.max_connections,
            },
        }


# --8<-- [end:tiers]
