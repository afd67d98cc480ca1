"""Exercise for stage 3: write the textbook dynamic batcher.

Stage 2 makes one model call per request. Here many requests share one call: each request puts
its texts in one queue with one future and awaits it; one background task waits for a first
text, then up to BATCH_WINDOW_MS for company, takes the oldest texts that fit MAX_BATCH_SIZE and
MAX_BATCH_TOKENS, runs them in an executor thread and hands each caller its own rows. If the
model raises, every caller of that batch gets the error. Chapter: docs/stage3.md#the-textbook-batcher
(the refinements after it are not part of this exercise).

Write the five methods below, in the order a request meets them (and the first test names
them): ``Batcher.enqueue``, ``Batcher._wait_for_batch``, ``Oldest.take`` (which texts a batch
takes), ``Batcher._run_batch`` (the fan-out) and ``Batcher._run_rows`` (in the model thread: one
call, its errors kept by row).

Everything else is given, inherited from the stage's own classes in ``stage3_batching/batcher.py``,
so it is the code the server runs: read ``stage3_batching/pending.py`` first (``PendingRequest``,
``QueuedText``, ``Computed``, ``fits``), then in ``batcher.py`` the ``Batcher``'s ``__init__`` (the
fields you use), ``_loop`` (which calls your methods and your ``take``), ``_gone``, ``_expire``
and ``_compute``. Do not read the bodies of the five methods there: they
are the solution.

The tests build your ``Batcher`` with your ``Oldest`` as its take.

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
- A take that takes no text while texts are queued would send the loop round without waiting:
  the loop stops that with a RuntimeError, which the test's request then reports.
- An error your methods raise reaches the test's request (the loop hands it to every caller
  queued); its traceback is under "Captured log call" in the test's report.
"""

from __future__ import annotations

import asyncio
import time  # noqa: F401 (yours to use: perf_counter, monotonic)
from collections import deque
from collections.abc import Sequence

import numpy as np

from common.engine import TokenizedText
from common.limits import NotReady
from stage3_batching import batcher as stage
from stage3_batching.batcher import Gone
from stage3_batching.pending import BatchOutcome, BatchRecord, Computed, PendingRequest, QueuedText, fits  # noqa: F401


class Oldest(stage.Oldest):
    def take(self, queue: deque[QueuedText], gone: Gone) -> list[QueuedText]:
        """The next batch: the oldest texts that fit MAX_BATCH_SIZE and MAX_BATCH_TOKENS.

        TODO: take texts from the front of ``queue``. A text whose caller is gone (``gone(text)``)
        is removed and skipped. Stop before a text that would make the batch not ``fits`` (every
        row is padded to the longest one), but the first text always goes, even alone over
        MAX_BATCH_TOKENS: otherwise it could never run.
        """
        raise NotImplementedError(
            "TODO (exercises/stage3_batching/batcher.py): Oldest.take, the oldest texts that fit"
        )


class Batcher(stage.Batcher):
    def enqueue(
        self, tokens: Sequence[TokenizedText], *, deadline: float | None = None
    ) -> asyncio.Future[BatchOutcome]:
        """Queue the texts with one future, which resolves with all their vectors (in order).

        TODO:
        1. One ``PendingRequest`` for the caller (a new future from
           ``asyncio.get_running_loop().create_future()``, ``len(tokens)`` texts left, the deadline).
        2. No texts: resolve its future at once with
           ``BatchOutcome(np.zeros((0, 0), np.float32), 0.0, 0.0, [])`` and return it.
        3. One ``QueuedText`` per text at the end of ``self._queue`` (its index in the caller's
           list, its ``ids`` and ``n_tokens``).
        4. A deadline (``time.monotonic()``, the event loop's clock): at that moment call
           ``self._expire(req)`` (``loop.call_later``), and cancel that timer however the future
           ends (``future.add_done_callback``).
        5. Wake the loop (``self._wakeup``) when it waits for a first text (``self._idle``) or
           when a full batch (MAX_BATCH_SIZE texts) is queued; return the future.
        ``submit`` (given) awaits it.
        """
        if self._closing or self._task is None or self._task.done():
            raise NotReady("the batcher is not running")
        raise NotImplementedError(
            "TODO (exercises/stage3_batching/batcher.py): enqueue, queue the texts with one future"
        )

    async def _wait_for_batch(self) -> str | None:
        """Wait for a first text, then up to the window for a full batch; return the batch's tier.
        None: closing, and the queue is empty.

        TODO:
        1. While the queue is empty: if closing, return None (the loop then stops); otherwise say
           the loop is idle (``self._idle``), clear ``self._wakeup`` and wait for it.
        2. Not idle any more. ``tier, seconds = self.window(len(self._queue))``: the window ends
           ``seconds`` after the oldest queued text arrived (``self._queue[0].req.enqueued``, a
           ``time.perf_counter()``).
        3. While fewer than MAX_BATCH_SIZE texts are queued and ``close()`` has not begun: if the
           window has ended, stop waiting; otherwise clear ``self._wakeup`` and wait for it (a
           full batch, or close), at most until the window ends (``asyncio.timeout``).
        4. Return the tier.
        """
        raise NotImplementedError(
            "TODO (exercises/stage3_batching/batcher.py): _wait_for_batch, a first text, then the window"
        )

    async def _run_batch(self, batch: list[QueuedText], tier: str) -> None:
        """Run the batch in a model slot's thread, hand each caller its rows, report the batch.

        TODO:
        1. Run ``self._compute(batch)`` in ``self._pool`` (the event loop's ``run_in_executor``)
           and await the ``Computed`` it returns (``done``).
        2. ``record = BatchRecord(...)``: the batch's size, ``done.padded_tokens``, the sum of its
           texts' ``n_tokens``, ``tier``, and by keyword ``queue_ms`` (each text's wait in ms, from
           its caller's ``enqueued`` to ``done.started``, when the slot began), ``inference_ms``
           (``done.model_s`` in ms), ``error`` (the type name of the first of ``done.errors``, or
           None), ``calls``, ``started``, ``slot`` and ``model_s`` (from ``done``).
        3. Row ``i`` is ``batch[i]``'s answer: if ``done.vectors`` is None or ``i`` is in
           ``done.errors``, fail that caller with the error; otherwise deliver the vector
           (``deliver(text.index, done.vectors[i], record, record.queue_ms[i])``).
        4. Count it (``self.stats.add(record)``) and tell every observer (``self._observers``),
           each in its own ``try``: an observer's bug must not stop the batcher.
        """
        raise NotImplementedError(
            "TODO (exercises/stage3_batching/batcher.py): _run_batch, run the batch, hand out the rows"
        )

    def _run_rows(self, ids: list[np.ndarray], rows: list[int], done: Computed) -> None:
        """One model call on these rows of the batch; if it raises, each of them gets the error.

        TODO: count the call (``done.calls``), run the model (``self._run``) on the ids of
        ``rows``, check it gave one vector per row (else raise a RuntimeError: never hand a caller
        someone else's vector) and ``done.put(rows, vectors)``. If anything raises, record the
        exception for every one of ``rows`` in ``done.errors`` (row -> error), unless
        ``self.retry(rows)`` gives parts to run again: then run each part the same way. Do not
        let it escape: the callers get it through ``_run_batch``.
        """
        raise NotImplementedError(
            "TODO (exercises/stage3_batching/batcher.py): _run_rows, one model call, its error kept by row"
        )
