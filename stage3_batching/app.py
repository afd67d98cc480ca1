"""Stage 3: dynamic batching. Concurrent requests share one model call.

Stage 2 made one model call per request; on a CPU each call pays a fixed cost (thread
hand-offs, kernel launches, small matrices that use the cores badly). Here every request
hands its texts to one batcher, which runs them in batches in an executor thread
(BATCH_CONCURRENCY batches side by side) and answers every caller. ``batcher.py`` is the
textbook batcher; the server runs it with five refinements, each a subclass overriding one of
its hooks: load tiers (``tiers.py``), length grouping (``grouping.py``), length buckets
(``buckets.py``), failure isolation (``isolation.py``) and busy slots (``slots.py``).

    make stage3   # MAX_BATCH_SIZE, MAX_BATCH_TOKENS, BATCH_WINDOW_MS, ... from the environment

New routes: ``GET /v1/batcher/config`` and ``GET /v1/batcher/metrics``. New headers:
``x-queue-time`` (ms waiting for a batch) and ``x-batch-size`` (sizes of the caller's batches).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from common.api import EmbedJob, EmbedResult, create_app, json_response, tokenize
from common.engine import Engine, l2_normalize
from common.limits import APIError
from common.settings import Settings
from stage3_batching.batcher import Batcher, BatchRecord
from stage3_batching.buckets import LengthBuckets
from stage3_batching.grouping import GroupByLength
from stage3_batching.isolation import IsolateFailures
from stage3_batching.slots import BusySlots
from stage3_batching.tiers import LoadTiers


# --8<-- [start:compose]
# NEW: the textbook batcher with the five refinements, in the order the chapter adds them (read
# right to left). Python's mixin idiom, as in socketserver's ThreadingTCPServer: a hook is looked
# up left to right, and a refinement whose setting is off hands it on with super(). The settings:
# BATCH_LOW_THRESHOLD=1 (no LOW tier), GROUP_BY_LENGTH=false, SPLIT_BY_LENGTH=false; failure
# isolation and busy slots have none, they are always on.
class RefinedBatcher(BusySlots, IsolateFailures, LengthBuckets, GroupByLength, LoadTiers, Batcher):
    """The batcher stage 3 serves with (stages 4 and 5 too, through ``BatchingBackend``)."""


# --8<-- [end:compose]


# --8<-- [start:backend]
class BatchingBackend:
    def __init__(
        self, engine: Engine, settings: Settings, on_batch: Callable[[BatchRecord], None] | None = None
    ) -> None:
        self.engine = engine
        # NEW: one batcher owns the model; requests queue for it instead of calling it.
        self.batcher = RefinedBatcher(engine.run, settings, on_batch=on_batch)

    async def start(self) -> None:
        await self.batcher.start()

    async def close(self) -> None:
        await self.batcher.close()  # answers everything queued first

    async def embed(self, job: EmbedJob) -> EmbedResult:
        tokens = await tokenize(self.engine, job)
        try:
            out = await self.batcher.submit(tokens, deadline=job.deadline)
        except APIError:
            raise
        except Exception as exc:  # the model raised for this caller's texts
            raise APIError(500, f"the model failed on this request: {type(exc).__name__}") from exc
        vectors = l2_normalize(out.vectors) if job.normalize else out.vectors
        return EmbedResult(
            vectors,
            [t.n_tokens for t in tokens],
            [t.truncated for t in tokens],
            out.inference_ms,
            queue_ms=out.queue_ms,  # NEW: x-queue-time
            batch_sizes=out.batch_sizes,  # NEW: x-batch-size
        )


# --8<-- [end:backend]


def make_backend(engine: Engine, settings: Settings) -> BatchingBackend:
    return BatchingBackend(engine, settings)


# --8<-- [start:routes]
BATCHER_SETTINGS = ("max_batch_size", "max_batch_tokens", "batch_concurrency", "batch_window_ms",
          "batch_window_high_ms", "batch_low_threshold", "batch_high_threshold", "group_by_length",
          "group_window", "split_by_length", "call_overhead_tokens")  # fmt: skip


def batcher_of(request: Request) -> Batcher:
    backend = getattr(request.app.state, "backend", None)
    batcher = getattr(backend, "batcher", None)
    if not isinstance(batcher, Batcher):
        raise APIError(503, "the model is not loaded yet", headers={"Retry-After": "1"})
    return batcher


def add_batcher_routes(app: FastAPI) -> None:
    """``/v1/batcher/config`` and ``/v1/batcher/metrics``, for any app whose backend has ``.batcher``."""

    @app.get("/v1/batcher/config", tags=["batcher"])
    async def batcher_config(request: Request) -> Response:
        """The batching settings this server runs with."""
        settings = batcher_of(request).settings
        return json_response({key: getattr(settings, key) for key in BATCHER_SETTINGS})

    @app.get("/v1/batcher/metrics", tags=["batcher"])
    async def batcher_metrics(request: Request) -> Response:
        """Batches, texts, batch-size distribution, tier counts, padding ratio, queue depth now."""
        batcher = batcher_of(request)
        stats = batcher.stats.as_dict()
        return json_response({**stats, "queue_depth": batcher.queue_depth, "in_flight": batcher.in_flight})


# --8<-- [end:routes]


app = create_app(
    "stage3_batching", make_backend, description=__doc__ or "", calls_at_once=lambda s: s.batch_concurrency
)
add_batcher_routes(app)
