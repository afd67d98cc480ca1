"""Exercise for stage 3: write the textbook dynamic batcher.

Stage 2 makes one model call per request. Here many requests share one call: each request puts
its texts in one queue with one future and awaits it; one background task waits for a first
text, then up to BATCH_WINDOW_MS for company, takes the oldest texts that fit MAX_BATCH_SIZE and
MAX_BATCH_TOKENS, runs them in an executor thread and hands each caller its own rows. If the
model raises, every caller of that batch gets the error. Chapter: docs/stage3.md#the-textbook-batcher
(the refinements after it are not part of this exercise).

Write the five methods below, in the order a request meets them (and the first test names
them): ``submit``, ``_wait_for_batch``, ``_take``, ``_run_batch`` (the fan-out) and ``_run_rows``
(in the model thread: one call, its errors kept by row).

Everything else is given, inherited from the stage's own ``Batcher`` in
``stage3_batching/batcher.py``, so it is the code the server runs: read that file down to the
class first (``PendingRequest``, ``QueuedText``, ``Computed``, ``fits``), then its ``__init__``
(the fields you use), ``_loop`` (which calls your methods), ``_gone``, ``_expire``, ``_timed``,
``_record`` and ``_report``. Do not read the bodies of the five methods there: they are the
solution.

Check your work (stage 3's own batcher tests, those of the textbook batcher, run against this class):

    make exercise STAGE=3

The first test goes through the whole path once and names the first method still to write.
``make exercise STAGE=3 SOLUTION=1`` runs the same tests against the stage's ``Batcher``.

Hints:
- Never block the event loop: no ``time.sleep``, no model call outside the executor.
- ``asyncio.Event`` wakes the loop; ``async with asyncio.timeout(seconds):`` bounds a wait (it
  raises ``TimeoutError`` when the time is up); ``loop.call_later(seconds, f, arg)`` calls ``f``
  later and returns a handle you can cancel.
- A caller's future is created with ``asyncio.get_running_loop().create_future()``; a cancelled
  caller's future is done, so ``_gone`` drops its texts before the model.
- The queue is a ``deque`` in arrival order: take from the left (``popleft``), look at ``[0]``.
- ``fits(n, longest, settings)`` says whether n texts padded to ``longest`` tokens fit one batch.
- An error your methods raise reaches the test's request (the loop hands it to every caller
  queued); its traceback is under "Captured log call" in the test's report.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.engine import TokenizedText
from common.limits import APIError
from stage3_batching import batcher as stage
from stage3_batching.batcher import BatchOutcome, Computed, QueuedText


class Batcher(stage.Batcher):
    async def submit(self, tokens: Sequence[TokenizedText], *, deadline: float | None = None) -> BatchOutcome:
        """Queue the texts, wait for all their vectors (in order).

        TODO:
        1. No texts: answer at once, ``BatchOutcome(np.zeros((0, 0), np.float32), 0.0, 0.0, [])``.
        2. One ``PendingRequest`` for the caller (a new future, ``len(tokens)`` texts left, the
           deadline), and one ``QueuedText`` per text at the end of ``self._queue`` (its index in
           the caller's list, its ``ids`` and ``n_tokens``).
        3. A deadline (``time.monotonic()``, the event loop's clock): at that moment call
           ``self._expire(req)`` (``loop.call_later``).
        4. Wake the loop (``self._wakeup``) when it waits for a first text (``self._idle``) or
           when a full batch (MAX_BATCH_SIZE texts) is queued.
        5. Await the future; however that ends, cancel the deadline's timer.
        """
        if self._closing or self._task is None or self._task.done():
            raise APIError(503, "the batcher is not running", headers={"Retry-After": "1"})
        raise NotImplementedError("TODO: submit: queue the texts with one future and await it")

    async def _wait_for_batch(self) -> str | None:
        """Wait for a first text, then up to the window for a full batch; return the batch's tier.
        None: closing, and the queue is empty.

        TODO:
        1. While the queue is empty: if closing, return None (the loop then stops); otherwise say
           the loop is idle (``self._idle``), clear ``self._wakeup`` and wait for it.
        2. Not idle any more. The tier is ``self.tier(len(self._queue))``; the window ends
           ``self.window_s(tier)`` seconds after the oldest queued text arrived
           (``self._queue[0].req.enqueued``, a ``time.perf_counter()``).
        3. While fewer than MAX_BATCH_SIZE texts are queued and ``close()`` has not begun: if the
           window has ended, stop waiting; otherwise clear ``self._wakeup`` and wait for it (a
           full batch, or close), at most until the window ends (``asyncio.timeout``).
        4. Return the tier.
        """
        raise NotImplementedError("TODO: _wait_for_batch: a first text, then the window")

    def _take(self, limit: int = 0) -> list[QueuedText]:
        """The next batch: the oldest texts that fit MAX_BATCH_SIZE (or ``limit``) and MAX_BATCH_TOKENS.

        TODO: take texts from the front of the queue while the batch has fewer than ``limit`` (0:
        MAX_BATCH_SIZE). A text whose caller is gone (``self._gone(text)``) is removed and
        skipped. Stop before a text that would make the batch not ``fits`` (every row is padded
        to the longest one), but the first text always goes, even alone over MAX_BATCH_TOKENS:
        otherwise it could never run. A request's texts stay together while they fit: past
        ``limit``, still take the texts of the request the last one belongs to.
        """
        raise NotImplementedError("TODO: _take: the oldest texts that fit the batch")

    async def _run_batch(self, batch: list[QueuedText], tier: str) -> None:
        """Run the batch in a model slot's thread, hand each caller its rows, report the batch.

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

    def _run_rows(self, ids: list[np.ndarray], rows: list[int], done: Computed) -> None:
        """One model call on these rows of the batch; if it raises, each of them gets the error.

        TODO: ``done.put(rows, ...)`` the vectors of ``self._call(ids, rows, done)``; if the call
        raises, record the exception for every one of ``rows`` in ``done.errors`` (row -> error).
        Do not let it escape: the callers get it through ``_run_batch``.
        """
        raise NotImplementedError("TODO: _run_rows: one model call, its error kept by row")
