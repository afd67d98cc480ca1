"""Dynamic batching: many requests' texts, one model call.

Each request puts its texts in one queue (``batch_queue.py``) with one future and awaits
it. One background task takes batches from the queue, runs the model in one executor
thread (the model call gets the cores, the event loop stays free) and resolves the futures.

* Tiers: below BATCH_LOW_THRESHOLD queued texts a batch goes at once; at MEDIUM and
  HIGH depth it waits up to BATCH_WINDOW_MS (from the oldest text's arrival) to fill.
* Failures: a batch that raises is split in halves until the guilty text is alone, so
  only its caller gets the error; the loop logs and carries on, no future is left pending.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from common.engine import TokenizedText
from common.limits import APIError
from common.settings import Settings
from stage3_batching.batch_queue import BatchQueue, DeadlineExceeded, PendingRequest, QueuedText
from stage3_batching.stats import BatcherStats, BatchRecord

__all__ = ["BatchOutcome", "BatchRecord", "Batcher", "BatcherStats", "DeadlineExceeded"]
log = logging.getLogger("embedserve.batcher")
Rows: TypeAlias = np.ndarray | list[np.ndarray | Exception]  # all rows, or (after a failure) row by row
CONFIG = ("max_batch_size", "max_batch_tokens", "batch_window_ms", "batch_low_threshold",
          "batch_high_threshold", "group_by_length", "group_window")  # fmt: skip


@dataclass(slots=True)
class BatchOutcome:
    """What ``submit`` returns: raw mean-pooled vectors (not normalized) in the caller's order."""

    vectors: np.ndarray
    queue_ms: float  # longest wait of the caller's texts
    inference_ms: float  # summed over the caller's batches
    batch_sizes: list[int]


# --8<-- [start:submit]
class Batcher:
    def __init__(
        self,
        run: Callable[[list[np.ndarray]], np.ndarray],
        settings: Settings,
        *,
        on_batch: Callable[[BatchRecord], None] | None = None,
    ) -> None:
        self._run, self.settings, self._on_batch = run, settings, on_batch
        self.stats = BatcherStats()
        self._queue = BatchQueue(settings, self.stats)
        self._wakeup = asyncio.Event()
        self._idle = True  # the loop waits for a first text
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight = 0

    async def submit(self, tokens: Sequence[TokenizedText], *, deadline: float | None = None) -> BatchOutcome:
        """Queue the texts, wait for all their vectors (in order)."""
        if self._closing or self._task is None or self._task.done():
            raise APIError(503, "the batcher is not running", headers={"Retry-After": "1"})
        if not tokens:
            return BatchOutcome(np.zeros((0, 0), np.float32), 0.0, 0.0, [])
        loop = asyncio.get_running_loop()
        req = PendingRequest(loop.create_future(), len(tokens), deadline)
        self._queue.fresh.extend(QueuedText(req, i, t.ids, len(t.ids)) for i, t in enumerate(tokens))
        if deadline is not None:
            req.timer = loop.call_later(max(deadline - time.monotonic(), 0), self._expire, req)
        if self._idle or len(self._queue.fresh) >= self.settings.max_batch_size:
            self._wakeup.set()  # wake the loop only when it has something to decide
        try:
            return await req.future  # cancelled with the caller: its queued texts are skipped
        finally:
            if req.timer is not None:
                req.timer.cancel()

    def _expire(self, req: PendingRequest) -> None:
        if req.taken == 0:  # still wholly queued; texts already in the model finish normally
            req.expire()

    # --8<-- [end:submit]

    @property
    def queue_depth(self) -> int:
        """Texts queued, not yet taken into a batch."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def config(self) -> dict[str, Any]:
        return {key: getattr(self.settings, key) for key in CONFIG}

    def tier(self, depth: int) -> str:
        if depth < self.settings.batch_low_threshold:
            return "low"
        return "medium" if depth < self.settings.batch_high_threshold else "high"

    async def start(self) -> None:
        # One thread: batches never run side by side, each call gets every core.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batcher")
        self._task = asyncio.create_task(self._loop(), name="batcher")

    async def close(self) -> None:
        """Finish everything already queued, then stop."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await asyncio.wait([self._task])
        for text in self._queue.drain():  # only if the loop died: nobody waits forever
            text.req.fail(APIError(503, "the server is shutting down"))
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # --8<-- [start:loop]
    async def _loop(self) -> None:
        while True:
            batch: list[QueuedText] = []
            try:
                tier = await self._wait_for_batch()
                if tier is None:
                    return  # closing, and nothing is left
                batch = self._queue.take()
                if batch:
                    await self._run_batch(batch, tier)
            except Exception as exc:  # never die: answer this batch's callers, keep serving
                log.exception("batcher loop error")
                for entry in batch:
                    entry.req.fail(exc)

    async def _wait_for_batch(self) -> str | None:
        """Wait for a first text; at MEDIUM/HIGH depth, wait up to the window for a full batch."""
        queue = self._queue.fresh
        if self._queue.has_cut_batches:  # batches cut earlier have waited already
            return self.tier(self.queue_depth)
        while not queue:
            if self._closing:
                return None
            self._idle = True
            self._wakeup.clear()
            await self._wakeup.wait()
        self._idle = False
        tier = self.tier(len(queue))
        if tier == "low":
            return tier  # a lone request is not held hostage for friends that may never come
        window_end = queue[0].req.enqueued + self.settings.batch_window_ms / 1e3
        while len(queue) < self.settings.max_batch_size and not self._closing:
            left = window_end - time.perf_counter()
            if left <= 0:
                break
            self._wakeup.clear()
            timer = asyncio.get_running_loop().call_later(left, self._wakeup.set)
            await self._wakeup.wait()  # a full batch, the window's end, or close()
            timer.cancel()
        return tier

    # --8<-- [end:loop]

    # --8<-- [start:run]
    async def _run_batch(self, batch: list[QueuedText], tier: str) -> None:
        started = time.perf_counter()
        ids = [e.ids for e in batch]
        self._in_flight = 1
        try:  # NEW: the model runs in the one executor thread; the event loop keeps serving
            rows = await asyncio.get_running_loop().run_in_executor(self._pool, self._compute, ids)
        finally:
            self._in_flight = 0
        lengths = [e.n_tokens for e in batch]
        record = BatchRecord(
            size=len(batch),
            padded_tokens=len(batch) * max(lengths),
            real_tokens=sum(lengths),
            tier=tier,
            queue_ms=[(started - e.req.enqueued) * 1e3 for e in batch],
            inference_ms=(time.perf_counter() - started) * 1e3,
            error=None if isinstance(rows, np.ndarray) else _first_error(rows),
        )
        for row, entry in enumerate(batch):  # hand each caller its rows
            req, value = entry.req, rows[row]
            if req.future.done():
                continue
            if isinstance(value, Exception):
                req.fail(value)
                continue
            if req.vectors is None:
                req.vectors = np.empty((req.left, len(value)), np.float32)
            req.vectors[entry.index] = value
            req.left -= 1
            req.queue_ms = max(req.queue_ms, record.queue_ms[row])
            if req.last_batch is not record:  # the caller's first text in this batch
                req.last_batch = record
                req.batch_sizes.append(record.size)
                req.inference_ms += record.inference_ms
            if req.left == 0:
                req.future.set_result(
                    BatchOutcome(req.vectors, req.queue_ms, req.inference_ms, req.batch_sizes)
                )
        self.stats.add(record)
        if self._on_batch is not None:
            try:
                self._on_batch(record)
            except Exception:
                log.exception("on_batch observer failed")

    # --8<-- [end:run]

    # --8<-- [start:compute]
    def _compute(self, ids: list[np.ndarray]) -> Rows:
        """Run the model (executor thread); if it raises, split the batch to find the guilty text."""
        try:
            return self._checked_run(ids)
        except Exception as exc:
            if len(ids) == 1:
                return [exc]
        half = len(ids) // 2
        return [*self._compute(ids[:half]), *self._compute(ids[half:])]

    def _checked_run(self, ids: list[np.ndarray]) -> np.ndarray:
        vectors = self._run(ids)
        if vectors.shape[0] != len(ids):  # never hand a caller someone else's vector
            raise RuntimeError(f"the model returned {vectors.shape[0]} vectors for {len(ids)} texts")
        return vectors

    # --8<-- [end:compute]


def _first_error(rows: list[np.ndarray | Exception]) -> str | None:
    return next((type(r).__name__ for r in rows if isinstance(r, Exception)), None)
