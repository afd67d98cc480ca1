"""Stage 2's backend: the model runs off the event loop, in a bounded thread pool.

The handler awaits the model call in a pool of WORKER_THREADS threads, so the event
loop keeps accepting connections and answering ``/health`` while the model works.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from common.engine import Engine
from common.settings import Settings
from stage1_naive.backend import NaiveBackend, timed_run


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
