"""Stage 2: the model runs off the event loop, in a bounded thread pool.

The handler awaits the model call in a pool of WORKER_THREADS threads, so the event
loop keeps accepting connections and answering ``/health`` while the model works.
ONNX Runtime releases the GIL during the call, and ONNX_INTRA_THREADS decides how many
cores one call uses: the two settings multiply, and by default the calls share the cores
out (stage 2's thread sweep, docs/lab/stage2.md, measures the layouts).

Every request still makes its own model call. ``stage3_batching`` groups them.

    make stage2   # uvicorn stage2_threadpool.app:app on 127.0.0.1:8000
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from common.api import create_app
from common.engine import Engine
from common.settings import Settings
from stage1_naive.app import NaiveBackend, timed_run


# --8<-- [start:backend]
class ThreadPoolBackend(NaiveBackend):
    def __init__(self, engine: Engine, threads: int) -> None:
        super().__init__(engine)
        # NEW: a pool of our own, sized by a setting, instead of blocking the loop
        # (or borrowing Starlette's 40-thread pool, which would oversubscribe 2 cores).
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="model")

    async def run_model(self, ids: list[np.ndarray]) -> tuple[np.ndarray, float]:
        # NEW: the event loop stays free while a pool thread runs (and times) the model; the wait
        # for a free thread is in x-total-time, not in x-inference-time.
        return await asyncio.get_running_loop().run_in_executor(self.pool, timed_run, self.engine, ids)

    async def close(self) -> None:
        self.pool.shutdown(wait=True)


# --8<-- [end:backend]


def make_backend(engine: Engine, settings: Settings) -> ThreadPoolBackend:
    return ThreadPoolBackend(engine, settings.worker_threads)


app = create_app(
    "stage2_threadpool", make_backend, description=__doc__ or "", calls_at_once=lambda s: s.worker_threads
)
