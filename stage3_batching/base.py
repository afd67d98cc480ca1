"""What every batcher has around the idea: its state, the hooks the refinements override, start
and close, freeing a model slot after its batch, and the figures it reports. ``batcher.py`` is
the idea itself; read it first.

The hooks, each a one-line default here, are where the chapter's refinements plug in: ``tier``
and ``window_s`` (how long a batch waits: ``tiers.py``), ``batch_limit`` and ``batches_at_once``
(how much a batch takes, how many are handed over: ``slots.py``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from common.limits import APIError
from common.settings import Settings
from stage3_batching.pending import Computed, PendingRequest, QueuedText
from stage3_batching.stats import BatcherStats, BatchRecord

log = logging.getLogger("embedserve.batcher")


def fits(n: int, longest: int, s: Settings) -> bool:
    """Whether ``n`` texts padded to ``longest`` tokens fit one batch."""
    return n <= s.max_batch_size and n * longest <= s.max_batch_tokens


class BatcherBase:
    def __init__(
        self,
        run: Callable[[list[np.ndarray]], np.ndarray],
        settings: Settings,
        *,
        on_batch: Callable[[BatchRecord], None] | None = None,
    ) -> None:
        self._run, self.settings, self._on_batch = run, settings, on_batch
        self.stats = BatcherStats()
        self._queue: deque[QueuedText] = deque()  # arrival order
        self._wakeup = asyncio.Event()  # set: the loop has something to decide
        self._idle = True  # the loop waits for a first text
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight = 0  # batches handed to the model slots (running, or ready for a slot)
        self._in_flight_texts = 0  # the texts in them

    # --- the hooks ---------------------------------------------------------------------------
    def tier(self, depth: int) -> str:
        """The load tier a batch counts under. One here: every batch may wait the window, what
        ``LoadTiers`` (tiers.py) calls MEDIUM."""
        return "medium"

    def window_s(self, tier: str) -> float:
        """How long a batch may wait for more texts, counted from its oldest text's arrival."""
        return self.settings.batch_window_ms / 1e3

    def batch_limit(self) -> int:
        """Most texts the next batch may take."""
        return self.settings.max_batch_size

    def batches_at_once(self) -> int:
        """Batches handed to the model slots at once: one per slot."""
        return self.settings.batch_concurrency

    @property
    def queue_depth(self) -> int:
        """Texts queued, not yet taken into a batch."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # --- start and close ---------------------------------------------------------------------
    async def start(self) -> None:
        # A thread per model slot: BATCH_CONCURRENCY batches side by side, no more.
        slots = self.settings.batch_concurrency
        self._pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="batcher")
        dispatch = asyncio.Semaphore(self.batches_at_once())
        self._task = asyncio.create_task(self._loop(dispatch), name="batcher")

    async def _loop(self, slots: asyncio.Semaphore) -> None:
        raise NotImplementedError  # batcher.py

    async def _run_in_slot(self, batch: list[QueuedText], tier: str, slots: asyncio.Semaphore) -> None:
        """A batch the loop handed to a model slot: run it, and free the slot whatever happens."""
        try:
            await self._run_batch(batch, tier)
        except Exception as exc:  # answer this batch's callers; the loop keeps serving
            fail_batch(batch, exc)
        finally:
            self._in_flight -= 1
            self._in_flight_texts -= len(batch)
            slots.release()

    async def _run_batch(self, batch: list[QueuedText], tier: str) -> None:
        raise NotImplementedError  # batcher.py

    async def close(self) -> None:
        """Finish everything already queued, then stop."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await asyncio.wait([self._task])
        for text in self._drain():  # only if the loop died: nobody waits forever
            text.req.fail(APIError(503, "the server is shutting down"))
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _drain(self) -> list[QueuedText]:
        left = list(self._queue)
        self._queue.clear()
        return left

    def _expire(self, req: PendingRequest) -> None:
        """The deadline passed. Only a caller still wholly queued gets its 504."""
        if req.taken == 0:  # texts already in the model finish normally
            req.expire()

    # --- the figures -------------------------------------------------------------------------
    def _timed(self, batch: list[QueuedText]) -> Computed:
        """Executor thread: ``_compute``, and which slot ran it for how long (slot utilisation)."""
        started = time.perf_counter()
        done = self._compute(batch)
        done.model_s, done.slot = time.perf_counter() - started, threading.current_thread().name
        return done

    def _compute(self, batch: list[QueuedText]) -> Computed:
        raise NotImplementedError  # batcher.py

    def _call(self, ids: list[np.ndarray], rows: list[int], done: Computed) -> np.ndarray:
        """Executor thread: the model call itself, checked: never hand a caller someone else's vector."""
        done.calls += 1
        vectors = self._run([ids[r] for r in rows])
        if vectors.shape[0] != len(rows):
            raise RuntimeError(f"the model returned {vectors.shape[0]} vectors for {len(rows)} texts")
        return vectors

    def _record(self, batch: list[QueuedText], tier: str, started: float, done: Computed) -> BatchRecord:
        """What the batch was, for /v1/batcher/metrics and the ``on_batch`` observers."""
        return BatchRecord(
            size=len(batch),
            padded_tokens=done.padded_tokens,
            real_tokens=sum(t.n_tokens for t in batch),
            tier=tier,
            queue_ms=[(started - t.req.enqueued) * 1e3 for t in batch],
            inference_ms=(time.perf_counter() - started) * 1e3,
            error=next((type(e).__name__ for e in done.errors.values()), None),
            calls=done.calls,
            started=started,
            slot=done.slot,
            model_s=done.model_s,
        )

    def _report(self, record: BatchRecord) -> None:
        """Count the batch, tell the observer; an observer's bug never stops the batcher."""
        self.stats.add(record)
        if self._on_batch is not None:
            try:
                self._on_batch(record)
            except Exception:
                log.exception("on_batch observer failed")


def fail_batch(batch: list[QueuedText], exc: Exception) -> None:
    """An error outside the model call: log it, and answer every caller in the batch with it."""
    log.exception("batcher loop error")
    for text in batch:
        text.req.fail(exc)
