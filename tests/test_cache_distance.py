"""The Redis tier at a distance: bounded connections, TLS that must verify, a slow Redis bounded.

Real parts throughout: stage 4 over real sockets, a real redis-server of the test's own (plain
or TLS, with a CA made on the spot), and ``loadtests.delay_relay`` for the distance. The
measurement itself (per-command against pooled, near and far) is ``benchmarks.stage4``; its
results are checked in ``test_stage4_results.py``.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import redis
from redis_support import own_redis

from common import corpus
from loadtests.delay_relay import relay

STAGE = "stage4_cache_backpressure"


def _texts(n: int) -> list[str]:
    return corpus.texts(n, seed=random.randrange(2**31), kind="sentence")


def _embed(url: str, text: str) -> httpx.Response:
    r = httpx.post(f"{url}/v1/embed", json={"inputs": [text]}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _lookups(watch: redis.Redis) -> int:
    return int(watch.info("commandstats").get("cmdstat_mget", {}).get("calls", 0))


def _load(url: str, texts: list[str], clients: int, watch: redis.Redis) -> tuple[int, int, int]:
    """``texts`` one a request from ``clients`` threads; meanwhile Redis's own count of its
    clients, sampled. Returns (most clients connected at once, connections Redis accepted,
    lookups it answered), as Redis counts them."""
    before = int(watch.info("stats")["total_connections_received"])
    lookups = _lookups(watch)
    most, done = 0, threading.Event()

    def sample() -> None:
        nonlocal most
        while not done.is_set():
            most = max(most, int(watch.info("clients")["connected_clients"]))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(lambda t: _embed(url, t), texts))
    finally:
        done.set()
        sampler.join()
    accepted = int(watch.info("stats")["total_connections_received"]) - before
    return most, accepted, _lookups(watch) - lookups


def test_the_pooled_client_keeps_its_connections_bounded_and_per_command_does_not(
    server_factory: Any, tmp_path: Path
) -> None:
    warm = _texts(40)
    texts = warm * 3 + _texts(60)  # hits and misses, 180 requests
    random.shuffle(texts)
    with own_redis(tmp_path) as r:
        watch = redis.Redis.from_url(r.url)
        counts = {}
        for client in ("pooled", "per-command"):
            # a timeout long enough that no lookup fails open under this load: every command counts
            env = {"CACHE_URL": r.url, "CACHE_MAX_ITEMS": "0", "CACHE_TIMEOUT_MS": "2000"}
            env["CACHE_CLIENT"] = client
            with server_factory(STAGE, env) as server:
                for text in warm:
                    _embed(server.url, text)
                counts[client] = _load(server.url, texts, 32, watch)
    most, accepted, lookups = counts["pooled"]
    assert lookups >= len(texts) // 2, counts  # Redis was in the path (followers of a text in flight are not)
    assert most <= 32 + 1, counts  # the pool's bound (32), and our own watching connection
    assert accepted <= 32, counts  # the same connections, reused
    # the lesson's client: a new connection for every command
    _, accepted, lookups = counts["per-command"]
    assert lookups >= len(texts) // 2 and accepted >= lookups, counts


def test_a_certificate_that_does_not_verify_is_said_at_startup_and_the_tier_is_off(
    server_factory: Any, tmp_path: Path
) -> None:
    text = _texts(1)[0]
    with own_redis(tmp_path, tls=True) as r:
        assert r.url.startswith("rediss://") and r.ca_file is not None
        with server_factory(STAGE, {"CACHE_URL": r.url, "CACHE_MAX_ITEMS": "0"}) as server:
            log = server.log()
            assert "TLS certificate does not verify" in log and "set CACHE_CA_FILE" in log
            assert [_embed(server.url, text).headers["x-cache"] for _ in range(2)] == ["miss", "miss"]
            assert log.count("does not verify") == 1 and "answering from the model" not in server.log()
        # with the CA that signed it: the same Redis over TLS serves hits
        env = {"CACHE_URL": r.url, "CACHE_MAX_ITEMS": "0", "CACHE_CA_FILE": str(r.ca_file)}
        with server_factory(STAGE, env) as server:
            assert _embed(server.url, text).headers["x-cache"] == "miss"
            time.sleep(0.2)  # the write goes behind the answer
            assert _embed(server.url, text).headers["x-cache"] == "hit"
            assert "does not verify" not in server.log()


def test_a_slow_redis_adds_at_most_the_timeout_to_a_request(server_factory: Any, tmp_path: Path) -> None:
    """A Redis 300 ms away, at the default CACHE_TIMEOUT_MS: sent in turns to this server and to one
    without a cache, the same new text costs the first at most the timeout more beyond its model
    time, give or take how much a request's time varies on the second (the bound is wall-clock
    time on the event loop). The lookups did wait for the bound: the server counted timeouts."""
    with own_redis(tmp_path) as r, relay(r.port, 300) as port:
        far = {"CACHE_URL": f"redis://127.0.0.1:{port}/0"}
        with server_factory(STAGE, far) as slow, server_factory(STAGE, {"CACHE_ENABLED": "false"}) as plain:
            timeout_ms = httpx.get(f"{slow.url}/v1/cache/metrics").json()["config"]["redis"]["timeout_ms"]
            total: dict[str, list[float]] = {"slow": [], "plain": []}  # x-total-time
            beyond: dict[str, list[float]] = {"slow": [], "plain": []}  # ... less x-inference-time
            for text in _texts(12):
                for name, server in (("slow", slow), ("plain", plain)):
                    headers = _embed(server.url, text).headers  # a 200: never an error
                    total[name].append(float(headers["x-total-time"]))
                    beyond[name].append(total[name][-1] - float(headers["x-inference-time"]))
            timeouts = httpx.get(f"{slow.url}/v1/cache/metrics").json()["cache"]["errors"].get("timeout", 0)
    assert timeouts >= 3, timeouts  # three in a row, then the tier backs off
    added = [s - p for s, p in zip(beyond["slow"], beyond["plain"], strict=True)]
    jitter = max(total["plain"]) - min(total["plain"])
    assert max(added) <= timeout_ms + jitter, (timeout_ms, jitter, added)
