"""Stage 2: the model runs off the event loop, in a bounded thread pool.

The handler awaits the model call in a pool of WORKER_THREADS threads, so the event
loop keeps accepting connections and answering ``/health`` while the model works.
ONNX Runtime releases the GIL during the call, and ONNX_INTRA_THREADS decides how many
cores one call uses: the two settings multiply, and on 2 cores oversubscribing them
costs more than it buys (measured in docs/stage2.md).

Every request still makes its own model call. ``stage3_batching`` groups them.

    make stage2   # uvicorn stage2_threadpool.app:app on 127.0.0.1:8000
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from common.api import EmbedJob, EmbedResult, create_app, tokenize
from common.engine import Engine, l2_normalize
from common.settings import Settings
from stage1_naive.app import NaiveBackend


# --8<-- [start:backend]
def _timed(engine: Engine, token_ids: list[np.ndarray]) -> tuple[np.ndarray, float]:
    """In a pool thread: the model call, timed there (x-inference-time is the model alone, not the
    wait for a free thread, which x-total-time includes)."""
    started = time.perf_counter()
    return engine.run(token_ids), (time.perf_counter() - started) * 1e3


class ThreadPoolBackend(NaiveBackend):
    def __init__(self, engine: Engine, threads: int) -> None:
        super().__init__(engine)
        # NEW: a pool of our own, sized by a setting, instead of blocking the loop
        # (or borrowing Starlette's 40-thread pool, which would oversubscribe 2 cores).
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="model")

    async def embed(self, job: EmbedJob) -> EmbedResult:
        tokens = await tokenize(self.engine, job)
        loop = asyncio.get_running_loop()
        # NEW: the event loop stays free while a pool thread runs the model.
        ids = [t.ids for t in tokens]
        vectors, inference_ms = await loop.run_in_executor(self.pool, _timed, self.engine, ids)
        if job.normalize:
            vectors = l2_normalize(vectors)
        return EmbedResult(vectors, [t.n_tokens for t in tokens], [t.truncated for t in tokens], inference_ms)

    async def close(self) -> None:
        self.pool.shutdown(wait=True)


# --8<-- [end:backend]


def make_backend(engine: Engine, settings: Settings) -> ThreadPoolBackend:
    return ThreadPoolBackend(engine, settings.worker_threads)


app = create_app(
    "stage2_threadpool", make_backend, description=__doc__ or "", calls_at_once=lambda s: s.worker_threads
)
