"""Stage 3: dynamic batching. Concurrent requests share one model call.

Stage 2 runs every request's model call in a pool thread of its own; on a CPU each call pays a
fixed cost (thread hand-offs, kernel launches, small matrices that use the cores badly). Here
the pool is gone: every request hands its texts to one batcher, which runs them in batches
(BATCH_CONCURRENCY side by side, in threads of its own) and answers every caller.
``batcher.py`` is the textbook batcher; the server runs it with the chapter's five refinements
(``refined.py``: load tiers, length grouping and length buckets, failure isolation, busy slots).

New routes: ``GET /v1/batcher/config`` and ``GET /v1/batcher/metrics``. New headers:
``x-queue-time`` (ms waiting for a batch) and ``x-batch-size`` (sizes of the caller's batches).

    make stage3   # MAX_BATCH_SIZE, MAX_BATCH_TOKENS, BATCH_WINDOW_MS, ... from the environment
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from common.api import EmbedJob, EmbedResult, create_app, json_response, tokenize
from common.engine import Engine, l2_normalize
from common.limits import APIError, model_failed, not_ready
from common.settings import Settings
from stage1_naive.app import NaiveBackend
from stage3_batching.batcher import Batcher, BatchRecord
from stage3_batching.refined import RefinedBatcher


# --8<-- [start:backend]
class BatchingBackend(NaiveBackend):
    def __init__(
        self, engine: Engine, settings: Settings, on_batch: Callable[[BatchRecord], None] | None = None
    ) -> None:
        super().__init__(engine)
        # NEW: one batcher owns the model instead of a pool; requests queue for it.
        # BATCHER=textbook serves with the textbook batcher alone, BATCHER=refined (the default)
        # with its refinements: the two have one interface.
        kind = RefinedBatcher if settings.batcher == "refined" else Batcher
        self.batcher: Batcher = kind(engine.run, settings, on_batch=on_batch)

    async def start(self) -> None:
        await self.batcher.start()

    async def embed(self, job: EmbedJob) -> EmbedResult:
        tokens = await tokenize(self.engine, job)
        try:
            # NEW: the batcher runs the model in one of its threads, with other requests' texts.
            out = await self.batcher.submit(tokens, deadline=job.deadline)
        except APIError:
            raise
        except Exception as exc:  # the model raised for this caller's texts
            raise model_failed(exc) from exc
        vectors = l2_normalize(out.vectors) if job.normalize else out.vectors
        return EmbedResult(
            vectors,
            [t.n_tokens for t in tokens],
            [t.truncated for t in tokens],
            out.inference_ms,
            queue_ms=out.queue_ms,  # NEW: x-queue-time
            batch_sizes=out.batch_sizes,  # NEW: x-batch-size
        )

    async def close(self) -> None:
        await self.batcher.close()  # answers everything queued first


# --8<-- [end:backend]


def make_backend(engine: Engine, settings: Settings) -> BatchingBackend:
    return BatchingBackend(engine, settings)


# --8<-- [start:routes]
BATCHER_SETTINGS = ("batcher", "max_batch_size", "max_batch_tokens", "batch_concurrency", "batch_window_ms",
          "batch_window_high_ms", "batch_low_threshold", "batch_high_threshold", "group_by_length",
          "group_window", "split_by_length", "call_overhead_tokens")  # fmt: skip


def batcher_of(request: Request) -> Batcher:
    backend = getattr(request.app.state, "backend", None)
    batcher = getattr(backend, "batcher", None)
    if not isinstance(batcher, Batcher):
        raise not_ready()
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
