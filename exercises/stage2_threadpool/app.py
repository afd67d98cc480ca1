"""Exercise for stage 2: take the model call off the event loop.

Stage 1's backend (stage1_naive/backend.py) calls the model inside ``async def run_model``. While
the model runs, the event loop runs nothing else: no other request is read, not even
``/health``. Write ``ThreadPoolBackend`` so the model runs in a pool of ``threads`` worker
threads and the event loop stays free while it does.

Your class extends stage 1's ``NaiveBackend``, which gives the rest: ``embed`` (tokenize, call
``run_model``, normalize, answer) and ``timed_run`` (the model call, timed). Write ``__init__``
(the pool), ``run_model`` and ``close``.

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

import numpy as np

from common.api import create_app
from common.engine import Engine
from common.settings import Settings
from stage1_naive.backend import NaiveBackend, timed_run  # noqa: F401 (given: the model call, timed)


class ThreadPoolBackend(NaiveBackend):
    def __init__(self, engine: Engine, threads: int) -> None:
        super().__init__(engine)
        # TODO: a pool of `threads` worker threads for the model calls.

    async def run_model(self, ids: list[np.ndarray]) -> tuple[np.ndarray, float]:
        """``timed_run(self.engine, ids)``, computed in a worker thread; the event loop waits
        without blocking. Stage 1 calls it right here, on the event loop."""
        raise NotImplementedError(
            "TODO (exercises/stage2_threadpool/app.py): run the model in a worker thread and await the result"
        )

    async def close(self) -> None:
        """Called once when the server stops."""
        # TODO: shut the pool down (let the running calls finish).


def make_backend(engine: Engine, settings: Settings) -> ThreadPoolBackend:
    return ThreadPoolBackend(engine, settings.worker_threads)


app = create_app(
    "exercise: stage 2", make_backend, description=__doc__ or "", calls_at_once=lambda s: s.worker_threads
)
