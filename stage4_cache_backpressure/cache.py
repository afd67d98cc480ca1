"""The stage 4 cache: a key that pins the model, what an entry holds, an in-process LRU, both tiers.

* ``cache_key``: SHA-256 of model id, the served ONNX file's digest, the normalize flag
  and the exact text, so a new model (or a re-quantized one) never serves old vectors.
* ``CacheEntry``: the vector with the text's token count and truncation flag, so a hit
  answers ``usage``, ``truncated`` and the 422 of ``truncate: false`` without the tokenizer.
* ``MemoryCache``: an LRU bounded in entries and in bytes, with a TTL. No server needed.
* ``Cache``: the memory tier in front of the Redis tier (``redis_cache.py``) when CACHE_URL is set.

An entry is 8 bytes of header and the float32 vector (1544 bytes for 384 dims), not JSON.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.settings import Settings
from stage4_cache_backpressure.redis_cache import RedisCache
from stage4_cache_backpressure.stats import CacheStats

__all__ = ["KEY_PREFIX", "Cache", "CacheEntry", "CacheStats", "MemoryCache", "cache_key"]

# v2: entries carry the token count and the truncation flag (v1 held the vector alone), so
# a server of this version never reads an entry of the old format that another left in Redis.
KEY_PREFIX = "emb:v2:"
# Per-entry bookkeeping the byte bound counts on top of key and value (tuple, dict slot, headers).
ENTRY_OVERHEAD_BYTES = 120
# An entry's header: n_tokens (uint32), truncated (bool), 3 pad bytes so the floats start aligned.
_HEADER = struct.Struct("<I?3x")


# --8<-- [start:key]
def cache_key(model_id: str, model_sha256: str, normalize: bool, text: str) -> str:
    """The cache key of one text: a different model, file or normalize flag is a different key."""
    pinned = f"{model_id}\x00{model_sha256}\x00{'normalized' if normalize else 'raw'}\x00"
    exact = (pinned + text).encode("utf-8", "surrogatepass")  # the exact text: no strip, no lower
    return KEY_PREFIX + hashlib.sha256(exact).hexdigest()


# --8<-- [end:key]


# --8<-- [start:entry]
@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One text's answer: everything a hit needs, so a hit never runs the tokenizer."""

    vector: np.ndarray  # float32, normalized when the key says so
    n_tokens: int  # special tokens included (OpenAI `usage`)
    truncated: bool  # cut at the model's token limit (`truncate: false` makes that a 422)

    def encode(self) -> bytes:
        return _HEADER.pack(self.n_tokens, self.truncated) + np.asarray(self.vector, "<f4").tobytes()

    @classmethod
    def decode(cls, value: bytes) -> CacheEntry:
        n_tokens, truncated = _HEADER.unpack_from(value)
        return cls(np.frombuffer(value, "<f4", offset=_HEADER.size), n_tokens, truncated)

    @classmethod
    def size(cls, dimensions: int) -> int:
        """Bytes of an encoded entry: what the Redis tier checks a value against."""
        return _HEADER.size + 4 * dimensions


# --8<-- [end:entry]


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
        size = entry_size(key, value)
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
        self.bytes -= entry_size(key, value)


def entry_size(key: str, value: bytes) -> int:
    """What one entry counts against the byte bound: key, value and the bookkeeping around them."""
    return len(key) + len(value) + ENTRY_OVERHEAD_BYTES


# --8<-- [end:memory]


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
            RedisCache(
                url,
                settings.cache_ttl_s,
                settings.cache_timeout_ms,
                CacheEntry.size(dimensions),
                self.stats,
                ca_file=settings.cache_ca_file,
                connect_every_command=settings.cache_client == "per-command",
            )
            if url and self.enabled
            else None
        )

    async def start(self) -> None:
        if self.redis is not None:
            await self.redis.start()

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.close()

    def get_local(self, keys: Sequence[str]) -> list[CacheEntry | None]:
        """Memory tier only: no await, so it runs before the request joins any queue."""
        if not self.enabled or not self.memory.enabled:
            return [None] * len(keys)
        found = [self.memory.get(k) for k in keys]
        hits = sum(v is not None for v in found)
        self.stats.hits["memory"] += hits
        self.stats.misses["memory"] += len(keys) - hits
        return [None if v is None else CacheEntry.decode(v) for v in found]

    async def get_remote(self, keys: Sequence[str]) -> list[CacheEntry | None]:
        """Redis tier; what it finds is copied into the memory tier."""
        if self.redis is None or not keys:
            return [None] * len(keys)
        found = await self.redis.get_many(keys)
        out: list[CacheEntry | None] = []
        for key, value in zip(keys, found, strict=True):
            if value is not None:
                self.memory.put(key, value)
            out.append(None if value is None else CacheEntry.decode(value))
        return out

    def put_local(self, keys: Sequence[str], entries: Sequence[CacheEntry]) -> dict[str, bytes]:
        """Write the memory tier now; return the encoded items for ``put_remote``."""
        if not self.enabled:
            return {}
        items = {key: entry.encode() for key, entry in zip(keys, entries, strict=True)}
        if self.memory.enabled:
            for key, value in items.items():
                self.memory.put(key, value)
            self.stats.writes["memory"] += len(items)
        return items

    def put_remote(self, items: dict[str, bytes]) -> None:
        """Write the Redis tier, in one pipeline, behind the answer: nobody waits for it."""
        if self.redis is not None:
            self.redis.write_behind(items)

    def put(self, keys: Sequence[str], entries: Sequence[CacheEntry]) -> None:
        """Write both tiers."""
        self.put_remote(self.put_local(keys, entries))

    async def flush(self) -> None:
        """Wait for the Redis writes behind the answers so far."""
        if self.redis is not None:
            await self.redis.flush()

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
