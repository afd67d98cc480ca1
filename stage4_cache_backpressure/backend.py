"""Stage 4's backend: a cache, in-flight de-duplication, a bounded queue, deadlines and a drain,
in front of stage 3's batcher.

The backend holds the batcher it is handed (stage 3's, or on a cluster a handle to a model
deployment: ``deploy/ray/composed.py``) and calls it, the way a middleware holds the app it wraps.
A text goes through the steps in order:

1. the in-process LRU (``cache.py``), no await;
2. single-flight (``singleflight.py``): a text already being computed is waited for, not queued;
3. the Redis tier when CACHE_URL is set (the leader looks it up, once for everyone waiting);
4. admission (``admission.py``): a full queue answers 503 (or 429) at once, with Retry-After;
5. stage 3's batcher, with the request's deadline: a text whose deadline passes while queued,
   or whose client has gone, is dropped before the model.

A cache entry holds the text's token count and truncation flag beside its vector, so only the
texts that reach step 5 are tokenized: a hit never runs the tokenizer.
On SIGTERM it drains (``drain.py``): readiness 503, admitted requests finish, the pool closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from common.backend import EmbedJob, EmbedResult, tokenize
from common.engine import Engine, TokenizedText
from common.limits import APIError, ClientGone, DeadlineExceeded, Overloaded, model_failed
from common.settings import Settings
from stage3_batching.backend import make_batcher
from stage3_batching.batcher import Batcher
from stage3_batching.pending import BatchOutcome
from stage4_cache_backpressure.admission import Admission
from stage4_cache_backpressure.cache import Cache, CacheEntry, cache_key
from stage4_cache_backpressure.disconnect import unless_client_leaves
from stage4_cache_backpressure.drain import chain_signal_handlers
from stage4_cache_backpressure.partial_result import PartialResult
from stage4_cache_backpressure.singleflight import LeaderGone, SingleFlight
from stage4_cache_backpressure.stats import Stage4Stats

log = logging.getLogger("embedserve.stage4")
Flight = asyncio.Future[CacheEntry]


# --8<-- [start:backend]
class CacheBackend:
    def __init__(
        self, engine: Engine, batcher: Batcher, settings: Settings, *, drain_on_signal: bool = False
    ):
        self.engine, self.batcher, self.settings = engine, batcher, settings  # NEW: stage 3's batcher, held
        self.stats = Stage4Stats()  # NEW: /v1/cache/metrics
        self.cache = Cache(settings, engine.dimensions, self.stats.cache)  # NEW: two tiers
        self.flights: SingleFlight[CacheEntry] = SingleFlight()  # NEW: one computation per text
        # NEW: the bounded queue, measured on the batcher's own queue; it learns from every batch
        # how fast the queue drains (for Retry-After)
        s = settings
        self.admission = Admission(
            s.max_queue, s.overload_status, lambda: batcher.queue_depth, s.batch_concurrency
        )
        batcher.watch(self.admission.observe)
        self.draining, self._drain_on_signal = False, drain_on_signal  # NEW: /ready reads `draining`

    async def start(self) -> None:
        await self.batcher.start()
        await self.cache.start()  # NEW: the Redis pool, in the lifespan
        if self._drain_on_signal:
            # NEW: SIGTERM starts the drain; uvicorn stops accepting DRAIN_DELAY_S later
            chain_signal_handlers(self.begin_drain, self.settings.drain_delay_s)

    async def close(self) -> None:
        await self.batcher.close()  # the batcher answers everything queued first
        await self.cache.close()
        log.info("stage 4 closed: queue empty, cache closed")

    def begin_drain(self) -> None:
        """SIGTERM: readiness goes 503; DRAIN_DELAY_S later uvicorn stops accepting and lets
        admitted requests finish."""
        if not self.draining:
            self.draining = True
            log.warning("draining: %d request(s) in progress, readiness now 503", self.stats.active)

    def turn_away(self) -> Overloaded | None:
        """The door's question (``shed.py``), asked before a request is read: its refusal while the
        queue is full, counted; None while there is room."""
        if not self.admission.full():
            return None
        self.stats.rejected += 1
        return self.admission.overloaded(self.admission.depth(), 1)

    async def embed(self, job: EmbedJob) -> EmbedResult:
        self.stats.active += 1
        try:
            return await self._embed(job)
        except Overloaded:  # NEW: each outcome counted by its type
            self.stats.rejected += 1
            raise
        except DeadlineExceeded:
            self.stats.deadline_exceeded += 1
            raise
        except ClientGone:
            self.stats.disconnects += 1
            raise
        finally:
            self.stats.active -= 1

    # --8<-- [end:backend]

    # --8<-- [start:embed]
    async def _embed(self, job: EmbedJob) -> EmbedResult:
        """The five steps of the module docstring, in order."""
        if not (job.use_cache and self.cache.enabled):
            return await self._embed_uncached(job)
        partial, keys = PartialResult(self.engine, job), self._keys(job)
        # 1. memory tier: no await, no tokenizer (the entry holds the token count)
        todo = partial.fill(range(len(keys)), self.cache.get_local(keys))
        # 2. single-flight: a text another request is computing is waited for, not queued again
        flights = [(row, self.flights.join(keys[row])) for row in todo]
        lead = [row for row, flight in flights if flight is None]  # nobody computes it: we do
        follow = [(row, flight) for row, flight in flights if flight is not None]
        with self.flights.leading([keys[row] for row in lead], handover=_handover):
            # 3. Redis tier, looked up once for this request and for every follower
            todo = partial.fill(lead, await self._from_redis(keys, lead))
            if todo:
                # 4. admission: past the deadline already, 504; the queue full, 503 (or 429) now,
                # before the tokenizer runs: a refusal should cost as little as possible
                _check_deadline(job)
                self.admission.check(len(todo))
                # 5. stage 3's batcher, with the request's deadline; the misses, and only them,
                # are tokenized
                tokens = await tokenize(self.engine, job, todo)
                outcome = await self._submit(tokens, job)
                self._remember([keys[row] for row in todo], partial.computed(todo, tokens, outcome))
        for row, flight in follow:
            partial.take(row, await self._follow(job, row, flight))
        self.stats.deduplicated += len(follow)
        return partial.result()

    # --8<-- [end:embed]

    # --8<-- [start:steps]
    def _keys(self, job: EmbedJob) -> list[str]:
        model, sha = self.engine.model_id, self.engine.model_sha256
        return [cache_key(model, sha, job.normalize, text) for text in job.texts]

    async def _from_redis(self, keys: list[str], rows: list[int]) -> list[CacheEntry | None]:
        """Step 3: one MGET for the texts this request leads; their followers get a hit at once."""
        found = await self.cache.get_remote([keys[row] for row in rows])
        for row, entry in zip(rows, found, strict=True):
            if entry is not None:
                self.flights.resolve(keys[row], entry)
        return found

    async def _submit(self, tokens: list[TokenizedText], job: EmbedJob) -> BatchOutcome:
        """Step 5: a text still queued when the deadline passes (504) or when the client hangs up
        (499) is dropped, never run."""
        self.admission.check(len(tokens))  # again: a long input was tokenized in a thread meanwhile
        pending = self.batcher.enqueue(tokens, deadline=job.deadline)
        try:
            if job.receive is None:
                return await pending
            return await unless_client_leaves(pending, job.receive)  # NEW: hang up, drop the work
        except APIError:
            raise
        except Exception as exc:  # the model raised for this request's texts
            raise model_failed(exc) from exc

    def _remember(self, keys: list[str], entries: list[CacheEntry]) -> None:
        """Memory first, then the followers (so no request misses both), then Redis."""
        written = self.cache.put_local(keys, entries)
        for key, entry in zip(keys, entries, strict=True):
            self.flights.resolve(key, entry)
        self.cache.put_remote(written)  # written behind the answer: nobody waits for Redis

    async def _follow(self, job: EmbedJob, row: int, flight: Flight) -> CacheEntry:
        """Step 2, the follower's side: wait for the leader's entry, bounded by our own deadline."""
        left = None if job.deadline is None else job.deadline - time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(flight), left)
        except TimeoutError:
            raise DeadlineExceeded("request deadline passed while the same text was being computed") from None
        except LeaderGone:
            return await self._retry_alone(job, row)

    async def _retry_alone(self, job: EmbedJob, row: int) -> CacheEntry:
        """The leader stopped for a reason of its own (``_handover``); this request may still be
        fine, so its text goes through the steps again, alone. ``truncate`` is checked by the
        caller at the text's own row (``PartialResult.take``), so the retry may truncate."""
        alone = dataclasses.replace(job, texts=[job.texts[row]], truncate=True, receive=None)
        result = await self._embed(alone)
        return CacheEntry(result.vectors[0], result.n_tokens[0], result.truncated[0])

    async def _embed_uncached(self, job: EmbedJob) -> EmbedResult:
        """`cache: false`, Cache-Control: no-cache or CACHE_ENABLED=false: steps 4 and 5 only.
        The fresh answer still refreshes the cache."""
        if not job.use_cache:
            self.stats.bypassed += 1  # the client's choice is counted, CACHE_ENABLED=false is not
        partial, rows = PartialResult(self.engine, job), list(range(len(job.texts)))
        _check_deadline(job)
        self.admission.check(len(rows))
        tokens = await tokenize(self.engine, job)
        entries = partial.computed(rows, tokens, await self._submit(tokens, job))
        if self.cache.enabled:
            self.cache.put(self._keys(job), entries)
        return partial.result(bypassed=True)

    # --8<-- [end:steps]

    def cache_metrics(self) -> dict[str, Any]:
        """``/v1/cache/metrics``: the counters, and the queue and cache as they are now."""
        return {
            **self.stats.as_dict(),
            "in_flight_texts": len(self.flights),
            "queue_depth": self.batcher.queue_depth,
            "max_queue": self.admission.max_queue,
            "drain_rate": round(self.admission.drain_rate, 1),
            "draining": self.draining,
            "config": self.cache.config(),
        }


def _check_deadline(job: EmbedJob) -> None:
    if job.deadline is not None and time.monotonic() >= job.deadline:
        raise DeadlineExceeded("request deadline passed before the model was reached")


def _handover(exc: BaseException) -> BaseException:
    """What the followers get when their leader stops early. Its own limits (its client left,
    its deadline passed, its `truncate: false` met a long text) are not theirs: they retry.
    A full queue or a failing model would be theirs too: they get the same error."""
    too_long = isinstance(exc, APIError) and exc.status == 422
    own = isinstance(exc, asyncio.CancelledError | ClientGone | DeadlineExceeded) or too_long
    return LeaderGone() if own else exc


def make_backend(engine: Engine, settings: Settings) -> CacheBackend:
    """Stage 3's batcher, wrapped in stage 4's steps; SIGTERM drains."""
    return CacheBackend(engine, make_batcher(engine, settings), settings, drain_on_signal=True)
