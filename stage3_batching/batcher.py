"""The textbook dynamic batcher: many requests' texts, one model call.

A request puts its texts in one queue with one future and awaits it. One background task waits
for a first text, then up to BATCH_WINDOW_MS (from the oldest text's arrival) for a full batch,
takes the oldest texts that fit MAX_BATCH_SIZE and MAX_BATCH_TOKENS, and runs them in an executor
thread, BATCH_CONCURRENCY batches side by side. Each caller gets its own rows; if the model
raises, every caller of that batch gets the error; a caller that is gone (cancelled, past its
deadline) is dropped before the model. Ray Serve's ``batching.py`` has the same shape. The
server runs it with the chapter's refinements (``refined.py``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from common.batch_stats import BatcherStats, BatchRecord
from common.engine import TokenizedText
from common.limits import DeadlineExceeded, NotReady
from common.settings import Settings

log = logging.getLogger("embedserve.batcher")
Model = Callable[[list[np.ndarray]], np.ndarray]  # token ids of each text -> one vector each


@dataclass(slots=True)
class BatchOutcome:
    """What ``submit`` returns: raw mean-pooled vectors (not normalized) in the caller's order."""

    vectors: np.ndarray
    queue_ms: float  # longest wait of the caller's texts
    inference_ms: float  # from the start of the caller's first batch to the end of its last
    batch_sizes: list[int]  # in the order the batches formed


# --8<-- [start:pending]
@dataclass(slots=True, eq=False)
class PendingRequest:
    """One caller: one future for all its texts, and the answer as the batches fill it in."""

    future: asyncio.Future[BatchOutcome]
    left: int  # texts not computed yet
    deadline: float | None  # time.monotonic()
    enqueued: float = field(default_factory=time.perf_counter)
    taken: int = 0  # texts taken into a batch: past that point a deadline lets them finish
    vectors: np.ndarray | None = None
    queue_ms: float = 0.0
    batches: list[BatchRecord] = field(default_factory=list)  # the caller's, in the order they ended

    def deliver(self, index: int, vector: np.ndarray, batch: BatchRecord, queue_ms: float) -> None:
        """Text ``index``'s vector, computed in ``batch``; the last one resolves the future."""
        if self.future.done():  # cancelled, expired, or failed in another batch meanwhile
            return
        if self.vectors is None:
            self.vectors = np.empty((self.left, vector.shape[0]), np.float32)
        self.vectors[index] = vector
        self.left -= 1
        self.queue_ms = max(self.queue_ms, queue_ms)
        if not self.batches or self.batches[-1] is not batch:  # the caller's first text in this batch
            self.batches.append(batch)
        if self.left == 0:
            # Side by side, a later batch can end first: the sizes go in the order the batches
            # formed, and the model time from the first start to the last end (they overlap).
            batches = sorted(self.batches, key=lambda b: b.started)
            model_ms = max(b.started * 1e3 + b.inference_ms for b in batches) - batches[0].started * 1e3
            outcome = BatchOutcome(self.vectors, self.queue_ms, model_ms, [b.size for b in batches])
            self.future.set_result(outcome)

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


@dataclass(slots=True, eq=False)
class QueuedText:
    """One text in the queue: its caller, its place in the caller's list, its token ids."""

    req: PendingRequest
    index: int
    ids: np.ndarray
    n_tokens: int


@dataclass(slots=True)
class Computed:
    """One batch's result, filled in by the model thread: vectors by row, errors by row."""

    n: int
    padded_tokens: int = 0  # rows x longest row, summed over the calls
    calls: int = 0
    vectors: np.ndarray | None = None
    errors: dict[int, Exception] = field(default_factory=dict)
    slot: str = ""  # the model slot (executor thread) that ran it
    model_s: float = 0.0  # how long that slot was busy with it

    def put(self, rows: list[int], vectors: np.ndarray) -> None:
        if self.vectors is None:
            self.vectors = np.zeros((self.n, vectors.shape[1]), np.float32)
        self.vectors[rows] = vectors


def fits(n: int, longest: int, s: Settings) -> bool:
    """Whether ``n`` texts padded to ``longest`` tokens fit one batch."""
    return n <= s.max_batch_size and n * longest <= s.max_batch_tokens


# --8<-- [end:pending]


# --8<-- [start:state]
class Batcher:
    def __init__(
        self, run: Model, settings: Settings, *, on_batch: Callable[[BatchRecord], None] | None = None
    ):
        self._run, self.settings = run, settings
        self._observers = [] if on_batch is None else [on_batch]  # told of every batch (``watch``)
        self.stats = BatcherStats()
        self._queue: deque[QueuedText] = deque()  # arrival order
        self._wakeup = asyncio.Event()  # set: the loop has something to decide
        self._idle = True  # the loop waits for a first text
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.in_flight = 0  # batches handed to the model slots
        self._in_flight_texts = 0  # the texts in them

    def watch(self, observer: Callable[[BatchRecord], None]) -> None:
        """Tell ``observer`` of every batch once it has run (stage 4's admission, stage 5's metrics)."""
        self._observers.append(observer)

    @property
    def queue_depth(self) -> int:
        """Texts queued, not yet taken into a batch."""
        return len(self._queue)

    def batches_at_once(self) -> int:
        """Batches handed to the model slots at once: one per slot."""
        return self.settings.batch_concurrency

    def tier(self, depth: int) -> str:
        """The load tier of a batch formed at this queue depth: none, every batch has one window."""
        return ""

    def window_s(self, tier: str) -> float:
        """How long a batch may wait for more texts, counted from its oldest text's arrival."""
        return self.settings.batch_window_ms / 1e3

    async def start(self) -> None:
        # A thread per model slot: BATCH_CONCURRENCY batches side by side, no more.
        self._pool = ThreadPoolExecutor(self.settings.batch_concurrency, thread_name_prefix="batcher")
        self._task = asyncio.create_task(self._loop(asyncio.Semaphore(self.batches_at_once())))

    # --8<-- [end:state]

    # --8<-- [start:submit_method]
    async def submit(self, tokens: Sequence[TokenizedText], *, deadline: float | None = None) -> BatchOutcome:
        """Queue the texts, wait for all their vectors (in order)."""
        if self._closing or self._task is None or self._task.done():
            raise NotReady("the batcher is not running")
        if not tokens:
            return BatchOutcome(np.zeros((0, 0), np.float32), 0.0, 0.0, [])
        loop = asyncio.get_running_loop()
        req = PendingRequest(loop.create_future(), len(tokens), deadline)
        self._queue.extend(QueuedText(req, i, t.ids, t.n_tokens) for i, t in enumerate(tokens))
        timer = None if deadline is None else loop.call_later(deadline - time.monotonic(), self._expire, req)
        if self._idle or len(self._queue) >= self.settings.max_batch_size:
            self._wakeup.set()  # wake the loop only when it has something to decide
        try:
            return await req.future  # cancelled with the caller: its queued texts are skipped
        finally:
            if timer is not None:
                timer.cancel()

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
                batch = self._take()
            except Exception as exc:  # a bug, not the model: every caller queued gets the error
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
            self._in_flight_texts += len(batch)
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
        tier = self.tier(len(self._queue))
        window_end = self._queue[0].req.enqueued + self.window_s(tier)
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

    # --8<-- [start:take]
    def _take(self, limit: int = 0) -> list[QueuedText]:
        """The next batch: the oldest texts that fit MAX_BATCH_SIZE (or ``limit``) and MAX_BATCH_TOKENS."""
        limit = limit or self.settings.max_batch_size
        batch: list[QueuedText] = []
        longest = 0
        while self._queue:
            text = self._queue[0]
            if self._gone(text):
                self._queue.popleft()
                continue
            if len(batch) >= limit and text.req is not batch[-1].req:
                break  # (a request's texts stay in one batch while they fit it)
            if batch and not fits(len(batch) + 1, max(longest, text.n_tokens), self.settings):
                break  # (a text over the token budget still runs: alone)
            batch.append(self._queue.popleft())
            longest = max(longest, text.n_tokens)
        return batch

    def _gone(self, text: QueuedText) -> bool:
        """Whether the text's caller has gone (cancelled, past its deadline, failed): the one check
        every path that takes texts from the queue makes. A gone caller's texts are counted, dropped."""
        if text.req.deadline is not None and time.monotonic() > text.req.deadline:
            self._expire(text.req)
        if text.req.future.done():
            self.stats.skipped_texts += 1
            return True
        return False

    # --8<-- [end:take]

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
            self._in_flight_texts -= len(batch)
            slots.release()

    async def _run_batch(self, batch: list[QueuedText], tier: str) -> None:
        """Run the batch in a model slot's thread, hand each caller its rows, report the batch."""
        started = time.perf_counter()
        # NEW: the model runs in an executor thread; the event loop keeps serving
        done = await asyncio.get_running_loop().run_in_executor(self._pool, self._timed, batch)
        record = self._record(batch, tier, started, done)
        for row, text in enumerate(batch):
            if done.vectors is None or row in done.errors:
                text.req.fail(done.errors[row])
            else:
                text.req.deliver(text.index, done.vectors[row], record, record.queue_ms[row])
        self._report(record)

    def _record(self, batch: list[QueuedText], tier: str, started: float, done: Computed) -> BatchRecord:
        """What the batch was, for /v1/batcher/metrics and the ``on_batch`` observers."""
        return BatchRecord(
            len(batch), done.padded_tokens, sum(t.n_tokens for t in batch), tier,
            queue_ms=[(started - t.req.enqueued) * 1e3 for t in batch],
            inference_ms=(time.perf_counter() - started) * 1e3,
            error=next((type(e).__name__ for e in done.errors.values()), None),
            calls=done.calls, started=started, slot=done.slot, model_s=done.model_s,
        )  # fmt: skip

    def _report(self, record: BatchRecord) -> None:
        """Count the batch, tell the observers; an observer's bug never stops the batcher."""
        self.stats.add(record)
        for observer in self._observers:
            try:
                observer(record)
            except Exception:
                log.exception("on_batch observer failed")

    # --8<-- [end:fanout]

    # --8<-- [start:model]
    # --- the model thread (an executor thread, never the event loop) --------------------------
    def _timed(self, batch: list[QueuedText]) -> Computed:
        """``_compute``, and which slot ran it for how long (slot utilisation)."""
        started = time.perf_counter()
        done = self._compute(batch)
        done.model_s, done.slot = time.perf_counter() - started, threading.current_thread().name
        return done

    def _compute(self, batch: list[QueuedText]) -> Computed:
        """One model call on the whole batch, every row padded to its longest."""
        done = Computed(len(batch), padded_tokens=len(batch) * max(t.n_tokens for t in batch))
        self._run_rows([t.ids for t in batch], list(range(len(batch))), done)
        return done

    def _run_rows(self, ids: list[np.ndarray], rows: list[int], done: Computed) -> None:
        """One model call on these rows of the batch; if it raises, each of them gets the error."""
        try:
            done.put(rows, self._call(ids, rows, done))
        except Exception as exc:
            done.errors.update(dict.fromkeys(rows, exc))

    def _call(self, ids: list[np.ndarray], rows: list[int], done: Computed) -> np.ndarray:
        """The model call itself, checked: never hand a caller someone else's vector."""
        done.calls += 1
        vectors = self._run([ids[r] for r in rows])
        if vectors.shape[0] != len(rows):
            raise RuntimeError(f"the model returned {vectors.shape[0]} vectors for {len(rows)} texts")
        return vectors

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
