"""Stage 4 cache tiers: the key, the in-process LRU, and the Redis tier against a real Redis."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from exercise_pieces import memory_cache
from redis_support import own_redis

from common.settings import Settings
from stage4_cache_backpressure.cache import (
    ENTRY_OVERHEAD_BYTES,
    KEY_PREFIX,
    Cache,
    CacheEntry,
    CacheStats,
    cache_key,
)
from stage4_cache_backpressure.redis_cache import RedisCache

MemoryCache = memory_cache()  # stage 4's; with EXERCISE=1 yours (exercises/stage4_cache_backpressure/)

DIM = 384
VALUE_BYTES = DIM * 4


def _vec(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)


def _unique(prefix: str) -> str:
    return f"{prefix} {time.time_ns()}"


# --- the key -------------------------------------------------------------------
def test_key_pins_model_file_flag_and_exact_text() -> None:
    base = cache_key("all-MiniLM-L6-v2", "a" * 64, True, "Hello world")
    assert base == cache_key("all-MiniLM-L6-v2", "a" * 64, True, "Hello world")
    others = {
        cache_key("other-model", "a" * 64, True, "Hello world"),
        cache_key("all-MiniLM-L6-v2", "b" * 64, True, "Hello world"),  # re-quantized file
        cache_key("all-MiniLM-L6-v2", "a" * 64, False, "Hello world"),
        cache_key("all-MiniLM-L6-v2", "a" * 64, True, "hello world"),
        cache_key("all-MiniLM-L6-v2", "a" * 64, True, "Hello world "),
    }
    assert base not in others and len(others) == 5
    assert base.startswith(KEY_PREFIX) and len(base) == len(KEY_PREFIX) + 64
    assert KEY_PREFIX == "emb:v2:"  # v1 entries (the vector alone) are never read


# --- the entry -------------------------------------------------------------------
@pytest.mark.parametrize(("n_tokens", "truncated"), [(7, False), (256, True)])
def test_entry_roundtrips_vector_token_count_and_truncation(n_tokens: int, truncated: bool) -> None:
    value = CacheEntry(_vec(1), n_tokens, truncated).encode()
    assert len(value) == CacheEntry.size(DIM) == 8 + VALUE_BYTES
    entry = CacheEntry.decode(value)
    assert np.array_equal(entry.vector, _vec(1)) and entry.vector.dtype == np.float32
    assert (entry.n_tokens, entry.truncated) == (n_tokens, truncated)


# --- the memory tier -------------------------------------------------------------
def test_lru_bound_in_items_evicts_least_recently_used() -> None:
    stats = CacheStats()
    lru = MemoryCache(max_items=3, max_bytes=10**9, ttl_s=60, stats=stats)
    for key in "abc":
        lru.put(key, b"x" * 8)
    assert lru.get("a") == b"x" * 8  # "a" is now the most recent; "b" is the oldest
    lru.put("d", b"y" * 8)
    assert lru.get("b") is None
    assert [lru.get(k) is not None for k in "acd"] == [True, True, True]
    assert len(lru) == 3 and stats.evictions == 1


def test_lru_bound_in_bytes() -> None:
    stats = CacheStats()
    entry = len("k0") + VALUE_BYTES + ENTRY_OVERHEAD_BYTES
    lru = MemoryCache(max_items=1000, max_bytes=3 * entry, ttl_s=60, stats=stats)
    for i in range(5):
        lru.put(f"k{i}", _vec(i).tobytes())
    assert len(lru) == 3 and lru.bytes <= 3 * entry
    assert lru.get("k0") is None and lru.get("k4") is not None
    assert stats.evictions == 2


def test_lru_ttl_expires_entries() -> None:
    now = [1000.0]
    stats = CacheStats()
    lru = MemoryCache(max_items=10, max_bytes=10**6, ttl_s=5, stats=stats, clock=lambda: now[0])
    lru.put("a", b"1")
    now[0] += 4.9
    assert lru.get("a") == b"1"
    now[0] = 1005.0  # exactly its TTL: expired
    assert lru.get("a") is None
    assert stats.expirations == 1 and len(lru) == 0 and lru.bytes == 0


def test_lru_zero_items_disables_the_memory_tier() -> None:
    stats = CacheStats()
    lru = MemoryCache(max_items=0, max_bytes=10**6, ttl_s=5, stats=stats)
    lru.put("a", b"1")
    assert not lru.enabled and lru.get("a") is None
    assert len(lru) == 0 and lru.bytes == 0 and stats.evictions == 0  # nothing stored, nothing evicted


def test_lru_an_entry_larger_than_the_byte_bound_is_not_stored() -> None:
    """It could never fit: storing it would evict everything else, then itself."""
    stats = CacheStats()
    lru = MemoryCache(max_items=10, max_bytes=2000, ttl_s=60, stats=stats)
    lru.put("small", b"s" * 100)
    lru.put("huge", b"h" * 5000)
    assert lru.get("huge") is None and lru.get("small") == b"s" * 100
    assert len(lru) == 1 and stats.evictions == 0


def test_lru_a_key_put_again_is_replaced() -> None:
    """One entry under the key, the new value, and the byte count of that one entry."""
    lru = MemoryCache(max_items=10, max_bytes=10**6, ttl_s=60, stats=CacheStats())
    lru.put("a", b"1" * 100)
    lru.put("a", b"2" * 300)
    assert lru.get("a") == b"2" * 300
    assert len(lru) == 1 and lru.bytes == len("a") + 300 + ENTRY_OVERHEAD_BYTES


# --- the Redis tier (real Redis) ---------------------------------------------------
@asynccontextmanager
async def _tier(url: str, **options: Any) -> AsyncIterator[tuple[RedisCache, CacheStats]]:
    """A started Redis tier and its counters (ttl 60 s, 500 ms timeout unless ``options`` say)."""
    stats = CacheStats()
    settings: dict[str, Any] = {"ttl_s": 60, "timeout_ms": 500, **options}
    tier = RedisCache(url, value_bytes=VALUE_BYTES, stats=stats, **settings)
    await tier.start()
    try:
        yield tier, stats
    finally:
        await tier.close()


async def test_redis_roundtrip_with_ttl_and_mget(redis_url: str) -> None:
    async with _tier(redis_url, ttl_s=120) as (tier, stats):
        keys = [_unique(f"test-roundtrip-{i}") for i in range(3)]
        await tier.put_many({keys[0]: _vec(0).tobytes(), keys[1]: _vec(1).tobytes()})
        got = await tier.get_many(keys)
        assert got[0] == _vec(0).tobytes() and got[1] == _vec(1).tobytes() and got[2] is None
        assert stats.hits["redis"] == 2 and stats.misses["redis"] == 1 and stats.writes["redis"] == 2
        ttl = redis.Redis.from_url(redis_url).ttl(keys[0])
        assert 0 < ttl <= 120


async def test_redis_one_pool_reuses_connections(private_redis) -> None:  # type: ignore[no-untyped-def]
    """100 commands from 20 concurrent tasks: a handful of connections, not 100."""
    probe = redis.Redis.from_url(private_redis.url)
    before = probe.info("stats")["total_connections_received"]
    async with _tier(private_redis.url, timeout_ms=1000) as (tier, _):

        async def five(i: int) -> None:
            for j in range(5):
                await tier.get_many([f"k{i}-{j}"])

        await asyncio.gather(*(five(i) for i in range(20)))
        opened = probe.info("stats")["total_connections_received"] - before
        assert opened <= 20  # at most one per concurrent task, reused for all 100 commands


async def test_redis_garbage_is_a_counted_miss(redis_url: str) -> None:
    key = _unique("test-garbage")
    redis.Redis.from_url(redis_url).set(key, b"not a vector", ex=60)
    async with _tier(redis_url) as (tier, stats):
        assert await tier.get_many([key]) == [None]
        assert stats.errors["garbage"] == 1
        await tier.put_many({key: _vec(3).tobytes()})  # the recomputed value overwrites it
        assert await tier.get_many([key]) == [_vec(3).tobytes()]


async def test_redis_down_fails_open_logs_once_and_recovers(private_redis, caplog) -> None:  # type: ignore[no-untyped-def]
    async with _tier(private_redis.url, timeout_ms=200, backoff_s=0.0) as (tier, stats):
        await tier.put_many({"k": _vec(1).tobytes()})
        private_redis.stop()
        caplog.set_level(logging.WARNING, logger="embedserve.cache")
        for _ in range(20):
            assert await tier.get_many(["k"]) == [None]
            await tier.put_many({"k": _vec(1).tobytes()})
        assert stats.errors["connection"] == 40
        failing = [r for r in caplog.records if "answering from the model" in r.getMessage()]
        assert len(failing) == 1  # 40 failures, one log line
        private_redis.start()  # same port, empty (no persistence)
        assert await tier.get_many(["k"]) == [None]  # reconnects by itself: a plain miss now
        await tier.put_many({"k": _vec(1).tobytes()})
        assert await tier.get_many(["k"]) == [_vec(1).tobytes()]
        assert any("answering again" in r.getMessage() for r in caplog.records)


async def test_redis_slow_times_out_then_backs_off(private_redis) -> None:  # type: ignore[no-untyped-def]
    async with _tier(private_redis.url, timeout_ms=50, backoff_s=0.5) as (tier, stats):
        await tier.put_many({"k": _vec(2).tobytes()})
        private_redis.pause()  # SIGSTOP: the socket is open, nothing answers
        started = time.perf_counter()
        for _ in range(tier.timeouts_before_backoff):  # each one tried, each one a timeout
            assert await tier.get_many(["k"]) == [None]
        tried = time.perf_counter() - started
        assert await tier.get_many(["k"]) == [None]  # three in a row: backing off, not even tried
        assert stats.errors["timeout"] == tier.timeouts_before_backoff and stats.skipped == 1
        assert tried < 6.0  # bounded by CACHE_TIMEOUT_MS, not by Redis
        private_redis.resume()
        deadline = time.monotonic() + 10
        while await tier.get_many(["k"]) != [_vec(2).tobytes()]:
            assert time.monotonic() < deadline, "the Redis tier did not recover"
            await asyncio.sleep(0.1)


async def test_redis_one_timeout_is_not_an_outage(private_redis) -> None:  # type: ignore[no-untyped-def]
    """A lone timeout (Redis, or this process's event loop, busy for a moment) costs that one
    lookup; the next request asks Redis again instead of skipping it for ``backoff_s``."""
    async with _tier(private_redis.url, timeout_ms=50, backoff_s=30) as (tier, stats):
        await tier.put_many({"k": _vec(4).tobytes()})
        private_redis.pause()
        assert await tier.get_many(["k"]) == [None]
        private_redis.resume()
        assert stats.errors["timeout"] == 1
        deadline = time.monotonic() + 10  # the timed-out connection was dropped; a new one answers
        while (found := await tier.get_many(["k"])) != [_vec(4).tobytes()]:
            assert found == [None] and time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert stats.skipped == 0  # never backed off (backoff_s=30 would have failed the loop)


async def test_redis_password_in_the_url(tmp_path: Path) -> None:
    with own_redis(tmp_path, password="s3cret") as server:
        stats = CacheStats()
        tier = RedisCache(server.url, ttl_s=60, timeout_ms=500, value_bytes=VALUE_BYTES, stats=stats)
        bad_url = server.url.replace("s3cret", "wrong")
        wrong = RedisCache(bad_url, ttl_s=60, timeout_ms=500, value_bytes=VALUE_BYTES, stats=stats)
        await tier.start()
        await wrong.start()
        try:
            await tier.put_many({"k": _vec(5).tobytes()})
            assert await tier.get_many(["k"]) == [_vec(5).tobytes()]
            assert await wrong.get_many(["k"]) == [None]  # refused: a counted error, not an exception
            assert sum(stats.errors.values()) == 1
        finally:
            await tier.close()
            await wrong.close()


# --- the two tiers together ----------------------------------------------------------
async def test_two_tiers_promote_redis_hits_into_memory(redis_url: str) -> None:
    settings = Settings(cache_url=redis_url)
    writer, reader = Cache(settings, DIM), Cache(settings, DIM)  # two replicas
    await writer.start()
    await reader.start()
    try:
        key = _unique("test-tiers")
        writer.put([key], [CacheEntry(_vec(7), 12, True)])
        await writer.flush()  # the Redis write goes behind the answer
        assert writer.get_local([key])[0] is not None
        assert reader.get_local([key]) == [None]
        (remote,) = await reader.get_remote([key])
        assert remote is not None and np.array_equal(remote.vector, _vec(7))
        assert (remote.n_tokens, remote.truncated) == (12, True)  # a hit needs no tokenizer
        (local,) = reader.get_local([key])
        assert local is not None and np.array_equal(local.vector, _vec(7))  # promoted: no round trip next
        assert (local.n_tokens, local.truncated) == (12, True)
        assert reader.stats.hits["redis"] == 1 and reader.stats.hits["memory"] == 1
    finally:
        await writer.close()
        await reader.close()


@pytest.mark.parametrize("enabled", [False])
async def test_cache_disabled_stores_nothing(redis_url: str, enabled: bool) -> None:
    cache = Cache(Settings(cache_url=redis_url, cache_enabled=enabled), DIM)
    await cache.start()
    try:
        assert cache.redis is None
        cache.put(["k"], [CacheEntry(_vec(1), 3, False)])
        assert cache.get_local(["k"]) == [None] and len(cache.memory) == 0
    finally:
        await cache.close()
