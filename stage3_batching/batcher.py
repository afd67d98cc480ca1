"""Dynamic batching: many requests' texts, one model call.

Each request puts its texts in one queue (``batch_queue.py``) with one future and awaits
it. One background task takes batches from the queue and runs each in an executor thread
(the event loop stays free), up to BATCH_CONCURRENCY batches at once, and resolves the
futures. The next batch is formed only when a model slot is free, so texts that arrive
while every slot is busy make the next batch fuller instead of waiting in a second line.

* Tiers: below BATCH_LOW_THRESHOLD queued texts a batch goes at once; at MEDIUM and
  HIGH depth it waits up to BATCH_WINDOW_MS (from the oldest text's arrival) to fill.
* Length buckets (SPLIT_BY_LENGTH): a batch runs as a few model calls of similar lengths
  when the padding saved is worth more than the extra calls (CALL_OVERHEAD_TOKENS).
* Failures: a call that raises is split in halves until the guilty text is alone, so
  only its caller gets the error; the loop logs and carries on, no future is left pending.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np

from common.engine import TokenizedText
from common.limits import APIError
from common.settings import Settings
from stage3_batching.batch_queue import BatchQueue, DeadlineExceeded, PendingRequest, QueuedText
from stage3_batching.stats import BatcherStats, BatchRecord

__all__ = ["BatchOutcome", "BatchRecord", "Batcher", "BatcherStats", "DeadlineExceeded"]
log = logging.getLogger("embedserve.batcher")
CONFIG = ("max_batch_size", "max_batch_tokens", "batch_concurrency", "batch_window_ms",
          "batch_low_threshold", "batch_high_threshold", "group_by_length", "group_window",
          "split_by_length", "call_overhead_tokens")  # fmt: skip


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
        # A thread per model slot: BATCH_CONCURRENCY batches side by side, no more.
        slots = self.settings.batch_concurrency
        self._pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="batcher")
        self._task = asyncio.create_task(self._loop(asyncio.Semaphore(slots)), name="batcher")

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
    async def _loop(self, slots: asyncio.Semaphore) -> None:
        running: set[asyncio.Task[None]] = set()
        while True:
            batch: list[QueuedText] = []
            try:
                await slots.acquire()  # a free model slot first; meanwhile the queue fills
                tier = await self._wait_for_batch()
                if tier is None:  # closing, and nothing is left: let the running batches finish
                    slots.release()
                    await asyncio.gather(*running)
                    return
                batch = self._queue.take()
                if not batch:
                    slots.release()
                    continue
                task = asyncio.create_task(self._run_in_slot(batch, tier, slots))
                running.add(task)
                task.add_done_callback(running.discard)
            except Exception as exc:  # never die: answer this batch's callers, keep serving
                _fail(batch, exc)

    async def _run_in_slot(self, batch: list[QueuedText], tier: str, slots: asyncio.Semaphore) -> None:
        try:
            await self._run_batch(batch, tier)
        except Exception as exc:  # answer this batch's callers; the loop keeps serving
            _fail(batch, exc)
        finally:
            slots.release()

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
        self._in_flight += 1
        try:  # NEW: the model runs in an executor thread; the event loop keeps serving
            done = await asyncio.get_running_loop().run_in_executor(
                self._pool, self._compute, [t.ids for t in batch], [id(t.req) for t in batch]
            )
        finally:
            self._in_flight -= 1
        record = BatchRecord(
            size=len(batch),
            padded_tokens=done.padded_tokens,
            real_tokens=sum(t.n_tokens for t in batch),
            tier=tier,
            queue_ms=[(started - t.req.enqueued) * 1e3 for t in batch],
            inference_ms=(time.perf_counter() - started) * 1e3,
            error=next((type(e).__name__ for e in done.errors.values()), None),
            calls=done.calls,
        )
        vectors, errors = done.vectors, done.errors
        for row, text in enumerate(batch):  # hand each caller its rows
            req = text.req
            if req.future.done():
                continue
            if vectors is None or row in errors:
                req.fail(errors[row])
                continue
            if req.vectors is None:
                req.vectors = np.empty((req.left, vectors.shape[1]), np.float32)
            req.vectors[text.index] = vectors[row]
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
    def _compute(self, ids: list[np.ndarray], owners: list[int]) -> _Computed:
        """Run one batch (executor thread): one model call, or calls of similar lengths."""
        done = _Computed(len(ids))
        if not self.settings.split_by_length:
            done.padded_tokens = len(ids) * max(len(i) for i in ids)
            self._run_rows(ids, np.arange(len(ids)), done)
            return done
        units: dict[int, list[int]] = {}  # a request's texts stay together, in its order
        for row, owner in enumerate(owners):
            units.setdefault(owner, []).append(row)
        groups = sorted(units.values(), key=lambda rows: max(len(ids[r]) for r in rows))
        longest = np.array([max(len(ids[r]) for r in rows) for rows in groups])
        sizes = np.array([len(rows) for rows in groups])
        for bucket in length_buckets(longest, self.settings.call_overhead_tokens, sizes):
            rows = np.array([r for unit in groups[bucket] for r in unit])
            done.padded_tokens += len(rows) * int(longest[bucket][-1])
            self._run_rows(ids, rows, done)
        return done

    def _run_rows(self, ids: list[np.ndarray], rows: np.ndarray, done: _Computed) -> None:
        """One model call; if it raises, split it in halves until the guilty text is alone."""
        done.calls += 1
        try:
            vectors = self._run([ids[i] for i in rows])
            if vectors.shape[0] != len(rows):  # never hand a caller someone else's vector
                raise RuntimeError(f"the model returned {vectors.shape[0]} vectors for {len(rows)} texts")
        except Exception as exc:
            if len(rows) == 1:
                done.errors[int(rows[0])] = exc
                return
            self._run_rows(ids, rows[: len(rows) // 2], done)
            self._run_rows(ids, rows[len(rows) // 2 :], done)
            return
        if done.vectors is None:
            done.vectors = np.zeros((done.n, vectors.shape[1]), np.float32)
        done.vectors[rows] = vectors

    # --8<-- [end:compute]


@dataclass(slots=True)
class _Computed:
    """One batch's result: vectors by row, and the rows whose text made the model raise."""

    n: int
    vectors: np.ndarray | None = None
    errors: dict[int, Exception] = field(default_factory=dict)
    calls: int = 0
    padded_tokens: int = 0


# --8<-- [start:buckets]
def length_buckets(lengths: np.ndarray, overhead: int, rows: np.ndarray | None = None) -> list[slice]:
    """Cut ascending ``lengths`` into runs so that calls x overhead + padded tokens is least.

    ``rows[i]`` texts share length ``lengths[i]`` (one request's texts, padded together).
    On a CPU a padded token costs as much as a real one, and one more model call costs
    about ``overhead`` tokens (measured by benchmarks/stage3.py), so a batch of mixed
    lengths runs faster as a few calls of similar lengths than as one.
    """
    n = len(lengths)
    before = np.concatenate([[0], np.cumsum(np.ones(n, np.int64) if rows is None else rows)])
    best = np.zeros(n + 1)
    start = np.zeros(n + 1, np.int64)
    for end in range(1, n + 1):  # best[end]: cheapest way to run the first `end` units
        costs = best[:end] + overhead + (before[end] - before[:end]) * lengths[end - 1]
        start[end] = int(np.argmin(costs))
        best[end] = costs[start[end]]
    cuts = [n]
    while cuts[-1] > 0:
        cuts.append(int(start[cuts[-1]]))
    cuts.reverse()
    return [slice(a, b) for a, b in pairwise(cuts)]


# --8<-- [end:buckets]


def _fail(batch: list[QueuedText], exc: Exception) -> None:
    """An error outside the model call: log it, and answer every caller in the batch with it."""
    log.exception("batcher loop error")
    for entry in batch:
        entry.req.fail(exc)
