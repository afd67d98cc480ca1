"""Stage 3's backend: every request hands its texts to one batcher, which runs them in batches.

Stage 2 runs every request's model call in a pool thread of its own; on a CPU each call pays a
fixed cost (thread hand-offs, kernel launches, small matrices that use the cores badly). Here
the pool is gone: the backend holds a batcher (``batcher.py``, the textbook one, or
``refined.py``'s, with the chapter's refinements) and awaits it, the way stage 2 awaited its pool.
"""

from __future__ import annotations

from common.backend import EmbedJob, EmbedResult, tokenize
from common.engine import Engine, l2_normalize
from common.limits import APIError, model_failed
from common.settings import Settings
from stage3_batching.batcher import Batcher
from stage3_batching.refined import refined


# --8<-- [start:backend]
class BatchingBackend:
    draining = False  # never: stage 4 adds a graceful drain

    def __init__(self, engine: Engine, batcher: Batcher) -> None:
        # NEW: one batcher owns the model instead of a pool; requests queue for it.
        self.engine, self.batcher = engine, batcher

    async def start(self) -> None:
        await self.batcher.start()  # NEW: its loop and its model threads

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


def make_batcher(engine: Engine, settings: Settings) -> Batcher:
    """BATCHER=refined (the default): the batcher with the chapter's refinements; textbook: without."""
    if settings.batcher == "refined":
        return refined(engine.run, settings)
    return Batcher(engine.run, settings)


def make_backend(engine: Engine, settings: Settings) -> BatchingBackend:
    return BatchingBackend(engine, make_batcher(engine, settings))
