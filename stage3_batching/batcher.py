"""The textbook dynamic batcher: many requests' texts, one model call.

A request puts its texts in one queue with one future (``pending.py``) and awaits it. One
background task waits for a first text, then up to BATCH_WINDOW_MS (from the oldest text's
arrival) for a full batch, takes the oldest texts that fit MAX_BATCH_SIZE and MAX_BATCH_TOKENS,
and runs them in an executor thread, BATCH_CONCURRENCY batches side by side. Each caller gets
its own rows; if the model raises, every caller of that batch gets the error; a caller that is
gone (cancelled, past its deadline) is dropped before the model. That is the whole idea (Ray
Serve's ``batching.py`` has the same shape) and a working batcher on its own. What surrounds it
(state, start and close, freeing a slot after its batch, the hooks, the figures) is in ``base.py``.

The refinements the chapter adds one at a time are subclasses that override a method: ``tier``/
``window_s`` (tiers.py), ``_take`` (grouping.py), ``_compute``/``_run_rows`` (buckets.py,
isolation.py), ``batch_limit`` (slots.py). ``app.py`` composes them into the server's batcher.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np

from common.engine import TokenizedText
from common.limits import APIError
from stage3_batching.base import BatcherBase, fail_batch, fits
from stage3_batching.pending import BatchOutcome, Computed, DeadlineExceeded, PendingRequest, QueuedText
from stage3_batching.stats import BatcherStats, BatchRecord

__all__ = ["BatchOutcome", "BatchRecord", "Batcher", "BatcherStats", "Computed", "DeadlineExceeded", "fits"]


class Batcher(BatcherBase):
    # --8<-- [start:submit_method]
    async def submit(self, tokens: Sequence[TokenizedText], *, deadline: float | None = None) -> BatchOutcome:
        """Queue the texts, wait for all their vectors (in order)."""
        if self._closing or self._task is None or self._task.done():
            raise APIError(503, "the batcher is not running", headers={"Retry-After": "1"})
        if not tokens:
            return BatchOutcome(np.zeros((0, 0), np.float32), 0.0, 0.0, [])
        loop = asyncio.get_running_loop()
        req = PendingRequest(loop.create_future(), len(tokens), deadline)
        self._queue.extend(QueuedText(req, i, t.ids, t.n_tokens) for i, t in enumerate(tokens))
        if deadline is not None:
            req.timer = loop.call_later(max(deadline - time.monotonic(), 0), self._expire, req)
        if self._idle or len(self._queue) >= self.settings.max_batch_size:
            self._wakeup.set()  # wake the loop only when it has something to decide
        try:
            return await req.future  # cancelled with the caller: its queued texts are skipped
        finally:
            if req.timer is not None:
                req.timer.cancel()

    # --8<-- [end:submit_method]

    async def _loop(self, slots: asyncio.Semaphore) -> None:
        running: set[asyncio.Task[None]] = set()
        while True:
            await slots.acquire()  # a free model slot first; meanwhile the queue fills
            batch: list[QueuedText] = []
            try:
                tier = await self._wait_for_batch()
                if tier is None:  # closing, and nothing is left: let the running batches finish
                    await asyncio.gather(*running)
                    return
                batch = self._take()
                if batch:
                    for text in batch:
                        text.req.taken += 1  # in a batch now: a deadline no longer stops it
                    self._in_flight += 1
                    self._in_flight_texts += len(batch)
                    task = asyncio.create_task(self._run_in_slot(batch, tier, slots))
                    running.add(task)
                    task.add_done_callback(running.discard)
                    continue
            except Exception as exc:  # never die: answer this batch's callers, keep serving
                fail_batch(batch, exc)
            slots.release()  # nothing to run: every caller in it was gone

    # --8<-- [start:wait]
    async def _wait_for_batch(self) -> str | None:
        """Wait for a first text, then up to the window for a full batch. None: closing, queue empty."""
        while not self._queue:
            if self._closing:
                return None
            self._idle = True
            self._wakeup.clear()
            await self._wakeup.wait()
        self._idle = False
        tier = self.tier(len(self._queue))
        window_end = self._queue[0].req.enqueued + self.window_s(tier)
        while len(self._queue) < self.settings.max_batch_size and not self._closing:
            left = window_end - time.perf_counter()
            if left <= 0:
                break
            self._wakeup.clear()
            timer = asyncio.get_running_loop().call_later(left, self._wakeup.set)
            await self._wakeup.wait()  # a full batch, the window's end, or close()
            timer.cancel()
        return tier

    # --8<-- [end:wait]

    def _take(self) -> list[QueuedText]:
        """The next batch: the oldest texts that fit MAX_BATCH_SIZE and MAX_BATCH_TOKENS."""
        limit = self.batch_limit()
        batch: list[QueuedText] = []
        longest = 0
        while self._queue:
            text = self._queue[0]
            if not self._still_wanted(text):
                self._queue.popleft()
                continue
            if len(batch) >= limit and text.req is not batch[-1].req:
                break  # (a request's texts stay in one batch while they fit it)
            if batch and not fits(len(batch) + 1, max(longest, text.n_tokens), self.settings):
                break  # (a text over the token budget still runs: alone)
            batch.append(self._queue.popleft())
            longest = max(longest, text.n_tokens)
        return batch

    def _still_wanted(self, text: QueuedText) -> bool:
        """False for a text whose caller is gone (cancelled, past its deadline, failed): it is dropped."""
        req = text.req
        if req.deadline is not None and time.monotonic() > req.deadline:
            req.expire()
        if req.future.done():
            self.stats.skipped_texts += 1
            return False
        return True

    async def _run_batch(self, batch: list[QueuedText], tier: str) -> None:
        started = time.perf_counter()
        # NEW: the model runs in an executor thread; the event loop keeps serving
        done = await asyncio.get_running_loop().run_in_executor(self._pool, self._timed, batch)
        record = self._record(batch, tier, started, done)
        # --8<-- [start:fanout]
        for row, text in enumerate(batch):  # hand each caller its rows
            if done.vectors is None or row in done.errors:
                text.req.fail(done.errors[row])
            else:
                text.req.deliver(text.index, done.vectors[row], record, record.queue_ms[row])
        # --8<-- [end:fanout]
        self._report(record)

    # --- the model thread (an executor thread, never the event loop) --------------------------
    def _compute(self, batch: list[QueuedText]) -> Computed:
        """One model call on the whole batch, every row padded to its longest."""
        ids = [t.ids for t in batch]
        done = Computed(len(batch), padded_tokens=len(batch) * max(t.n_tokens for t in batch))
        self._run_rows(ids, list(range(len(batch))), done)
        return done

    def _run_rows(self, ids: list[np.ndarray], rows: list[int], done: Computed) -> None:
        """One model call on these rows of the batch; if it raises, each of them gets the error."""
        try:
            done.put(rows, self._call(ids, rows, done))
        except Exception as exc:
            done.errors.update(dict.fromkeys(rows, exc))
