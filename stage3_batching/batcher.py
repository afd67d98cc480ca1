"""The textbook dynamic batcher: many requests' texts, one model call (Ray Serve's ``batching.py`` shape).

A request queues its texts with one future and awaits it. One task waits for a first text, then up
to BATCH_WINDOW_MS (from the oldest text's arrival) for a full batch, takes the oldest texts that fit
MAX_BATCH_SIZE and MAX_BATCH_TOKENS and runs them in an executor thread, BATCH_CONCURRENCY batches side
by side. Each caller gets its rows, or the model's error; a caller gone (cancelled, past its deadline)
is dropped before the model. Four small policies are the textbook's own unless ``refined.py`` passes a
refinement: the ``window``, the take (``Oldest``), the ``split`` of a batch, the ``retry`` of a failed call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from common.batch_stats import BatcherStats, BatchRecord
from common.engine import TokenizedText
from common.limits import DeadlineExceeded, NotReady
from common.settings import Settings
from stage3_batching.pending import BatchOutcome, Computed, PendingRequest, QueuedText, fits

log = logging.getLogger("embedserve.batcher")
Model = Callable[[list[np.ndarray]], np.ndarray]  # token ids of each text -> one vector each


# --8<-- [start:policies]
# A queue depth -> (its load tier, how long a batch may wait for more texts after its oldest arrived);
# a batch -> its rows, a list per model call; a failed call's rows -> the parts to rerun.
Window = Callable[[int], tuple[str, float]]
Split = Callable[[list[QueuedText]], list[list[int]]]
Retry = Callable[[list[int]], list[list[int]]]
Gone = Callable[[QueuedText], bool]  # whether a queued text's caller has gone (``Batcher._gone``)


# --8<-- [end:policies]
# --8<-- [start:take]
class Oldest:
    """Which texts a batch takes: the oldest that fit MAX_BATCH_SIZE and MAX_BATCH_TOKENS
    (``lengths.GroupByLength`` sorts rounds by length)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def take(self, queue: deque[QueuedText], gone: Gone) -> list[QueuedText]:
        batch: list[QueuedText] = []
        longest = 0
        while queue:
            text = queue[0]
            if gone(text):
                queue.popleft()
                continue
            if batch and not fits(len(batch) + 1, max(longest, text.n_tokens), self.settings):
                break  # (a text over the token budget still runs: alone)
            batch.append(queue.popleft())
            longest = max(longest, text.n_tokens)
        return batch


# --8<-- [end:take]
# --8<-- [start:state]
class Batcher:
    def __init__(
        self,
        run: Model,
        settings: Settings,
        *,
        on_batch: Callable[[BatchRecord], None] | None = None,
        window: Window | None = None,
        order: Oldest | None = None,
        split: Split | None = None,
        retry: Retry | None = None,
    ) -> None:
        self._run, self.settings = run, settings
        # The textbook's policies: one window whatever the queue depth, the oldest texts, one
        # call a batch, and a failed call's error for each of its rows.
        self.window = window or (lambda depth: ("", settings.batch_window_ms / 1e3))
        self.order = order or Oldest(settings)
        self.split = split or (lambda batch: [list(range(len(batch)))])
        self.retry = retry or (lambda rows: [])
        self._observers = [] if on_batch is None else [on_batch]  # told of every batch (``watch``)
        self.stats = BatcherStats()
        self._queue: deque[QueuedText] = deque()  # arrival order
        self._wakeup = asyncio.Event()  # set: the loop has something to decide
        self._idle, self._closing = True, False  # idle: the loop waits for a first text
        self._task: asyncio.Task[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.in_flight = 0  # batches in the model slots

    def watch(self, observer: Callable[[BatchRecord], None]) -> None:
        """Tell ``observer`` of every batch once it has run (stage 4's admission, stage 5's metrics)."""
        self._observers.append(observer)

    @property
    def queue_depth(self) -> int:
        """Texts not in a model slot yet."""
        return len(self._queue)

    async def start(self) -> None:  # a thread per model slot: BATCH_CONCURRENCY batches side by side
        slots = self.settings.batch_concurrency
        self._pool = ThreadPoolExecutor(slots, thread_name_prefix="batcher")
        self._task = asyncio.create_task(self._loop(asyncio.Semaphore(slots)))

    # --8<-- [end:state]
    # --8<-- [start:submit_method]
    def enqueue(
        self, tokens: Sequence[TokenizedText], *, deadline: float | None = None
    ) -> asyncio.Future[BatchOutcome]:
        """Queue the texts with one future for all their vectors; cancelling it skips those still queued."""
        if self._closing or self._task is None or self._task.done():
            raise NotReady("the batcher is not running")
        loop = asyncio.get_running_loop()
        req = PendingRequest(loop.create_future(), len(tokens), deadline)
        if not tokens:
            req.future.set_result(BatchOutcome(np.zeros((0, 0), np.float32), 0.0, 0.0, []))
            return req.future
        self._queue.extend(QueuedText(req, i, t.ids, t.n_tokens) for i, t in enumerate(tokens))
        if deadline is not None:
            timer = loop.call_later(deadline - time.monotonic(), self._expire, req)
            req.future.add_done_callback(lambda _: timer.cancel())  # however the request ends
        if self._idle or len(self._queue) >= self.settings.max_batch_size:
            self._wakeup.set()  # wake the loop only when it has something to decide
        return req.future

    async def submit(self, tokens: Sequence[TokenizedText], *, deadline: float | None = None) -> BatchOutcome:
        return await self.enqueue(tokens, deadline=deadline)  # cancelled with the caller

    def _expire(self, req: PendingRequest) -> None:
        """The deadline passed. Only a caller still wholly queued gets its 504."""
        if req.taken == 0:  # texts already in the model finish normally
            waited_ms = (time.perf_counter() - req.enqueued) * 1e3
            req.fail(DeadlineExceeded(f"request deadline passed after {waited_ms:.0f} ms in the batch queue"))

    # --8<-- [end:submit_method]
    # --8<-- [start:loop]
    async def _loop(self, slots: asyncio.Semaphore) -> None:
        running: set[asyncio.Task[None]] = set()
        while True:
            await slots.acquire()  # a free model slot first; meanwhile the queue fills
            try:
                tier = await self._wait_for_batch()
                if tier is None:  # closing, and nothing is left
                    break
                before = self.queue_depth
                batch = self.order.take(self._queue, self._gone)
                if not batch and self.queue_depth == before:  # a take that took no text would spin
                    raise RuntimeError(f"the take took none of the {before} texts queued")  # the loop
            except Exception as exc:  # a bug, not the model: every caller queued gets the error,
                log.exception("the batcher could not form a batch")
                for text in self._drain():
                    text.req.fail(exc)
                if self._closing:
                    break
                self._idle = True  # and the loop waits for new texts, rather than spin on the bug
                self._wakeup.clear()
                await self._wakeup.wait()
                tier, batch = "", []
            if not batch:  # every caller in it was gone
                slots.release()
                continue
            for text in batch:
                text.req.taken += 1  # in a batch now: a deadline no longer stops it
            self.in_flight += 1
            task = asyncio.create_task(self._run_in_slot(batch, tier, slots))
            running.add(task)
            task.add_done_callback(running.discard)
        await asyncio.gather(*running)  # closing: let the running batches finish

    # --8<-- [end:loop]
    # --8<-- [start:wait]
    async def _wait_for_batch(self) -> str | None:
        """Wait for a first text, then up to the window for a full batch; return the batch's tier.
        None: closing, and the queue is empty."""
        while not self._queue:
            if self._closing:
                return None
            self._idle = True
            self._wakeup.clear()
            await self._wakeup.wait()
        self._idle = False
        tier, window_s = self.window(len(self._queue))
        window_end = self._queue[0].req.enqueued + window_s
        while len(self._queue) < self.settings.max_batch_size and not self._closing:
            left = window_end - time.perf_counter()
            if left <= 0:
                break
            self._wakeup.clear()
            try:
                async with asyncio.timeout(left):
                    await self._wakeup.wait()  # a full batch, or close()
            except TimeoutError:  # the window's end
                break
        return tier

    # --8<-- [end:wait]

    def _gone(self, text: QueuedText) -> bool:
        """Whether the text's caller has gone (cancelled, past its deadline, failed): the one check
        every path that takes texts from the queue makes. A gone caller's texts are counted, dropped."""
        if text.req.deadline is not None and time.monotonic() > text.req.deadline:
            self._expire(text.req)
        if text.req.future.done():
            self.stats.skipped_texts += 1
            return True
        return False

    # --8<-- [start:fanout]
    async def _run_in_slot(self, batch: list[QueuedText], tier: str, slots: asyncio.Semaphore) -> None:
        """A batch the loop handed to a model slot: run it, and free the slot whatever happens."""
        try:
            await self._run_batch(batch, tier)
        except Exception as exc:  # a bug around the model call: the batch's callers get it
            log.exception("the batcher could not run a batch")
            for text in batch:
                text.req.fail(exc)
        finally:
            self.in_flight -= 1
            slots.release()

    async def _run_batch(self, batch: list[QueuedText], tier: str) -> None:
        """Run the batch in a model slot's thread, hand each caller its rows, report the batch."""
        # NEW: the model runs in an executor thread; the event loop keeps serving
        done = await asyncio.get_running_loop().run_in_executor(self._pool, self._compute, batch)
        record = BatchRecord(  # a text's wait lasts until its slot starts the batch
            len(batch), done.padded_tokens, sum(t.n_tokens for t in batch), tier,
            queue_ms=[(done.started - t.req.enqueued) * 1e3 for t in batch], inference_ms=done.model_s * 1e3,
            error=next((type(e).__name__ for e in done.errors.values()), None),
            calls=done.calls, started=done.started, slot=done.slot, model_s=done.model_s,
        )  # fmt: skip
        for row, text in enumerate(batch):
            if done.vectors is None or row in done.errors:
                text.req.fail(done.errors[row])
            else:
                text.req.deliver(text.index, done.vectors[row], record, record.queue_ms[row])
        self.stats.add(record)
        for observer in self._observers:  # an observer's bug never stops the batcher
            try:
                observer(record)
            except Exception:
                log.exception("on_batch observer failed")

    # --8<-- [end:fanout]
    # --8<-- [start:model]
    # --- the model thread (an executor thread, never the event loop) --------------------------
    def _compute(self, batch: list[QueuedText]) -> Computed:
        """The batch as model calls (``split``), and which slot ran them for how long."""
        started, done, ids = time.perf_counter(), Computed(len(batch)), [t.ids for t in batch]
        for rows in self.split(batch):
            done.padded_tokens += len(rows) * max(batch[r].n_tokens for r in rows)
            self._run_rows(ids, rows, done)
        done.started, done.slot = started, threading.current_thread().name
        done.model_s = time.perf_counter() - started
        return done

    def _run_rows(self, ids: list[np.ndarray], rows: list[int], done: Computed) -> None:
        """One model call on these rows, checked: never hand a caller someone else's vector. If it
        raises, each row gets the error, unless ``retry`` runs them again in parts."""
        try:
            done.calls += 1
            vectors = self._run([ids[r] for r in rows])
            if vectors.shape[0] != len(rows):
                raise RuntimeError(f"the model returned {vectors.shape[0]} vectors for {len(rows)} texts")
            done.put(rows, vectors)
        except Exception as exc:
            parts = self.retry(rows)
            if not parts:
                done.errors.update(dict.fromkeys(rows, exc))
            for part in parts:
                self._run_rows(ids, part, done)

    # --8<-- [end:model]
    # --8<-- [start:close]
    async def close(self) -> None:
        """Finish everything already queued, then stop."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await asyncio.wait([self._task])
        for text in self._drain():  # only if the loop died: nobody waits forever
            text.req.fail(NotReady("the server is shutting down"))
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _drain(self) -> list[QueuedText]:
        left = list(self._queue)
        self._queue.clear()
        return left

    # --8<-- [end:close]
