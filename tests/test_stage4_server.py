"""Stage 4 over real sockets: real uvicorn processes, the real model, a real Redis.

Orderings and counts are asserted, not time budgets; the one exception is "no hang", which
is an upper bound of minutes.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import orjson
import pytest

from common import corpus
from common.engine import Engine

STAGE = "stage4_cache_backpressure"
pytestmark = pytest.mark.timeout(300)


def _new(n: int, kind: str = "sentence") -> list[str]:
    return corpus.texts(n, seed=time.time_ns() % 2**31, kind=kind)


def _agree(engine: Engine, texts: list[str], got: Any) -> None:
    """Dynamic INT8 depends a little on batch mates, so compare by cosine (as tests/test_batcher.py)."""
    want = engine.embed(texts).vectors
    cosine = (np.asarray(got, dtype=np.float32) * want).sum(axis=1)
    assert cosine.min() > 0.97, cosine


def _metrics(url: str, route: str = "/v1/cache/metrics") -> dict[str, Any]:
    return dict(httpx.get(url + route, timeout=10).json())


def _wait(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _embed(url: str, inputs: Any, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/embed", json={"inputs": inputs, **body}, headers=headers, timeout=120)


# --- the cache, seen from a client ----------------------------------------------------
def test_x_cache_header_and_both_opt_outs(stage_server: Any, engine: Engine) -> None:
    url = stage_server(STAGE).url
    assert _metrics(url)["config"]["redis"] is None  # `make stage4`: the in-process cache only
    a, b, c = _new(3)
    first = _embed(url, [a, b])
    assert (first.headers["x-cache"], first.headers["x-cache-misses"]) == ("miss", "2")
    partial = _embed(url, [a, c])
    assert partial.headers["x-cache"] == "partial"
    assert (partial.headers["x-cache-hits"], partial.headers["x-cache-misses"]) == ("1", "1")
    hit = _embed(url, [a, c])
    assert hit.headers["x-cache"] == "hit" and float(hit.headers["x-inference-time"]) == 0.0
    assert hit.json()["embeddings"][0] == first.json()["embeddings"][0]
    _agree(engine, [a, c], hit.json()["embeddings"])
    assert _embed(url, [a], cache=False).headers["x-cache"] == "bypass"
    assert _embed(url, [a], headers={"Cache-Control": "no-cache"}).headers["x-cache"] == "bypass"
    openai = httpx.post(f"{url}/v1/embeddings", json={"input": [a]}, timeout=60)
    assert openai.status_code == 200 and openai.headers["x-cache"] == "hit"
    assert openai.json()["usage"]["prompt_tokens"] == engine.tokenize([a])[0].n_tokens  # from the entry


def test_fifty_concurrent_requests_for_one_new_text_run_the_model_once(
    stage_server: Any, engine: Engine
) -> None:
    url = stage_server(STAGE).url
    (text,) = _new(1)
    before = _metrics(url, "/v1/batcher/metrics")["texts"]

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=50), timeout=120) as client:
            return await asyncio.gather(
                *(client.post(f"{url}/v1/embed", json={"inputs": text}) for _ in range(50))
            )

    responses = asyncio.run(fire())
    assert [r.status_code for r in responses] == [200] * 50
    assert _metrics(url, "/v1/batcher/metrics")["texts"] - before == 1
    vectors = {orjson.dumps(r.json()["embeddings"]) for r in responses}
    assert len(vectors) == 1
    _agree(engine, [text], responses[0].json()["embeddings"])


# --- deadlines and disconnects ----------------------------------------------------------
class _Blocker:
    """Batches of long passages that keep every model slot busy for a while (cache bypassed): one
    batch in each slot and ``behind`` more in the queue, so that what comes next waits behind
    several batches however fast the machine runs one."""

    def __init__(self, url: str, n: int = 32, behind: int = 2) -> None:
        self.slots = int(_metrics(url, "/v1/batcher/config")["batch_concurrency"])
        self.url = url
        self.requests = [_new(n, kind="passage") for _ in range(self.slots + behind)]
        self.texts = [t for texts in self.requests for t in texts]
        self.waiting = n * behind  # texts not in a slot
        self.before = _metrics(url, "/v1/batcher/metrics")["texts"]
        self.result: list[httpx.Response] = []

    def __enter__(self) -> _Blocker:
        import threading

        self.threads = [
            threading.Thread(target=lambda t=texts: self.result.append(_embed(self.url, t, cache=False)))
            for texts in self.requests
        ]
        for thread in self.threads:
            thread.start()
        _wait(
            lambda: (
                _metrics(self.url, "/v1/batcher/metrics")["in_flight"] == self.slots
                and _metrics(self.url)["queue_depth"] >= self.waiting
            )
        )
        return self

    def __exit__(self, *exc: object) -> None:
        for thread in self.threads:
            thread.join(timeout=240)
        assert len(self.result) == len(self.requests) and all(r.status_code == 200 for r in self.result)

    def texts_run_since(self) -> int:
        return int(_metrics(self.url, "/v1/batcher/metrics")["texts"]) - int(self.before)


def test_deadline_passing_in_the_queue_is_504_and_never_reaches_the_model(stage_server: Any) -> None:
    url = stage_server(STAGE).url
    before = _metrics(url)["deadline_exceeded"]
    with _Blocker(url) as blocker:
        late = _embed(url, _new(1), headers={"X-Request-Timeout": "0.05"})
    assert late.status_code == 504
    assert late.json()["error"]["type"] == "timeout_error"
    assert blocker.texts_run_since() == len(blocker.texts)  # the late text was dropped before the model
    assert _metrics(url)["deadline_exceeded"] == before + 1


def test_client_that_disconnects_is_dropped_before_inference(stage_server: Any) -> None:
    url = stage_server(STAGE).url
    before = _metrics(url)["disconnects"]
    host, port = urlsplit(url).hostname, urlsplit(url).port
    body = orjson.dumps({"inputs": _new(1)})
    with _Blocker(url) as blocker:
        sock = socket.create_connection((host, port))
        sock.sendall(
            b"POST /v1/embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        _wait(lambda: _metrics(url)["active"] == len(blocker.requests) + 1)  # in, behind the blocker
        sock.close()
        _wait(lambda: _metrics(url)["disconnects"] == before + 1)
    assert blocker.texts_run_since() == len(blocker.texts)
    assert _embed(url, ["still fine"]).status_code == 200


def test_client_leaving_mid_body_is_no_server_error(stage_server: Any) -> None:
    server = stage_server(STAGE)
    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.sendall(b"POST /v1/embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        sock.sendall(b'Content-Length: 1000\r\n\r\n{"inputs": "only part of')
        time.sleep(0.2)
    assert _embed(server.url, ["after a broken upload"]).status_code == 200
    assert "Exception in ASGI application" not in server.log()


# --- overload ---------------------------------------------------------------------------
def test_overload_503s_without_model_work_correct_200s_no_500_and_healthy_after(
    server_factory: Any, engine: Engine
) -> None:
    """The overload experiment: queue capped at 5, 300 requests at concurrency 200.

    One passage per request, so the model is the bottleneck on any machine, however fast.
    """
    texts = _new(300, kind="passage")
    with server_factory(STAGE, {"MAX_QUEUE": "5"}) as server:
        url = server.url
        model_texts_before = _metrics(url, "/v1/batcher/metrics")["texts"]

        async def fire() -> list[tuple[int, float, httpx.Response]]:
            gate = asyncio.Semaphore(200)
            # One connection per request: 300 independent clients.
            limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
            async with httpx.AsyncClient(limits=limits, timeout=120) as client:

                async def one(text: str) -> tuple[int, float, httpx.Response]:
                    async with gate:
                        started = time.perf_counter()
                        response = await client.post(f"{url}/v1/embed", json={"inputs": [text]})
                        return response.status_code, time.perf_counter() - started, response

                return await asyncio.wait_for(asyncio.gather(*(one(t) for t in texts)), timeout=240)

        results = asyncio.run(fire())
        statuses = [s for s, _, _ in results]
        assert set(statuses) <= {200, 503}, sorted(set(statuses))
        ok = [(t, r) for t, (s, _, r) in zip(texts, results, strict=True) if s == 200]
        refused = [(lat, r) for s, lat, r in results if s == 503]
        # Many are refused and the queue still serves. How many of each depends on how fast the
        # event loop accepts 200 connections on this machine (a third to a half refused here), so
        # the share is only bounded below; what is exact is the model work, checked at the end.
        assert len(refused) >= len(texts) // 10 and len(ok) > 0, (len(refused), len(ok))
        for _, response in refused:
            assert int(response.headers["Retry-After"]) >= 1
            assert response.json()["error"]["type"] == "overloaded_error"
        _agree(engine, [t for t, _ in ok], [r.json()["embeddings"][0] for _, r in ok])
        # A 503 is decided at the door and costs no model work: the model ran exactly the texts
        # of the requests it answered. (Not "faster than a 200" on any clock: with 200
        # connections on two cores the event loop itself is the queue, and refused and served
        # requests wait their turn on it alike; docs/stage4.md shows both clocks.)
        assert _metrics(url, "/v1/batcher/metrics")["texts"] - model_texts_before == len(ok)
        assert server.process.poll() is None
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert _embed(url, _new(1)).status_code == 200
        assert _metrics(url)["rejected"] == len(refused)


# --- Redis: shared hits, failure, recovery ------------------------------------------------
def test_two_servers_share_hits_through_one_redis(server_factory: Any, redis_url: str) -> None:
    env = {"CACHE_URL": redis_url}
    with server_factory(STAGE, env) as one, server_factory(STAGE, env) as two:
        texts = _new(2)
        first = _embed(one.url, texts)
        second = _embed(two.url, texts)
        assert first.headers["x-cache"] == "miss" and second.headers["x-cache"] == "hit"
        assert second.json()["embeddings"] == first.json()["embeddings"]
        assert _metrics(two.url)["cache"]["hits"]["redis"] == 2


def test_redis_stopped_mid_load_fails_open_and_recovers(
    server_factory: Any, private_redis: Any, engine: Engine
) -> None:
    env = {"CACHE_URL": private_redis.url, "CACHE_MAX_ITEMS": "0"}  # every lookup goes to Redis
    pool = _new(8)
    rng = np.random.default_rng(0)
    with server_factory(STAGE, env) as server:
        for step in range(60):
            if step == 20:
                private_redis.stop()
            if step == 40:
                private_redis.start()  # same port, empty
            text = pool[int(rng.integers(len(pool)))]
            response = _embed(server.url, [text])
            assert response.status_code == 200, response.text
            _agree(engine, [text], response.json()["embeddings"])
        metrics = _metrics(server.url)
        assert metrics["cache"]["errors"].get("connection", 0) >= 1
        (probe,) = _new(1)
        _embed(server.url, [probe])

        def hit_again() -> bool:
            return _embed(server.url, [probe]).headers["x-cache"] == "hit"

        _wait(hit_again, timeout=20)  # Redis serves hits again without a restart of the server
        log = server.log()
        assert 1 <= log.count("answering from the model") <= 3  # rate limited, not one per request


# --- graceful drain --------------------------------------------------------------------------
def test_sigterm_finishes_every_admitted_request_and_closes_the_pool(
    server_factory: Any, redis_url: str, engine: Engine
) -> None:
    drain_timeout = 20
    env = {"CACHE_URL": redis_url, "DRAIN_TIMEOUT_S": str(drain_timeout)}
    batches = [_new(8, kind="passage") for _ in range(8)]
    with server_factory(STAGE, env) as server:
        url = server.url

        async def during() -> tuple[list[httpx.Response], float]:
            async with httpx.AsyncClient(timeout=120) as client:
                tasks = [
                    asyncio.ensure_future(client.post(f"{url}/v1/embed", json={"inputs": b})) for b in batches
                ]
                while _metrics(url)["active"] < len(batches):
                    assert not any(t.done() for t in tasks), "a request finished before SIGTERM"
                    await asyncio.sleep(0.01)
                server.process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                responses = await asyncio.gather(*tasks)
                return responses, signalled

        responses, signalled = asyncio.run(during())
        assert [r.status_code for r in responses] == [200] * len(batches)
        for texts, response in zip(batches, responses, strict=True):
            _agree(engine, texts, response.json()["embeddings"])
        server.process.wait(timeout=drain_timeout + 10)
        assert time.monotonic() - signalled < drain_timeout
        assert server.process.returncode in (0, -signal.SIGTERM)
        log = server.log()
        assert "draining" in log and "redis cache pool closed" in log
        assert log.index("draining") < log.index("redis cache pool closed")


def test_the_drain_delay_keeps_serving_with_readiness_503_then_stops_accepting(server_factory: Any) -> None:
    """DRAIN_DELAY_S: after SIGTERM the server answers /ready with 503 and still serves requests,
    so a load balancer that probes every few seconds sees the 503 before anything is refused; then
    it stops accepting and exits. A probe every 0.1 s, each on a fresh connection, as a balancer."""
    delay = 3.0
    with server_factory(STAGE, {"DRAIN_DELAY_S": str(delay)}) as server:
        assert httpx.get(f"{server.url}/ready").status_code == 200
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        seen: list[tuple[float, str, str]] = []  # (seconds after the signal, /ready, /v1/embed)
        while server.process.poll() is None and time.monotonic() - signalled < delay + 10:
            outcome = []
            for probe in (lambda: httpx.get(f"{server.url}/ready", timeout=5),
                          lambda: _embed(server.url, [_new(1)[0]])):  # fmt: skip
                try:
                    outcome.append(str(probe().status_code))
                except httpx.TransportError:
                    outcome.append("refused")
            seen.append((time.monotonic() - signalled, *outcome))
            time.sleep(0.1)
        server.process.wait(timeout=10)
    during = [(ready, embed) for t, ready, embed in seen if t < delay - 0.5]
    after = [(ready, embed) for t, ready, embed in seen if t > delay + 1.0]
    assert len(during) >= 3 and set(during) == {("503", "200")}, seen
    assert all(ready == "refused" for ready, _ in after), seen
    assert time.monotonic() - signalled < delay + 10


def test_ctrl_c_skips_the_drain_delay(server_factory: Any) -> None:
    with server_factory(STAGE, {"DRAIN_DELAY_S": "30"}) as server:
        server.process.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        server.process.wait(timeout=15)
    assert time.monotonic() - signalled < 10


@pytest.mark.parametrize("status", ["503", "429"])  # the default, and OVERLOAD_STATUS=429 as operators set it
def test_a_full_queue_refuses_unread_after_the_shed_delay(server_factory: Any, status: str) -> None:
    """While the queue is full, a request is refused before its body is read (shed.py): the client
    here sends its headers and never the body it announces, and still gets its OVERLOAD_STATUS,
    after SHED_DELAY_MS, in the API's error shape, with Retry-After."""
    import threading

    env = {"MAX_QUEUE": "4", "SHED_DELAY_MS": "200", "BATCH_CONCURRENCY": "1", "OVERLOAD_STATUS": status}
    with server_factory(STAGE, env) as server:
        url = server.url
        before = _metrics(url)["rejected"]
        host, port = urlsplit(url).hostname, urlsplit(url).port
        blockers = [_new(32, kind="passage"), _new(8, kind="passage")]  # the slot, the queue behind it
        answers: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda b=b: answers.append(_embed(url, b))) for b in blockers]
        threads[0].start()
        _wait(lambda: _metrics(url, "/v1/batcher/metrics")["in_flight"] == 1)
        threads[1].start()
        _wait(lambda: _metrics(url)["queue_depth"] >= 4)  # full
        with socket.create_connection((host, port), timeout=30) as sock:
            started = time.monotonic()
            sock.sendall(
                b"POST /v1/embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n"  # ... and not a byte of it
            )
            data = b""
            while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
                re.search(rb"content-length: (\d+)", data.lower()).group(1)  # type: ignore[union-attr]
            ):
                data += sock.recv(65536)
                if b"\r\n\r\n" in data and b"content-length" not in data.lower():
                    break
            waited = time.monotonic() - started
            head, _, body = data.partition(b"\r\n\r\n")
        for thread in threads:
            thread.join(timeout=240)
        assert [r.status_code for r in answers] == [200, 200]
        lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        assert lines[0].split(" ")[1] == status
        assert 0.15 <= waited < 5.0  # SHED_DELAY_MS (asyncio's timers may fire a hair early)
        assert int(headers["retry-after"]) >= 1
        assert orjson.loads(body)["error"]["type"] == "overloaded_error"
        assert _metrics(url)["rejected"] == before + 1
