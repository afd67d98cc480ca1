"""Cache get/set for the in-process tier and the Redis tier (the Redis at 127.0.0.1:6379)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import numpy as np
import pytest

from stage4_cache_backpressure.cache import CacheStats, MemoryCache, cache_key
from stage4_cache_backpressure.redis_cache import RedisCache

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
VALUE = np.random.default_rng(0).standard_normal(384).astype("<f4").tobytes()


def _keys(n: int, tag: str) -> list[str]:
    return [cache_key("bench-model", "0" * 64, True, f"{tag} text {i}") for i in range(n)]


def bench_memory_get_hit(benchmark: pytest.FixtureRequest) -> None:
    """A hit among 10,000 entries."""
    memory, keys = MemoryCache(100_000, 256 * 2**20, 3600, CacheStats()), _keys(10_000, "memory")
    for key in keys:
        memory.put(key, VALUE)
    benchmark.group = "cache: memory tier"
    assert benchmark(memory.get, keys[0]) == VALUE


def bench_memory_put(benchmark: pytest.FixtureRequest) -> None:
    memory, key = MemoryCache(100_000, 256 * 2**20, 3600, CacheStats()), _keys(1, "memory-put")[0]
    benchmark.group = "cache: memory tier"
    benchmark(memory.put, key, VALUE)
    assert memory.get(key) == VALUE


@pytest.fixture(scope="module")
def redis_tier(loop: asyncio.AbstractEventLoop) -> Iterator[RedisCache]:
    # A short TTL: the benchmark's keys leave the shared Redis by themselves.
    cache = RedisCache(REDIS_URL, ttl_s=120, timeout_ms=1000, value_bytes=len(VALUE), stats=CacheStats())
    loop.run_until_complete(cache.start())
    yield cache
    loop.run_until_complete(cache.close())


@pytest.mark.parametrize("n", (1, 32))
def bench_redis_put(
    benchmark: pytest.FixtureRequest, loop: asyncio.AbstractEventLoop, redis_tier: RedisCache, n: int
) -> None:
    """One pipeline of ``n`` SET EX (what a stage 4 miss writes)."""
    items = dict.fromkeys(_keys(n, "redis-put"), VALUE)
    benchmark.group = "cache: redis tier"
    benchmark.extra_info["keys"] = n
    benchmark(lambda: loop.run_until_complete(redis_tier.put_many(items)))
    assert redis_tier.stats.errors.total() == 0, redis_tier.stats.errors


@pytest.mark.parametrize("n", (1, 32))
def bench_redis_get_hit(
    benchmark: pytest.FixtureRequest, loop: asyncio.AbstractEventLoop, redis_tier: RedisCache, n: int
) -> None:
    """One MGET of ``n`` keys that are all there."""
    keys = _keys(n, "redis-get")
    loop.run_until_complete(redis_tier.put_many(dict.fromkeys(keys, VALUE)))
    benchmark.group = "cache: redis tier"
    benchmark.extra_info["keys"] = n
    values = benchmark(lambda: loop.run_until_complete(redis_tier.get_many(keys)))
    assert values == [VALUE] * n, redis_tier.stats.errors
