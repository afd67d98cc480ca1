"""Faults injected under load, against the stages that have a cache and a drain (4 and 5).

* Redis SIGKILLed and restarted, with the memory tier off (CACHE_MAX_ITEMS=0) so that every request
  goes through Redis: no request fails (the tier fails open), and Redis serves hits again after it
  is back.
* SIGTERM with a burst of slow requests admitted (the server says so in ``/v1/cache/metrics``):
  every admitted request gets its 200; a request sent after the signal is served or refused at the
  door, never cut off. With ``redis_dies``, Redis is SIGKILLed during that drain too: two faults.
* SIGKILL under load, then a restart on the same port: ready again, and with Redis the texts
  embedded before the crash are hits with the same vectors.

Every Redis here is a private redis-server on a spare port; the shared one is never touched. Each
test records what it saw (``observe``) for ``python -m benchmarks.reliability``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis as redis_client
from conftest import SERVER_STAGES

from common import corpus
from loadtests.procs import StageProcess, redis_server, running_stage, wait_until

STAGES = [s for s in SERVER_STAGES if s in ("stage4_cache_backpressure", "stage5_metrics")]
PHASE_S = 2.0  # Redis up, down, then back (1.5 x): the load runs through all three
BURST, TEXTS = 8, 12  # the SIGTERM burst: requests of TEXTS passages each, slow enough to be in flight


def test_the_fault_stages_exist() -> None:
    assert STAGES == ["stage4_cache_backpressure", "stage5_metrics"]


@dataclass
class Outcome:
    status: int  # 0: no answer (refused, reset)
    started: float  # time.monotonic() when it was sent
    cache: str | None  # the x-cache header


async def load(url: str, workers: int, stop: asyncio.Event, bodies: list[Any], out: list[Outcome]) -> None:
    """Closed-loop clients until ``stop``, each sending its next body when the last is answered;
    a request with no answer is an Outcome with status 0, counted, never raised."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def worker(n: int) -> None:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    r = await client.post("/v1/embed", json=bodies[n % len(bodies)])
                    out.append(Outcome(r.status_code, started, r.headers.get("x-cache")))
                except httpx.TransportError:
                    out.append(Outcome(0, started, None))
                    await asyncio.sleep(0.05)  # a refused connection fails at once: do not spin
                n += workers

        await asyncio.gather(*(worker(i) for i in range(workers)))


@pytest.mark.parametrize("stage", STAGES)
async def test_redis_killed_and_restarted_under_load(
    stage: str, tmp_path: Path, observe: Callable[..., None]
) -> None:
    pool, rng = corpus.texts(120, seed=901, kind="sentence"), random.Random(0)
    bodies = [{"inputs": rng.sample(pool, rng.randint(1, 4))} for _ in range(2000)]
    outcomes: list[Outcome] = []
    with (
        redis_server() as redis,
        running_stage(stage, tmp_path, {"CACHE_URL": redis.url, "CACHE_MAX_ITEMS": "0"}) as server,
    ):
        stop = asyncio.Event()
        sending = asyncio.create_task(load(server.url, 6, stop, bodies, outcomes))
        await asyncio.sleep(PHASE_S)
        killed = time.monotonic()
        await asyncio.to_thread(redis.stop)  # SIGKILL: a crash, no goodbye
        await asyncio.sleep(PHASE_S)
        restarted = time.monotonic()
        await asyncio.to_thread(redis.start)  # empty: persistence is off
        await asyncio.sleep(PHASE_S * 1.5)
        stop.set()
        await sending
        async with httpx.AsyncClient(base_url=server.url) as client:
            errors = (await client.get("/v1/cache/metrics")).json()["cache"]["errors"]
    back = [o for o in outcomes if o.started > restarted + 1.5]  # the tier backs off 1 s after an error
    failed = sum(o.status != 200 for o in outcomes)
    during = sum(killed <= o.started < restarted for o in outcomes)
    hits = sum(o.cache in ("hit", "partial") for o in back)
    observe(stage=stage, requests=len(outcomes), during_outage=during, failed=failed,
            redis_errors=sum(errors.values()), hits_after_restart=hits)  # fmt: skip
    assert failed == 0, Counter(o.status for o in outcomes)
    assert during > 0, "no request was sent while Redis was down"
    assert sum(errors.values()) > 0, "the outage was not noticed: was Redis in the path at all?"
    assert hits > 0, "Redis never served again after its restart"


async def _wait_for_active(client: httpx.AsyncClient, n: int, timeout_s: float = 120) -> int:
    """The server's own count of requests inside the backend, once it reaches ``n``."""
    async with asyncio.timeout(timeout_s):
        while (active := int((await client.get("/v1/cache/metrics")).json()["active"])) < n:
            await asyncio.sleep(0.01)
    return active


async def _probe_after_signal(url: str, probes: int = 5) -> dict[str, int]:
    """New requests after SIGTERM, each on a fresh connection: served until the listener closes
    (DRAIN_DELAY_S, 0 here), then refused (or reset unread); never a 5xx or a cut."""
    seen: Counter[str] = Counter()
    for _ in range(probes):
        async with httpx.AsyncClient(base_url=url, timeout=30) as fresh:
            try:
                seen[
                    str((await fresh.post("/v1/embed", json={"inputs": "after the signal"})).status_code)
                ] += 1
            except httpx.ConnectError:
                seen["refused"] += 1
            except httpx.ReadError:
                # Connected while the listening socket was closing: the kernel had the connection in
                # its backlog, the server never accepted it, and closing the socket reset it. The
                # request was never read: a refusal too, seen from the client as a reset.
                seen["reset"] += 1
        await asyncio.sleep(0.1)
    return dict(seen)


@pytest.mark.parametrize("redis_dies", [False, True], ids=["alone", "redis-dies"])
@pytest.mark.parametrize("stage", STAGES)
async def test_sigterm_loses_no_admitted_request(
    stage: str, redis_dies: bool, tmp_path: Path, observe: Callable[..., None]
) -> None:
    """With ``redis_dies`` the server has a Redis tier, the texts are new (each answer is written to
    Redis after the model) and Redis is SIGKILLed right after the SIGTERM, while the drain writes."""
    rng = random.Random(902)
    bodies = [
        {"inputs": [corpus.passage(rng) for _ in range(TEXTS)], "cache": redis_dies} for _ in range(BURST)
    ]
    with contextlib.ExitStack() as stack:
        env = {"DRAIN_TIMEOUT_S": "120"}
        redis = stack.enter_context(redis_server()) if redis_dies else None
        if redis is not None:
            env["CACHE_URL"] = redis.url
        server = stack.enter_context(running_stage(stage, tmp_path, env))
        headers = {"x-request-timeout": "300"}
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            # --8<-- [start:gate]
            tasks = [asyncio.create_task(client.post("/v1/embed", json=b, headers=headers)) for b in bodies]
            # Gate on the server's own count: every burst request is inside the backend.
            admitted = await _wait_for_active(client, BURST)
            signalled = time.monotonic()
            server.signal(signal.SIGTERM)
            # --8<-- [end:gate]
            if redis is not None:
                await asyncio.to_thread(redis.stop)  # SIGKILL, mid-drain
            after = await _probe_after_signal(server.url)
            answers = await asyncio.gather(*tasks, return_exceptions=True)
        drain_s = time.monotonic() - signalled
        exit_code = await asyncio.to_thread(server.wait, 180)
        log = server.log()
    ok = sum(isinstance(a, httpx.Response) and a.status_code == 200 for a in answers)
    observe(stage=stage, redis_dies=redis_dies, burst=BURST, lost=BURST - ok,
            drain_s=round(drain_s, 2), after_sigterm=after)  # fmt: skip
    assert admitted >= BURST
    assert ok == BURST, answers
    # After the signal: served in the moment before the listener closes, then refused at the door.
    assert set(after) <= {"200", "refused", "reset", "503"}, after
    assert exit_code in (0, -15)  # uvicorn re-raises SIGTERM after a clean drain
    assert "Traceback" not in log
    if redis_dies:  # the cache tier logs its first failure: proof that the drain met the dead Redis
        assert "redis cache connection" in log


@pytest.mark.parametrize(("stage", "with_redis"), [(s, True) for s in STAGES] + [(STAGES[-1], False)])
async def test_sigkill_and_restart(
    stage: str, with_redis: bool, tmp_path: Path, observe: Callable[..., None]
) -> None:
    """With Redis the server comes back warm (the memory tier died, Redis did not); without, cold."""
    texts = corpus.texts(40, seed=903, kind="sentence")
    pool, rng = corpus.texts(200, seed=904, kind="sentence"), random.Random(0)
    bodies = [{"inputs": rng.sample(pool, 2)} for _ in range(2000)]
    outcomes: list[Outcome] = []
    with redis_server() as redis:
        # A generous Redis timeout: this is about surviving a crash, and on a busy machine the
        # default 50 ms can drop the very write it wants to find afterwards.
        env = {"CACHE_URL": redis.url, "CACHE_TIMEOUT_MS": "2000"} if with_redis else {}
        server = StageProcess(stage, env, tmp_path / f"{stage}.log")
        server.start()
        try:
            first = httpx.post(f"{server.url}/v1/embed", json={"inputs": texts}, timeout=120)
            if with_redis:  # the write behind the answer has landed
                keys = redis_client.Redis.from_url(redis.url)
                wait_until(lambda: int(keys.dbsize()) >= len(texts), 10, 0.02)
                keys.close()
            stop = asyncio.Event()
            sending = asyncio.create_task(load(server.url, 4, stop, bodies, outcomes))
            await asyncio.sleep(1.5)
            server.signal(signal.SIGKILL)
            await asyncio.to_thread(server.wait, 30)
            stop.set()
            await sending
            ready_s = await asyncio.to_thread(server.start)  # the same port, as a supervisor restarts it
            second = httpx.post(f"{server.url}/v1/embed", json={"inputs": texts}, timeout=120)
        finally:
            server.stop()
    hits = int(second.headers.get("x-cache-hits", 0))
    observe(stage=stage, with_redis=with_redis, requests_during_kill=len(outcomes),
            ready_after_restart_s=round(ready_s, 2), hits_after_restart=hits, texts=len(texts))  # fmt: skip
    assert first.status_code == second.status_code == 200
    assert len(outcomes) > 0
    assert first.headers["x-cache"] == "miss"
    assert second.headers["x-cache"] == ("hit" if with_redis else "miss"), second.headers
    assert hits == (len(texts) if with_redis else 0)
    v1, v2 = np.asarray(first.json()["embeddings"]), np.asarray(second.json()["embeddings"])
    assert np.allclose(v1, v2, atol=1e-6)
