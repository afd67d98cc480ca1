"""Exercise for stage 3: write the textbook dynamic batcher.

Stage 2 makes one model call per request. Here many requests share one call: each request puts
its texts in one queue with one future and awaits it; one background task waits for a first
text, then up to BATCH_WINDOW_MS for company, takes the oldest texts that fit MAX_BATCH_SIZE and
MAX_BATCH_TOKENS, runs them in an executor thread and hands each caller its own rows. If the
model raises, every caller of that batch gets the error. Chapter: docs/stage3.md, "The textbook
batcher" (the refinements after it are not part of this exercise).

Write the five methods marked TODO, in this order: ``submit``, ``_wait_for_batch``, ``_take``,
``_run_rows`` (the model thread: one call, its errors kept by row) and ``_run_batch`` (the
fan-out). The rest is given: the loop that hands batches to the model slots, here; the
state, starting and closing, the hooks and the counters, in ``stage3_batching/base.py``, which
this class extends (read its ``__init__`` for the fields you use). What a caller leaves in the
queue is in ``stage3_batching/pending.py``: read ``PendingRequest`` (``deliver``, ``fail``,
``expire``) and ``QueuedText`` first.

Check your work (stage 3's own batcher tests, those of the textbook batcher, run against this class):

    make exercise STAGE=3

``make exercise STAGE=3 SOLUTION=1`` runs the same tests against ``stage3_batching/batcher.py``,
one solution (the server runs it with the refinements of the chapter: ``stage3_batching/app.py``).

Hints:
- Never block the event loop: no ``time.sleep``, no model call outside the executor.
- ``asyncio.Event`` wakes the loop; ``loop.call_later(seconds, event.set)`` is a timer you can cancel.
- A caller's future is created with ``asyncio.get_running_loop().create_future()``; a cancelled
  caller's future is done, so ``_still_wanted`` drops its texts before the model.
- The queue is a ``deque`` in arrival order: take from the left (``popleft``), look at ``[0]``.
- ``fits(n, longest, settings)`` says whether n texts padded to ``longest`` tokens fit one batch.
- A test that fails with ``TimeoutError`` in ``hold_model`` or ``wait_entered`` means no batch
  reached the model: the error that stopped it is under "Captured log call" in the test's report.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import numpy as np

from common.engine import TokenizedText
from common.limits import APIError
from stage3_batching.base import BatcherBase, fits  # noqa: F401 (you call fits in _take)
from stage3_batching.pending import BatchOutcome, Computed, QueuedText

log = logging.getLogger("embedserve.batcher")


class Batcher(BatcherBase):
    async def submit(self, tokens: Sequence[TokenizedText], *, deadline: float | None = None) -> BatchOutcome:
        """Queue the texts, wait for all their vectors (in order).

        TODO:
        1. No texts: answer at once, ``BatchOutcome(np.zeros((0, 0), np.float32), 0.0, 0.0, [])``.
        2. One ``PendingRequest`` for the caller (a new future, ``len(tokens)`` texts left, the
           deadline), and one ``QueuedText`` per text at the end of ``self._queue`` (its index in
           the caller's list, its ``ids`` and ``n_tokens``).
        3. A deadline (``time.monotonic()``, the event loop's clock): at that moment call
           ``self._expire(req)``; keep the timer in ``req.timer``.
        4. Wake the loop (``self._wakeup``) when it waits for a first text (``self._idle``) or
           when a full batch (MAX_BATCH_SIZE texts) is queued.
        5. Await the future; however that ends, cancel ``req.timer``.
        """
        if self._closing or self._task is None or self._task.done():
            raise APIError(503, "the batcher is not running", headers={"Retry-After": "1"})
        raise NotImplementedError("TODO: submit: queue the texts with one future and await it")

    # --- given: the loop that hands batches to the model slots (the rest is in base.py) -------
    async def _loop(self, slots: asyncio.Semaphore) -> None:
        running: set[asyncio.Task[None]] = set()
        while True:
            await slots.acquire()  # a free model slot first; meanwhile the queue fills
            try:
                tier = await self._wait_for_batch()
                if tier is None:  # closing, and nothing is left: let the running batches finish
                    await asyncio.gather(*running)
                    return
                batch = self._take()
            except Exception as exc:
                # A bug in _wait_for_batch or _take. The stage's loop keeps serving; here it
                # stops and hands the error to every caller queued, so a test shows it at once.
                log.exception("the batcher's loop stopped on an error in _wait_for_batch or _take")
                for text in self._drain():
                    text.req.fail(exc)
                return
            if not batch:  # every caller in it was gone
                slots.release()
                await asyncio.sleep(0)
                continue
            for text in batch:
                text.req.taken += 1  # in a batch now: a deadline no longer stops it
            self._in_flight += 1
            self._in_flight_texts += len(batch)
            task = asyncio.create_task(self._run_in_slot(batch, tier, slots))
            running.add(task)
            task.add_done_callback(running.discard)

    # --- to write: waiting, taking, running --------------------------------------------------
    async def _wait_for_batch(self) -> str | None:
        """Wait for a first text, then up to the window for a full batch; return the batch's tier.

        TODO:
        1. While the queue is empty: if closing, return None (the loop then stops); otherwise say
           the loop is idle (``self._idle``), clear ``self._wakeup`` and wait for it.
        2. Not idle any more. The tier is ``self.tier(len(self._queue))``; the window ends
           ``self.window_s(tier)`` seconds after the oldest queued text arrived
           (``self._queue[0].req.enqueued``, a ``time.perf_counter()``).
        3. While fewer than MAX_BATCH_SIZE texts are queued and ``close()`` has not begun: if the
           window has ended, stop waiting; otherwise clear ``self._wakeup``, start a timer that
           sets it when the window ends, wait for it (a full batch, the window's end or close),
           and cancel the timer.
        4. Return the tier.
        """
        raise NotImplementedError("TODO: _wait_for_batch: a first text, then the window")

    def _take(self) -> list[QueuedText]:
        """The next batch: the oldest texts that fit MAX_BATCH_SIZE and MAX_BATCH_TOKENS.

        TODO: take texts from the front of the queue while the batch has fewer than
        ``self.batch_limit()``. A text whose caller is gone (``not self._still_wanted(text)``)
        is removed and skipped. Stop before a text that would make the batch not ``fits`` (every
        row is padded to the longest one), but the first text always goes, even alone over
        MAX_BATCH_TOKENS: otherwise it could never run.
        """
        raise NotImplementedError("TODO: _take: the oldest texts that fit the batch")

    def _still_wanted(self, text: QueuedText) -> bool:
        """Given: False for a text whose caller is gone (cancelled, past its deadline, failed)."""
        req = text.req
        if req.deadline is not None and time.monotonic() > req.deadline:
            req.expire()
        if req.future.done():
            self.stats.skipped_texts += 1
            return False
        return True

    async def _run_batch(self, batch: list[QueuedText], tier: str) -> None:
        """Run the batch in a model slot and hand each caller its rows.

        TODO:
        1. ``started = time.perf_counter()``; run ``self._timed(batch)`` in ``self._pool`` (the
           event loop's ``run_in_executor``) and await the ``Computed`` it returns.
        2. ``record = self._record(batch, tier, started, done)``.
        3. Row ``i`` is ``batch[i]``'s answer: if ``done.vectors`` is None or ``i`` is in
           ``done.errors``, fail that caller with the error; otherwise deliver the vector
           (``deliver(text.index, done.vectors[i], record, record.queue_ms[i])``).
        4. ``self._report(record)``.
        """
        raise NotImplementedError("TODO: _run_batch: run the batch, hand each caller its rows")

    # --- the model thread (runs in the executor, never on the event loop) -------------------
    def _compute(self, batch: list[QueuedText]) -> Computed:
        """Given: one model call on the whole batch, every row padded to its longest."""
        ids = [t.ids for t in batch]
        done = Computed(len(batch), padded_tokens=len(batch) * max(t.n_tokens for t in batch))
        self._run_rows(ids, list(range(len(batch))), done)
        return done

    def _run_rows(self, ids: list[np.ndarray], rows: list[int], done: Computed) -> None:
        """One model call on these rows of the batch; if it raises, each of them gets the error.

        TODO: ``done.put(rows, ...)`` the vectors of ``self._call(ids, rows, done)``; if the call
        raises, record the exception for every one of ``rows`` in ``done.errors`` (row -> error).
        Do not let it escape: the callers get it through ``_run_batch``.
        """
        raise NotImplementedError("TODO: _run_rows: one model call, its error kept by row")
