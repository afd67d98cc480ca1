"""The shared cache tier: Redis through redis-py asyncio, with one pool, that fails open.

One connection pool for the process (opened in ``start``, closed in ``close``, both called
from the app's lifespan), MGET for lookups, one pipeline of ``SET EX`` for writes, written
behind the answer (a request never waits for its write, which is bounded by the socket's
timeout instead). A Redis that is down, slow (CACHE_TIMEOUT_MS) or returns garbage costs a
miss, a counted error and at most one log line per interval; the tier backs off briefly and
then recovers by itself. A ``rediss://`` URL verifies the server's certificate (against
CACHE_CA_FILE when set); one that does not verify is reported at startup and the tier is off:
nothing can make it verify later.

A refused or reset connection backs off at once: Redis is down. A single timeout does not:
the timeout is wall-clock time on the event loop, so when the server itself is busy, a reply
that arrived in time can be read late. Backing off then would turn the hot texts into model
work just when the server has least to spare; only ``timeouts_before_backoff`` timeouts in a
row (no success between them) mean Redis is slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from stage4_cache_backpressure.stats import CacheStats

log = logging.getLogger("embedserve.cache")


# --8<-- [start:redis]
class RedisCache:
    """The shared tier. Every lookup is bounded by CACHE_TIMEOUT_MS, and everything fails open."""

    def __init__(
        self,
        url: str,
        ttl_s: int,
        timeout_ms: float,
        value_bytes: int,
        stats: CacheStats,
        *,
        ca_file: Path | None = None,
        connect_every_command: bool = False,
        max_connections: int = 32,
        backoff_s: float = 1.0,
        timeouts_before_backoff: int = 3,
        log_interval_s: float = 10.0,
    ) -> None:
        self.url, self.ttl_s, self.timeout_s = url, ttl_s, timeout_ms / 1e3
        self.ca_file, self.connect_every_command = ca_file, connect_every_command
        self.value_bytes, self.stats = value_bytes, stats
        self.max_connections = max_connections
        self.backoff_s, self.log_interval_s = backoff_s, log_interval_s
        self.timeouts_before_backoff = timeouts_before_backoff
        self._timeouts_in_a_row = 0
        self.client: aioredis.Redis | None = None
        self._down_until = 0.0  # after an error, skip Redis for backoff_s instead of paying the timeout
        self._failures_unlogged = 0
        self._last_log = float("-inf")
        self._failing = False
        self._last_failure = ""
        self._writes: set[asyncio.Task[None]] = set()  # work behind the answers, awaited on close

    async def start(self) -> None:
        # ONE pool for the process, opened here (the lifespan), never per request: a new
        # connection per command costs a TCP (and TLS) handshake every time (measured in docs).
        options: dict[str, Any] = {}
        if self.url.startswith("rediss://") and self.ca_file is not None:
            options["ssl_ca_certs"] = str(self.ca_file)
        pool_class = ConnectEveryCommand if self.connect_every_command else aioredis.BlockingConnectionPool
        pool = pool_class.from_url(
            self.url,
            max_connections=self.max_connections,
            timeout=None,  # waiting for a free connection is bounded by the call's timeout below
            socket_connect_timeout=self.timeout_s,
            socket_timeout=max(self.timeout_s, 1.0),
            # A pooled connection that Redis closed (a restart) is retried once on a fresh one.
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[RedisConnectionError],
            **options,
        )
        self.client = aioredis.Redis.from_pool(pool)
        await self._first_contact()

    async def _first_contact(self) -> None:
        """One PING at startup, so that a misconfiguration is said once, clearly, and at once."""
        assert self.client is not None
        try:
            async with asyncio.timeout(max(self.timeout_s, 1.0)):
                await self.client.ping()
        except Exception as exc:
            if not _unverified(exc):  # down or slow now: the tier fails open until it answers
                log.warning("redis cache at %s does not answer yet (%s); failing open", _where(self.url), exc)
                return
            log.error(
                "redis cache at %s: its TLS certificate does not verify (%s); set CACHE_CA_FILE to the "
                "CA that signed it. Serving without the Redis tier.",
                _where(self.url),
                exc,
            )
            await self.client.aclose()
            self.client = None
            return
        if self.connect_every_command:
            log.warning("CACHE_CLIENT=per-command: a new Redis connection a command (the lesson's bug)")

    async def flush(self) -> None:
        """Wait for the writes behind the answers so far (each bounded by the timeout)."""
        while self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    async def close(self) -> None:
        await self.flush()
        if self._failures_unlogged:  # the last interval's failures, not left out of the log
            self._report()
        if self.client is not None:
            await self.client.aclose()  # closes the pool's connections too
            self.client = None
            log.info("redis cache pool closed")

    def write_behind(self, items: dict[str, bytes]) -> None:
        """``put_many`` in a task of its own: the answer goes out without waiting for Redis."""
        if self.client is not None and items:
            self._behind(self.put_many(items))

    def _behind(self, work: Coroutine[Any, Any, None]) -> None:
        """Work no request waits for (a write, a reset of the pool); ``flush`` and ``close`` do."""
        task = asyncio.create_task(work)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _disconnect_idle(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.timeout_s):
                    await self.client.connection_pool.disconnect(inuse_connections=False)

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
            # No request waits for a write, so it gets the socket's bound, not the lookup's: on a
            # busy event loop a reply read late would otherwise lose the write.
            async with asyncio.timeout(max(self.timeout_s, 1.0)):
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
        if kind == "timeout":
            self._timeouts_in_a_row += 1
            if self._timeouts_in_a_row >= self.timeouts_before_backoff:
                self._down_until = time.monotonic() + self.backoff_s
                self._timeouts_in_a_row = 0
        elif kind != "garbage":  # the connection failed: Redis is down or restarting
            self._down_until = time.monotonic() + self.backoff_s
            if self.client is not None:  # idle connections may be dead too: reconnect them all later
                self._behind(self._disconnect_idle())
        self._failing = True
        self._failures_unlogged += 1
        self._last_failure = f"{kind} ({type(exc).__name__}: {exc})"
        if time.monotonic() - self._last_log >= self.log_interval_s:  # one line per interval
            self._report()

    def _report(self) -> None:
        log.warning(
            "redis cache %s; %d failure(s) since the last report; answering from the model",
            self._last_failure,
            self._failures_unlogged,
        )
        self._last_log, self._failures_unlogged = time.monotonic(), 0

    def _recovered(self) -> None:
        self._timeouts_in_a_row = 0
        if self._failing:
            self._failing = False
            log.warning("redis cache is answering again")


class ConnectEveryCommand(aioredis.BlockingConnectionPool):
    """CACHE_CLIENT=per-command, the lesson's bug and never a choice for operators: each command
    opens a new connection and closes it after, as code that makes a client per request does."""

    async def release(self, connection: Any) -> None:
        await connection.disconnect()
        await super().release(connection)


class _Garbage(Exception):
    pass


def _unverified(exc: BaseException) -> bool:
    """The TLS handshake failed on the certificate (redis-py wraps the ssl error)."""
    while exc is not None:
        if isinstance(exc, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def _where(url: str) -> str:
    """host:port of a Redis URL, without its password."""
    return url.split("@")[-1].split("://")[-1].split("/")[0]


def _kind(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, _Garbage):
        return "garbage"
    if isinstance(exc, (ConnectionError, OSError)) or "Connection" in type(exc).__name__:
        return "connection"
    return "error" if isinstance(exc, RedisError) else type(exc).__name__


# --8<-- [end:redis]
