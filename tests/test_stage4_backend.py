"""Stage 4's backend in-process, with the real INT8 engine and stage 3's real batcher.

The model is gated (a ``threading.Event`` in front of the real ``Engine.run``) where a test
needs the model busy, so orderings are decided by the test, not by timing.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import numpy as np
import pytest
from exercise_pieces import cache_backend

from common.api import EmbedJob, create_app
from common.engine import Engine, TokenizedText
from common.limits import APIError
from common.settings import Settings
from stage3_batching.backend import make_batcher

CacheBackend = cache_backend()  # stage 4's; with EXERCISE=1 holding your pieces (exercises/stage4_...)


class GatedEngine:
    """The real engine, whose model calls wait for ``gate`` (set by default) and are counted,
    and whose tokenizer calls are counted too (``tokenized``: the texts of each call)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[int] = []
        self.tokenized: list[list[str]] = []

    def tokenize(self, texts: Sequence[str]) -> list[TokenizedText]:
        self.tokenized.append(list(texts))
        return self._engine.tokenize(texts)

    def run(self, token_ids: Sequence[np.ndarray]) -> np.ndarray:
        self.gate.wait(timeout=60)
        self.calls.append(len(token_ids))
        return self._engine.run(token_ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _job(engine: Engine, texts: list[str], deadline: float | None = None, **kw: Any) -> EmbedJob:
    return EmbedJob(texts=texts, deadline=deadline, **kw)


def _new(text: str) -> str:
    return f"{text} ({time.time_ns()})"


@pytest.fixture
async def make(engine: Engine) -> AsyncIterator[Any]:
    started: list[tuple[CacheBackend, GatedEngine]] = []

    async def factory(**settings: Any) -> tuple[CacheBackend, GatedEngine]:
        gated = GatedEngine(engine)
        # One model slot: these tests hold the gate to keep work queued behind one batch.
        s = Settings(**{"batch_concurrency": 1, **settings})
        backend = CacheBackend(gated, make_batcher(gated, s), s)  # type: ignore[arg-type]
        await backend.start()
        started.append((backend, gated))
        return backend, gated

    yield factory
    for backend, gated in started:
        gated.gate.set()
        await backend.close()


async def _until(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def _expected(engine: Engine, texts: list[str]) -> np.ndarray:
    return engine.embed(texts).vectors


# --- the cache in front of the batcher -----------------------------------------------
async def test_second_request_is_a_memory_hit_and_matches_the_model(make: Any, engine: Engine) -> None:
    backend, gated = await make()
    texts = [_new("the cat sat on the mat"), _new("a dog barks")]
    first = await backend.embed(_job(engine, texts))
    second = await backend.embed(_job(engine, texts))
    partial = await backend.embed(_job(engine, [texts[0], _new("fresh text")]))
    assert first.cache_hits == 0 and second.cache_hits == 2  # typed fields, not headers
    assert partial.cache_hits == 1 and not partial.cache_bypassed
    assert np.allclose(second.vectors, _expected(engine, texts), atol=1e-5)
    assert np.array_equal(first.vectors, second.vectors)
    assert sum(gated.calls) == 3  # two texts, then one fresh text; the hits never reached the model


def _long(engine: Engine) -> str:
    """A new text past the model's token limit (cut when `truncate` is true)."""
    return _new("word " * (engine.max_tokens + 20))


async def test_a_hit_never_runs_the_tokenizer_and_keeps_usage_and_truncated(
    make: Any, engine: Engine
) -> None:
    backend, gated = await make()
    texts = [_new("a short text"), _long(engine)]
    first = await backend.embed(_job(engine, texts))
    assert gated.tokenized == [texts]
    want = engine.tokenize(texts)
    assert first.n_tokens == [t.n_tokens for t in want] and first.truncated == [False, True]
    hit = await backend.embed(_job(engine, texts))
    assert hit.cache_hits == 2 and gated.tokenized == [texts]  # all hits: the tokenizer never ran
    assert hit.n_tokens == first.n_tokens and hit.truncated == [False, True]  # usage, `truncated`
    assert hit.n_tokens[1] == engine.max_tokens
    fresh = _new("one miss")
    partial = await backend.embed(_job(engine, [texts[1], fresh, texts[0]]))
    assert gated.tokenized == [texts, [fresh]]  # only the miss is tokenized
    assert partial.n_tokens == [hit.n_tokens[1], engine.tokenize([fresh])[0].n_tokens, hit.n_tokens[0]]
    assert partial.truncated == [True, False, False]


async def test_truncate_false_is_422_for_a_cached_text_that_was_cut(make: Any, engine: Engine) -> None:
    backend, gated = await make()
    texts = [_new("fits"), _long(engine)]
    await backend.embed(_job(engine, texts))
    calls, tokenized = list(gated.calls), list(gated.tokenized)
    with pytest.raises(APIError) as err:
        await backend.embed(_job(engine, texts, truncate=False))
    assert err.value.status == 422 and err.value.param == "inputs[1]"
    assert "truncate" in err.value.message
    assert gated.calls == calls and gated.tokenized == tokenized  # answered from the cache's entry
    ok = await backend.embed(_job(engine, texts[:1], truncate=False))  # a cached text that fits is fine
    assert ok.cache_hits == 1 and ok.truncated == [False]


async def test_follower_of_a_leader_refused_for_truncate_false_retries(make: Any, engine: Engine) -> None:
    """The leader's 422 is about its own `truncate: false`; the follower (truncate allowed) is
    answered. A text this long is tokenized in a thread, so the follower joins meanwhile."""
    backend, gated = await make()
    text = _new("many words " * 1000)
    assert len(text) > 8_000
    leader = asyncio.ensure_future(backend.embed(_job(engine, [text], truncate=False)))
    follower = asyncio.ensure_future(backend.embed(_job(engine, [text])))
    with pytest.raises(APIError) as err:
        await leader
    assert err.value.status == 422
    result = await follower
    assert result.truncated == [True] and result.n_tokens == [engine.max_tokens]
    assert np.allclose(result.vectors, _expected(engine, [text]), atol=1e-5)
    assert backend.stats.deduplicated == 1 and gated.calls == [1]


async def test_normalize_flag_is_part_of_the_key(make: Any, engine: Engine) -> None:
    backend, _ = await make()
    text = [_new("normalize me")]
    unit = await backend.embed(_job(engine, text))
    raw = await backend.embed(_job(engine, text, normalize=False))
    assert raw.cache_hits == 0
    assert np.isclose(np.linalg.norm(unit.vectors[0]), 1.0) and not np.isclose(
        np.linalg.norm(raw.vectors[0]), 1.0
    )


async def test_opt_out_skips_the_cache_but_refreshes_it(make: Any, engine: Engine) -> None:
    backend, gated = await make()
    text = [_new("opt out")]
    await backend.embed(_job(engine, text))
    bypass = await backend.embed(_job(engine, text, use_cache=False))
    assert bypass.cache_bypassed and sum(gated.calls) == 2
    assert backend.stats.bypassed == 1


async def test_cache_disabled_runs_the_model_every_time(make: Any, engine: Engine) -> None:
    backend, gated = await make(cache_enabled=False)
    text = [_new("no cache at all")]
    for _ in range(2):
        assert (await backend.embed(_job(engine, text))).cache_bypassed
    assert gated.calls == [1, 1] and backend.stats.bypassed == 0  # only client opt-outs are counted


# --- single-flight ------------------------------------------------------------------
async def test_fifty_concurrent_requests_for_one_new_text_run_the_model_once(
    make: Any, engine: Engine
) -> None:
    backend, gated = await make()
    gated.gate.clear()  # hold the first computation until all 50 have arrived
    text = [_new("one popular new text")]
    tasks = [asyncio.ensure_future(backend.embed(_job(engine, text))) for _ in range(50)]
    await _until(lambda: backend.stats.active == 50)
    gated.gate.set()
    results = await asyncio.gather(*tasks)
    assert gated.calls == [1]  # one model call, one text
    assert backend.stats.deduplicated == 49
    for result in results:
        assert np.array_equal(result.vectors, results[0].vectors)
    assert np.allclose(results[0].vectors, _expected(engine, text), atol=1e-5)
    assert len(backend.flights) == 0  # resolved: the next miss of the text leads again


async def test_a_resolved_key_is_no_longer_in_flight(make: Any) -> None:
    """``resolve`` hands the value to the key's followers and ends its flight: the next miss leads."""
    backend, _ = await make()
    flights = backend.flights
    assert flights.join("key") is None  # the first miss leads
    follower = flights.join("key")
    assert follower is not None
    flights.resolve("key", "value")
    assert await follower == "value"
    assert len(flights) == 0 and flights.join("key") is None


async def test_a_leader_that_stops_with_no_follower_leaves_no_unretrieved_error(
    make: Any, engine: Engine
) -> None:
    """A leader refused (here `truncate: false` on a long text) fails the flights it led; with
    nobody following them, their error is retrieved all the same, so asyncio never reports
    "Future exception was never retrieved"."""
    backend, _ = await make()
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        with pytest.raises(APIError) as err:
            await backend.embed(_job(engine, [_new("a long text " * 200)], truncate=False))
        assert err.value.status == 422
        gc.collect()  # the failed flight is garbage now: an unretrieved error would be reported here
        await asyncio.sleep(0)  # (asyncio reports it through a callback)
    finally:
        loop.set_exception_handler(None)
    assert not reported, reported


async def test_with_redis_the_leader_looks_up_once_for_everyone(
    make: Any, engine: Engine, redis_url: str
) -> None:
    backend, gated = await make(cache_url=redis_url, cache_max_items=0)  # Redis tier only
    gated.gate.clear()
    text = [_new("popular with redis")]
    tasks = [asyncio.ensure_future(backend.embed(_job(engine, text))) for _ in range(50)]
    await _until(lambda: backend.stats.active == 50)
    gated.gate.set()
    await asyncio.gather(*tasks)
    assert gated.calls == [1]
    await backend.cache.flush()  # the write goes behind the answers
    assert backend.stats.cache.misses["redis"] == 1 and backend.stats.cache.writes["redis"] == 1
    assert len(gated.tokenized) == 1  # the leader tokenized, for all 50
    again = await backend.embed(_job(engine, text))
    assert again.cache_hits == 1 and backend.stats.cache.hits["redis"] == 1
    assert len(gated.tokenized) == 1 and again.n_tokens == engine.embed(text).n_tokens


async def test_a_redis_hit_on_another_replica_carries_usage_and_truncated(
    make: Any, engine: Engine, redis_url: str
) -> None:
    writer, _ = await make(cache_url=redis_url)
    reader, gated = await make(cache_url=redis_url)  # a second replica: its memory tier is empty
    texts = [_new("shared by replicas"), _long(engine)]
    first = await writer.embed(_job(engine, texts))
    await writer.cache.flush()  # the write goes behind the answer
    hit = await reader.embed(_job(engine, texts))
    assert hit.cache_hits == 2 and reader.stats.cache.hits["redis"] == 2
    assert gated.tokenized == [] and gated.calls == []
    assert hit.n_tokens == first.n_tokens and hit.truncated == [False, True]
    assert np.array_equal(hit.vectors, first.vectors)


async def test_duplicates_inside_one_request_are_computed_once(make: Any, engine: Engine) -> None:
    backend, gated = await make()
    a, b = _new("alpha"), _new("beta")
    result = await backend.embed(_job(engine, [a, b, a, a]))
    assert gated.calls == [2]
    assert np.array_equal(result.vectors[0], result.vectors[2]) and np.array_equal(
        result.vectors[0], result.vectors[3]
    )


async def _occupy(backend: CacheBackend, engine: Engine) -> list[asyncio.Future[Any]]:
    """With the gate closed: every model slot busy, so the texts of the next request wait in the queue."""
    blockers: list[asyncio.Future[Any]] = []
    while backend.batcher.in_flight < backend.settings.batch_concurrency:
        blockers.append(asyncio.ensure_future(backend.embed(_job(engine, [_new("blocker")]))))
        n = len(blockers)
        await _until(lambda n=n: backend.batcher.in_flight >= n)
    return blockers


async def test_follower_outlives_a_leader_whose_deadline_passed(make: Any, engine: Engine) -> None:
    backend, gated = await make()
    gated.gate.clear()
    blockers = await _occupy(backend, engine)  # the model is busy (held by the gate)
    text = [_new("shared text")]
    leader = asyncio.ensure_future(backend.embed(_job(engine, text, deadline=time.monotonic() + 0.05)))
    follower = asyncio.ensure_future(backend.embed(_job(engine, text, deadline=time.monotonic() + 60)))
    with pytest.raises(APIError) as err:
        await leader
    assert err.value.status == 504
    gated.gate.set()
    await asyncio.gather(*blockers)
    result = await follower  # retried as its own leader after the first one gave up
    assert np.allclose(result.vectors, _expected(engine, text), atol=1e-5)
    assert backend.stats.deadline_exceeded == 1


# --- the bounded queue ----------------------------------------------------------------
@pytest.mark.parametrize("status", [503, 429])
async def test_full_queue_answers_at_once_with_retry_after(make: Any, engine: Engine, status: int) -> None:
    backend, gated = await make(max_queue=4, overload_status=status)
    gated.gate.clear()
    running = await _occupy(backend, engine)
    assert backend.batcher.queue_depth == 0  # every slot busy, nothing queued yet
    queued = asyncio.ensure_future(
        backend.embed(_job(engine, [_new("q1"), _new("q2"), _new("q3"), _new("q4")]))
    )
    await _until(lambda: backend.batcher.queue_depth == 4)
    started = time.perf_counter()
    with pytest.raises(APIError) as err:
        await backend.embed(_job(engine, [_new("one too many")]))
    assert time.perf_counter() - started < 1.0  # refused without waiting for the model
    assert err.value.status == status and int(err.value.headers["Retry-After"]) >= 1
    assert "MAX_QUEUE=4" in err.value.message
    assert backend.stats.rejected == 1
    gated.gate.set()
    await asyncio.gather(*running, queued)
    assert sum(gated.calls) == len(running) + 4  # the refused text never reached the model


def test_retry_after_counts_every_model_slot_draining_the_queue() -> None:
    """Little's law: queued texts over the rate all BATCH_CONCURRENCY slots clear them together.
    One batch of 8 texts in 100 ms is one slot's 80 texts/s; two slots clear 160 texts/s."""
    from common.batch_stats import BatchRecord
    from stage4_cache_backpressure.admission import Admission

    batch = BatchRecord(8, 64, 64, "", [0.0] * 8, inference_ms=100.0, error=None)
    one, two = Admission(64, 503, lambda: 0, slots=1), Admission(64, 503, lambda: 0, slots=2)
    one.observe(batch)
    two.observe(batch)
    assert (one.drain_rate, two.drain_rate) == (80.0, 160.0)
    assert (one.retry_after(320), two.retry_after(320)) == (4, 2)


async def test_a_request_is_refused_only_when_its_texts_would_overflow_the_queue(
    make: Any, engine: Engine
) -> None:
    """Queued texts plus the request's own against MAX_QUEUE: with 3 of 4 queued, 2 more are
    refused and 1 more goes."""
    backend, gated = await make(max_queue=4)
    gated.gate.clear()
    running = await _occupy(backend, engine)
    assert backend.batcher.queue_depth == 0  # every slot busy, nothing queued yet
    queued = [asyncio.ensure_future(backend.embed(_job(engine, [_new("q1"), _new("q2"), _new("q3")])))]
    await _until(lambda: backend.batcher.queue_depth == 3)
    with pytest.raises(APIError) as err:
        await backend.embed(_job(engine, [_new("one"), _new("two")]))
    assert err.value.status == 503
    queued.append(asyncio.ensure_future(backend.embed(_job(engine, [_new("fits")]))))
    await _until(lambda: backend.batcher.queue_depth == 4)
    gated.gate.set()
    await asyncio.gather(*running, *queued)
    assert backend.stats.rejected == 1


async def test_request_larger_than_the_queue_goes_when_the_queue_is_empty(make: Any, engine: Engine) -> None:
    """More texts than MAX_QUEUE in one request, and nothing queued: it goes, or a request that
    large could never be served (admission.py's check)."""
    backend, gated = await make(max_queue=2)
    texts = [_new(f"larger than the queue {i}") for i in range(5)]
    result = await backend.embed(_job(engine, texts))
    assert np.allclose(result.vectors, _expected(engine, texts), atol=1e-5)
    assert sum(gated.calls) == 5 and backend.stats.rejected == 0


async def test_deadline_passing_in_the_queue_is_504_before_the_model(make: Any, engine: Engine) -> None:
    backend, gated = await make()
    gated.gate.clear()
    running = await _occupy(backend, engine)
    with pytest.raises(APIError) as err:
        await backend.embed(_job(engine, [_new("late")], deadline=time.monotonic() + 0.05))
    assert err.value.status == 504
    gated.gate.set()
    await asyncio.gather(*running)
    await backend.embed(_job(engine, [_new("after")]))
    assert gated.calls == [1] * (len(running) + 1)  # "late" was dropped before the model
    assert backend.stats.deadline_exceeded == 1


async def test_expired_deadline_is_504_without_queueing(make: Any, engine: Engine) -> None:
    backend, gated = await make()
    with pytest.raises(APIError) as err:
        await backend.embed(_job(engine, [_new("too late")], deadline=time.monotonic() - 1))
    assert err.value.status == 504 and gated.calls == []


# --- drain: readiness -------------------------------------------------------------------
async def test_drain_turns_readiness_503_and_still_serves(engine: Engine) -> None:
    backends: list[CacheBackend] = []

    def make_backend(eng: Engine, settings: Settings) -> CacheBackend:
        backend = CacheBackend(eng, make_batcher(eng, settings), settings)
        backends.append(backend)
        return backend

    app = create_app("stage4-drain-test", make_backend, settings=Settings())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/ready")).status_code == 200
            backends[0].begin_drain()
            ready = await client.get("/ready")
            embed = await client.post("/v1/embed", json={"inputs": "hello"})
    # readiness tells the load balancer to stop sending; what still arrives is served
    assert ready.status_code == 503 and embed.status_code == 200
    assert backends[0].draining
