"""Fault injection under load: Redis killed and restarted, SIGTERM, SIGKILL and restart.

Each scenario starts its own server (and its own redis-server), injects one fault while
clients are sending, and returns what happened as plain numbers. ``tests/test_faults.py``
asserts on them; ``python -m benchmarks.reliability.reliability`` writes them to the docs.

* ``redis_restart``: the memory tier is off (CACHE_MAX_ITEMS=0), so every request goes
  through Redis; Redis is SIGKILLed mid-load and started again. Requests must not fail
  (the tier fails open) and Redis must serve hits again after it is back.
* ``sigterm_drain``: a burst of slow requests is admitted (the server says so in
  ``/v1/cache/metrics``), then SIGTERM. Every admitted request must get its 200; requests
  sent after the signal are refused cleanly (connection refused or 503), never cut off.
  With ``redis_dies``, Redis is SIGKILLed during that drain too: two faults at once.
* ``sigkill_restart``: the server is SIGKILLed under load and started again on the same
  port; it must come back ready, and with Redis the texts it embedded before are hits.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import orjson
import redis as redis_client

from common import corpus
from loadtests.httpload import Answer, closed_loop, post_requests
from loadtests.procs import StageProcess, free_port, redis_server, running_stage


async def drive(
    url: str,
    workers: int,
    stop: asyncio.Event,
    body: Callable[[random.Random], dict[str, Any]],
    outcomes: list[Answer],
    timeout_s: float = 60.0,
) -> None:
    """Closed-loop load until ``stop``: ``workers`` clients, each sending its next request when the
    last is answered. A request with no answer (refused, reset) is an Answer with status 0."""
    rng = random.Random(0)
    requests = post_requests("/v1/embed", [orjson.dumps(body(rng)) for _ in range(2000)])
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    await closed_loop(host, port, requests, workers, stop=stop, timeout=timeout_s, record=outcomes.append)


def _statuses(outcomes: list[Answer]) -> dict[str, int]:
    return dict(Counter(str(o.status) if o.status else o.error or "?" for o in outcomes))


# --- Redis killed and restarted -----------------------------------------------------------
def redis_restart(stage: str, log_dir: Path, phase_s: float = 3.0, workers: int = 6) -> dict[str, Any]:
    pool = corpus.texts(120, seed=901, kind="sentence")

    def body(rng: random.Random) -> dict[str, Any]:
        return {"inputs": rng.sample(pool, rng.randint(1, 4))}

    with redis_server() as redis:
        env = {"CACHE_URL": redis.url, "CACHE_MAX_ITEMS": "0"}
        with running_stage(stage, log_dir, env) as server:

            async def run() -> tuple[list[Answer], float, float]:
                outcomes: list[Answer] = []
                stop = asyncio.Event()
                load = asyncio.create_task(drive(server.url, workers, stop, body, outcomes))
                await asyncio.sleep(phase_s)
                killed = time.monotonic()
                await asyncio.to_thread(redis.stop)  # SIGKILL: a crash, no goodbye
                await asyncio.sleep(phase_s)
                restarted = time.monotonic()
                await asyncio.to_thread(redis.start)  # empty: persistence is off
                await asyncio.sleep(phase_s * 1.5)
                stop.set()
                await load
                return outcomes, killed, restarted

            outcomes, killed, restarted = asyncio.run(run())
            stats = httpx.get(f"{server.url}/v1/cache/metrics", timeout=10).json()["cache"]
    failed = [o for o in outcomes if o.status != 200]
    back = [o for o in outcomes if o.started > restarted + 1.5]  # the tier backs off 1 s after an error
    return {
        "stage": stage,
        "requests": len(outcomes),
        "during_outage": sum(killed <= o.started < restarted for o in outcomes),
        "failed": len(failed),
        "statuses": _statuses(outcomes),
        "redis_errors": sum(stats["errors"].values()),
        "redis_hits_after_restart": sum(o.headers.get("x-cache") in ("hit", "partial") for o in back),
        "requests_after_restart": len(back),
    }


# --- SIGTERM: drain what was admitted -----------------------------------------------------
def sigterm_drain(
    stage: str, log_dir: Path, burst: int = 12, texts_per_request: int = 24, redis_dies: bool = False
) -> dict[str, Any]:
    """SIGTERM with ``burst`` requests admitted; with ``redis_dies``, two faults at once: the
    server has a Redis tier, the texts are new (each answer is written to Redis after the model),
    and Redis is SIGKILLed right after the SIGTERM, while the drain is writing to it."""
    rng = random.Random(902)
    bodies = [
        {"inputs": [corpus.passage(rng) for _ in range(texts_per_request)], "cache": redis_dies}
        for _ in range(burst)
    ]
    with contextlib.ExitStack() as stack:
        env = {"DRAIN_TIMEOUT_S": "120"}
        redis = stack.enter_context(redis_server()) if redis_dies else None
        if redis is not None:
            env["CACHE_URL"] = redis.url
        server = stack.enter_context(running_stage(stage, log_dir, env))

        async def run() -> dict[str, Any]:
            headers = {"x-request-timeout": "300"}
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
                # --8<-- [start:gate]
                tasks = [
                    asyncio.create_task(client.post("/v1/embed", json=b, headers=headers)) for b in bodies
                ]
                # Gate on the server's own count: every burst request is inside the backend.
                admitted = await _wait_for_active(client, burst)
                signalled = time.monotonic()
                server.signal(signal.SIGTERM)
                # --8<-- [end:gate]
                if redis is not None:
                    await asyncio.to_thread(redis.stop)  # SIGKILL, mid-drain
                after = await _probe_after_signal(server.url, probes=5)
                answers = await asyncio.gather(*tasks, return_exceptions=True)
            ok = [a for a in answers if isinstance(a, httpx.Response) and a.status_code == 200]
            exit_code = await asyncio.to_thread(server.wait, 180)
            return {
                "admitted_before_sigterm": admitted,
                "answered_200": len(ok),
                "lost": burst - len(ok),
                "drain_seconds": round(time.monotonic() - signalled, 2),
                "after_sigterm": after,
                "exit_code": exit_code,
            }

        result = asyncio.run(run())
        log = server.log()
    return {
        "stage": stage,
        "burst": burst,
        "texts_per_request": texts_per_request,
        "redis_killed_during_drain": redis_dies,
        **result,
        # The cache tier logs its first failure: proof the drain met the dead Redis.
        "redis_failure_logged": "redis cache connection" in log,
        "traceback_in_log": "Traceback" in log,
    }


async def _wait_for_active(client: httpx.AsyncClient, n: int, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        active = int((await client.get("/v1/cache/metrics")).json()["active"])
        if active >= n:
            return active
        await asyncio.sleep(0.01)
    raise TimeoutError(f"only {active} of {n} requests admitted after {timeout_s} s")


async def _probe_after_signal(url: str, probes: int) -> dict[str, int]:
    """New requests after SIGTERM, each on a fresh connection: served until the listener closes
    (DRAIN_DELAY_S, 0 here), then refused (or reset unread); never a 5xx or a cut."""
    seen: Counter[str] = Counter()
    for _ in range(probes):
        async with httpx.AsyncClient(base_url=url, timeout=30) as fresh:
            try:
                r = await fresh.post("/v1/embed", json={"inputs": "after the signal"})
                seen[str(r.status_code)] += 1
            except httpx.ConnectError:
                seen["refused"] += 1
            except httpx.ReadError:
                # Connected while the listening socket was closing: the kernel had the connection in
                # the backlog, the server never accepted it, and closing the socket reset it. The
                # request was never read: a refusal too, seen from the client as a reset.
                seen["reset"] += 1
            except httpx.TransportError as exc:
                seen[type(exc).__name__] += 1
        await asyncio.sleep(0.1)
    return dict(seen)


# --- SIGKILL and restart ------------------------------------------------------------------
def _wait_for_keys(url: str, n: int, timeout_s: float = 10) -> int:
    """Redis holds ``n`` keys (the write after the answer has landed), or the count at the timeout."""
    client = redis_client.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    try:
        while (size := int(client.dbsize())) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return size
    finally:
        client.close()


def sigkill_restart(stage: str, log_dir: Path, with_redis: bool = True, n_texts: int = 40) -> dict[str, Any]:
    texts = corpus.texts(n_texts, seed=903, kind="sentence")
    pool = corpus.texts(200, seed=904, kind="sentence")

    def body(rng: random.Random) -> dict[str, Any]:
        return {"inputs": rng.sample(pool, 2)}

    with redis_server() as redis:
        # A generous Redis timeout: this scenario is about surviving a crash, and on a busy
        # machine the default 50 ms can drop the very write it wants to find afterwards.
        env = {"CACHE_URL": redis.url, "CACHE_TIMEOUT_MS": "2000"} if with_redis else {}
        server = StageProcess(stage, env, log_dir / f"{stage}-sigkill-{free_port()}.log")
        server.start()
        try:
            first = httpx.post(f"{server.url}/v1/embed", json={"inputs": texts}, timeout=120)
            first.raise_for_status()
            stored = _wait_for_keys(redis.url, n_texts) if with_redis else 0

            async def kill_under_load() -> list[Answer]:
                outcomes: list[Answer] = []
                stop = asyncio.Event()
                load = asyncio.create_task(drive(server.url, 4, stop, body, outcomes, timeout_s=10))
                await asyncio.sleep(1.5)
                server.signal(signal.SIGKILL)
                await asyncio.to_thread(server.wait, 30)
                await asyncio.sleep(0.5)
                stop.set()
                await load
                return outcomes

            during = asyncio.run(kill_under_load())
            ready_s = server.start()  # the same port, as a supervisor would restart it
            second = httpx.post(f"{server.url}/v1/embed", json={"inputs": texts}, timeout=120)
            second.raise_for_status()
        finally:
            server.stop()
    v1, v2 = np.asarray(first.json()["embeddings"]), np.asarray(second.json()["embeddings"])
    return {
        "stage": stage,
        "with_redis": with_redis,
        "requests_during_kill": len(during),
        "ready_after_restart_s": round(ready_s, 2),
        "cache_before": first.headers.get("x-cache"),
        "cache_after_restart": second.headers.get("x-cache"),
        "cache_hits_after_restart": int(second.headers.get("x-cache-hits", 0)),
        "texts": n_texts,
        "keys_in_redis_before_kill": stored,
        "same_vectors": bool(np.allclose(v1, v2, atol=1e-6)),
    }
