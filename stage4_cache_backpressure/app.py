"""Stage 4: a cache, in-flight de-duplication, a bounded queue, deadlines and a graceful drain.

Layers in front of stage 3's batcher (imported, not copied); a text goes through them in order:

1. the in-process LRU (``cache.py``), no await;
2. single-flight (``singleflight.py``): a text already being computed is waited for, not queued;
3. the Redis tier when CACHE_URL is set (the leader looks it up, once for everyone waiting);
4. admission (``admission.py``): a full queue answers 503 (or 429) at once, with Retry-After;
5. stage 3's batcher, with the request's deadline: a text whose deadline passes while queued,
   or whose client has gone, is dropped before the model.

On SIGTERM it drains (``drain.py``): readiness 503, admitted requests finish, the pool closes.

    make stage4                                   # in-process cache only
    CACHE_URL=redis://127.0.0.1:6379/0 make stage4  # two tiers, shared by every replica

New headers: ``x-cache: hit | miss | partial | bypass`` with ``x-cache-hits`` and
``x-cache-misses``. New route: ``GET /v1/cache/metrics``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response

from common.api import EmbedJob, EmbedResult, create_app, json_response, tokenize
from common.engine import Engine, TokenizedText, l2_normalize
from common.limits import APIError
from common.settings import Settings
from stage3_batching.app import BatchingBackend, add_batcher_routes
from stage3_batching.batcher import BatchRecord
from stage4_cache_backpressure.admission import Admission
from stage4_cache_backpressure.cache import Cache, CacheStats, cache_key
from stage4_cache_backpressure.drain import chain_signal_handlers
from stage4_cache_backpressure.singleflight import LeaderGone, SingleFlight

log = logging.getLogger("embedserve.stage4")


@dataclass(slots=True)
class Stage4Stats:
    """Every counter of this stage, read by ``/v1/cache/metrics`` and by stage 5."""

    cache: CacheStats = field(default_factory=CacheStats)
    deduplicated: int = 0  # texts answered by another request's computation
    rejected: int = 0  # requests refused because the queue was full (OVERLOAD_STATUS)
    deadline_exceeded: int = 0  # requests answered 504
    disconnects: int = 0  # requests whose client left first (their queued texts never run)
    bypassed: int = 0  # requests that opted out of the cache
    active: int = 0  # requests inside the backend right now

    def as_dict(self) -> dict[str, Any]:
        names = ("deduplicated", "rejected", "deadline_exceeded", "disconnects", "bypassed", "active")
        return {"cache": self.cache.as_dict(), **{n: getattr(self, n) for n in names}}


# --8<-- [start:backend]
class CacheBackend(BatchingBackend):
    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        on_batch: Callable[[BatchRecord], None] | None = None,
        on_drain: Callable[[], None] | None = None,
        drain_on_signal: bool = False,
    ) -> None:
        super().__init__(engine, settings, on_batch=self._observe_batch)
        self.settings, self._on_batch, self._on_drain = settings, on_batch, on_drain
        self.stats = Stage4Stats()
        self.cache = Cache(settings, engine.dimensions, self.stats.cache)  # NEW: two tiers
        self.flights: SingleFlight[np.ndarray] = SingleFlight()  # NEW: one computation per text
        # NEW: the bounded queue, measured on the batcher's own queue
        self.admission = Admission(
            settings.max_queue, settings.overload_status, lambda: self.batcher.queue_depth
        )
        self.draining = False
        self._drain_on_signal = drain_on_signal

    async def start(self) -> None:
        await super().start()
        await self.cache.start()
        if self._drain_on_signal:
            chain_signal_handlers(self.begin_drain)  # NEW: SIGTERM starts the drain

    async def close(self) -> None:
        await super().close()  # the batcher answers everything queued first
        await self.cache.close()
        log.info("stage 4 closed: queue empty, cache closed")

    def begin_drain(self) -> None:
        """SIGTERM: readiness goes 503; uvicorn stops accepting and lets admitted requests finish."""
        if not self.draining:
            self.draining = True
            log.warning("draining: %d request(s) in progress, readiness now 503", self.stats.active)
            if self._on_drain is not None:
                self._on_drain()

    def _observe_batch(self, record: BatchRecord) -> None:
        self.admission.observe(record)
        if self._on_batch is not None:
            self._on_batch(record)

    async def embed(self, job: EmbedJob) -> EmbedResult:
        self.stats.active += 1
        try:
            if job.request is None:
                return await self._embed(job)
            return await self._unless_client_leaves(job, job.request)
        except APIError as exc:
            if exc.status == 504:
                self.stats.deadline_exceeded += 1
            elif exc.status == self.settings.overload_status:
                self.stats.rejected += 1
            raise
        finally:
            self.stats.active -= 1

    # --8<-- [end:backend]

    # --8<-- [start:disconnect]
    async def _unless_client_leaves(self, job: EmbedJob, request: Request) -> EmbedResult:
        """Race the work against the client hanging up; cancelling it drops its queued texts."""
        work = asyncio.ensure_future(self._embed(job))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # its queued texts are skipped by the batcher
        if work in done:
            return work.result()
        self.stats.disconnects += 1
        raise APIError(499, "client closed the request")  # nobody reads this answer

    # --8<-- [end:disconnect]

    # --8<-- [start:embed]
    async def _embed(self, job: EmbedJob) -> EmbedResult:
        model, sha = self.engine.model_id, self.engine.model_sha256
        keys = [cache_key(model, sha, job.normalize, text) for text in job.texts]
        tokens = await tokenize(self.engine, job)
        answer = _Answer(np.empty((len(keys), self.engine.dimensions), np.float32))
        todo = list(range(len(keys)))
        use_cache = job.use_cache and self.cache.enabled
        if use_cache:  # 1. memory tier
            todo = answer.fill(todo, self.cache.get_local(keys))
        elif not job.use_cache:  # the client opted out (CACHE_ENABLED=false is not counted)
            self.stats.bypassed += 1
        lead: list[int] = []
        follow: list[tuple[int, asyncio.Future[np.ndarray]]] = []
        for i in todo:  # 2. single-flight (opted-out requests compute their own)
            flight = self.flights.join(keys[i]) if use_cache else None
            lead.append(i) if flight is None else follow.append((i, flight))
        led = [keys[i] for i in lead] if use_cache else []  # the flights this request owns
        try:
            if lead:
                await self._lead(job, tokens, keys, lead, answer, use_cache)
        except asyncio.CancelledError:
            self.flights.fail(led, LeaderGone())
            raise
        except APIError as exc:  # a 504 is the leader's own deadline: followers try again
            self.flights.fail(led, LeaderGone() if exc.status == 504 else exc)
            raise
        except Exception as exc:
            error = APIError(500, f"the model failed on this request: {type(exc).__name__}")
            self.flights.fail(led, error)
            raise error from exc
        for i, flight in follow:
            answer.vectors[i] = await self._follow(job, i, flight)
        self.stats.deduplicated += len(follow)
        return EmbedResult(
            answer.vectors,
            [t.n_tokens for t in tokens],
            [t.truncated for t in tokens],
            answer.inference_ms,
            queue_ms=answer.queue_ms,
            batch_sizes=answer.batch_sizes,
            cache_hits=answer.hits,
            cache_bypassed=not use_cache,
        )

    async def _lead(
        self,
        job: EmbedJob,
        tokens: list[TokenizedText],
        keys: list[str],
        todo: list[int],
        answer: _Answer,
        use_cache: bool,
    ) -> None:
        if use_cache and self.cache.redis is not None:  # 3. Redis tier, once for all followers
            found = await self.cache.get_remote([keys[i] for i in todo])
            for i, vector in zip(todo, found, strict=True):
                if vector is not None:
                    self.flights.resolve(keys[i], vector)
            todo = answer.fill(todo, found)
        if not todo:
            return
        if job.deadline is not None and time.monotonic() >= job.deadline:
            raise APIError(504, "request deadline passed before the model was reached")
        self.admission.check(len(todo))  # 4. bounded queue: 503 now, never a long wait
        outcome = await self.batcher.submit([tokens[i] for i in todo], deadline=job.deadline)
        vectors = l2_normalize(outcome.vectors) if job.normalize else outcome.vectors
        answer.vectors[todo] = vectors
        answer.queue_ms, answer.inference_ms = outcome.queue_ms, outcome.inference_ms
        answer.batch_sizes = outcome.batch_sizes
        new_keys = [keys[i] for i in todo]
        written = self.cache.put_local(new_keys, vectors)  # an opted-out answer refreshes it too
        for key, vector in zip(new_keys, vectors, strict=True) if use_cache else ():
            self.flights.resolve(key, vector)  # after the memory write, so no one can miss both
        await self.cache.put_remote(written)  # followers do not wait for the Redis write

    async def _follow(self, job: EmbedJob, i: int, flight: asyncio.Future[np.ndarray]) -> np.ndarray:
        """Wait for another request's computation of this text (bounded by our own deadline)."""
        left = None if job.deadline is None else job.deadline - time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(flight), left)
        except TimeoutError:
            raise APIError(504, "request deadline passed while the same text was being computed") from None
        except LeaderGone:  # the leader's client left or its deadline passed: ours may not have
            one = EmbedJob([job.texts[i]], job.normalize, job.truncate, job.use_cache, job.deadline)
            return (await self._embed(one)).vectors[0]

    # --8<-- [end:embed]


@dataclass(slots=True)
class _Answer:
    """One request's vectors as the tiers fill them in, and what to say about it."""

    vectors: np.ndarray
    hits: int = 0
    inference_ms: float = 0.0
    queue_ms: float | None = None
    batch_sizes: list[int] | None = None

    def fill(self, rows: list[int], found: list[np.ndarray | None]) -> list[int]:
        """Take the vectors a cache tier found; return the rows still missing."""
        missing = []
        for row, vector in zip(rows, found, strict=True):
            if vector is None:
                missing.append(row)
            else:
                self.vectors[row] = vector
                self.hits += 1
        return missing


async def _client_gone(request: Request) -> None:
    """Return when the client disconnects (the body is read, so only a disconnect arrives)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _log_to_stderr(level: str) -> None:
    """Show this stage's drain and cache messages (stage 5 replaces this with structured logs)."""
    root = logging.getLogger("embedserve")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(level)


def make_backend(engine: Engine, settings: Settings) -> CacheBackend:
    _log_to_stderr(settings.log_level)

    def stop_ready() -> None:
        app.state.ready = False  # /ready answers 503, new requests get 503

    return CacheBackend(engine, settings, on_drain=stop_ready, drain_on_signal=True)


# --8<-- [start:routes]
def add_cache_routes(app: FastAPI) -> None:
    @app.get("/v1/cache/metrics", tags=["cache"])
    async def cache_metrics(request: Request) -> Response:
        """Cache hits and misses by tier, Redis errors, de-duplicated texts, 503s, 504s, disconnects."""
        backend = getattr(request.app.state, "backend", None)
        if not isinstance(backend, CacheBackend):
            raise APIError(503, "the model is not loaded yet", headers={"Retry-After": "1"})
        return json_response(
            {
                **backend.stats.as_dict(),
                "in_flight_texts": len(backend.flights),
                "queue_depth": backend.batcher.queue_depth,
                "max_queue": backend.admission.max_queue,
                "drain_rate": round(backend.admission.drain_rate, 1),
                "draining": backend.draining,
                "config": backend.cache.config(),
            }
        )


# --8<-- [end:routes]


app = create_app(
    "stage4_cache_backpressure",
    make_backend,
    description=__doc__ or "",
    calls_at_once=lambda s: s.batch_concurrency,
)
add_batcher_routes(app)
add_cache_routes(app)
