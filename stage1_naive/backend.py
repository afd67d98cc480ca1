"""Stage 1's backend: the model called straight from the ``async def`` handler.

It is correct, and it is the most common first attempt. It also blocks the event loop:
while the model runs, this process cannot accept a connection, answer ``/health`` or even
read the next request. ``stage2_threadpool`` fixes this.
"""

from __future__ import annotations

import time

import numpy as np

from common.backend import EmbedJob, EmbedResult, tokenize
from common.engine import Engine, l2_normalize
from common.settings import Settings


# --8<-- [start:backend]
class NaiveBackend:
    draining = False  # never: stage 4 adds a graceful drain

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def start(self) -> None:  # the lifespan has loaded the model: nothing else to start
        pass

    async def close(self) -> None:
        pass

    async def embed(self, job: EmbedJob) -> EmbedResult:
        tokens = await tokenize(self.engine, job)  # ids, counts, 422 past the token limit
        vectors, inference_ms = await self.run_model([t.ids for t in tokens])
        if job.normalize:
            vectors = l2_normalize(vectors)
        return EmbedResult(vectors, [t.n_tokens for t in tokens], [t.truncated for t in tokens], inference_ms)

    async def run_model(self, ids: list[np.ndarray]) -> tuple[np.ndarray, float]:
        """The model's vectors for these token ids, and the call's time in ms."""
        # Blocks the event loop for the whole model call: nothing else in this process
        # runs until it returns, although this is an `async def`. stage2_threadpool moves
        # this call to a thread.
        return timed_run(self.engine, ids)


def timed_run(engine: Engine, ids: list[np.ndarray]) -> tuple[np.ndarray, float]:
    """``engine.run``, timed where it runs (x-inference-time is the model alone)."""
    started = time.perf_counter()
    return engine.run(ids), (time.perf_counter() - started) * 1e3


# --8<-- [end:backend]


def make_backend(engine: Engine, settings: Settings) -> NaiveBackend:
    return NaiveBackend(engine)
