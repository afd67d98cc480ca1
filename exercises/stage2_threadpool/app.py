"""Exercise for stage 2: take the model call off the event loop.

Stage 1's backend (stage1_naive/app.py) calls the model inside ``async def embed``. While the
model runs, the event loop runs nothing else: no other request is read, not even ``/health``.
Write ``ThreadPoolBackend`` so the model runs in a pool of ``threads`` worker threads and the
event loop stays free while it does.

Check your work (stage 2's own tests, run against this file):

    make exercise STAGE=2

The tests start this file as a server (``python -m common.serve exercises.stage2_threadpool``)
and check that ``/health`` answers while a long request computes, that the API contract holds,
and that the vectors equal the engine's. ``make exercise STAGE=2 SOLUTION=1`` runs the same tests
against ``stage2_threadpool/app.py``, one solution.

Hints: ``concurrent.futures.ThreadPoolExecutor``; ``asyncio.get_running_loop().run_in_executor``.
ONNX Runtime releases the GIL while it computes, so a thread is enough.
"""

from __future__ import annotations

import time

import numpy as np

from common.api import EmbedJob, EmbedResult, create_app, tokenize
from common.engine import Engine, l2_normalize
from common.settings import Settings


class ThreadPoolBackend:
    def __init__(self, engine: Engine, threads: int) -> None:
        self.engine = engine
        # TODO: a pool of `threads` worker threads for the model calls.

    async def embed(self, job: EmbedJob) -> EmbedResult:
        tokens = await tokenize(self.engine, job)  # cheap: stays on the event loop
        started = time.perf_counter()
        vectors = await self.run_model([t.ids for t in tokens])
        inference_ms = (time.perf_counter() - started) * 1e3
        if job.normalize:
            vectors = l2_normalize(vectors)
        return EmbedResult(vectors, [t.n_tokens for t in tokens], [t.truncated for t in tokens], inference_ms)

    async def run_model(self, ids: list[np.ndarray]) -> np.ndarray:
        """``self.engine.run(ids)``, computed in a worker thread; the event loop waits without blocking.

        Stage 1 simply called ``self.engine.run(ids)`` here.
        """
        raise NotImplementedError("TODO: run the model in a worker thread and await the result")

    async def close(self) -> None:
        """Called once when the server stops."""
        # TODO: shut the pool down (let the running calls finish).


def make_backend(engine: Engine, settings: Settings) -> ThreadPoolBackend:
    return ThreadPoolBackend(engine, settings.worker_threads)


app = create_app(
    "exercise: stage 2", make_backend, description=__doc__ or "", calls_at_once=lambda s: s.worker_threads
)
