"""Dynamic batching: many requests' texts, one model call.

Each request puts its texts in one queue with one future and awaits it. One background
task takes texts from the queue into batches, runs the model in one executor thread
(the model call gets the cores, the event loop stays free) and resolves the futures.

* Tiers: below BATCH_LOW_THRESHOLD queued texts a batch goes at once; at MEDIUM and
  HIGH depth it waits up to BATCH_WINDOW_MS (from the oldest text's arrival) to fill.
* Limits: MAX_BATCH_SIZE texts and MAX_BATCH_TOKENS padded tokens (rows x longest row).
* Length grouping: when more is queued than fits one batch, a window of GROUP_WINDOW
  texts is sorted by length and cut into batches (a "round"); texts that arrive later
  wait for the round, so no text waits more than one window beyond its FIFO turn.
* Failures: a batch that raises is split in halves until the guilty text is alone, so
  only its caller gets the error; the loop logs and carries on, no future is left pending.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.engine import TokenizedText
from common.limits import APIError
from common.settings import Settings

log = logging.getLogger("embedserve.batcher")


class DeadlineExceeded(APIError):
    def __init__(self, waited_ms: float) -> None:
        super().__init__(504, f"request deadline passed after {waited_ms:.0f} ms in the batch queue")


@dataclass(slots=True)
class BatchRecord:
    """One model call, handed to observers (``on_batch``)."""

    size: int
    padded_tokens: int
    real_tokens: int
    tier: str
    queue_ms: list[float]
    inference_ms: float
    error: str | None


@dataclass(slots=True)
class BatchOutcome:
    """What ``submit`` returns: raw mean-pooled vectors in the caller's order."""

    vectors: np.ndarray
    queue_ms: float
    inference_ms: float
    batch_sizes: list[int]


@dataclass(slots=True)
class BatcherStats:
    batches: int = 0
    texts: int = 0
    padded_tokens: int = 0
    real_tokens: int = 0
    failed_batches: int = 0
    skipped_texts: int = 0  # cancelled or past their deadline, dropped before the model
    tiers: Counter[str] = field(default_factory=Counter)
    sizes: Counter[int] = field(default_factory=Counter)

    def add(self, record: BatchRecord) -> None:
        self.batches += 1
        self.texts += record.size
        self.padded_tokens += record.padded_tokens
        self.real_tokens += record.real_tokens
        self.failed_batches += record.error is not None
        self.tiers[record.tier] += 1
        self.sizes[record.size] += 1

    @property
    def padding_ratio(self) -> float:
        """Share of the model's token slots spent on padding."""
        return 1 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "texts": self.texts,
            "average_batch_size": self.texts / self.batches if self.batches else 0.0,
            "batch_size_distribution": {str(k): v for k, v in sorted(self.sizes.items())},
            "tiers": {t: self.tiers[t] for t in ("low", "medium", "high")},
            "padded_tokens": self.padded_tokens,
            "real_tokens": self.real_tokens,
            "padding_ratio": round(self.padding_ratio, 4),
            "failed_batches": self.failed_batches,
            "skipped_texts": self.skipped_texts,
        }


class _Request:
    """One caller: its texts, its future, and the parts of the answer so far."""

    __slots__ = (
        "batch_sizes",
        "deadline",
        "enqueued",
        "future",
        "inference_ms",
        "last_batch",
        "left",
        "queue_ms",
        "taken",
        "timer",
        "vectors",
    )

    def __init__(self, n: int, future: asyncio.Future[BatchOutcome], deadline: float | None) -> None:
        self.future = future
        self.deadline = deadline
        self.enqueued = time.perf_counter()
        self.left = n  # texts not computed yet
        self.taken = 0  # texts taken into a batch
        self.vectors: np.ndarray | None = None
        self.queue_ms = 0.0
        self.inference_ms = 0.0
        self.batch_sizes: list[int] = []
        self.last_batch: BatchRecord | None = None
        self.timer: asyncio.TimerHandle | None = None

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


class _Entry:
    """One queued text."""

    __slots__ = ("ids", "index", "n_tokens", "req")

    def __init__(self, req: _Request, index: int, ids: np.ndarray) -> None:
        self.req, self.index, self.ids = req, index, ids
        self.n_tokens = int(ids.shape[0])


# --8<-- [start:batcher]
class Batcher:
    def __init__(
        self,
        run: Callable[[list[np.ndarray]], np.ndarray],
        settings: Settings,
        *,
        on_batch: Callable[[BatchRecord], None] | None = None,
    ) -> None:
        self._run = run
        self.settings = settings
        self._on_batch = on_batch
        self._queue: deque[_Entry] = deque()
        self._rounds: deque[list[_Entry]] = deque()  # batches already cut from the queue, in order
        self._in_rounds = 0
        self._wakeup = asyncio.Event()
        self._idle = True  # the loop waits for a first text
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight = 0
        self.stats = BatcherStats()

    @property
    def queue_depth(self) -> int:
        return len(self._queue) + self._in_rounds

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def config(self) -> dict[str, Any]:
        s = self.settings
        return {
            "max_batch_size": s.max_batch_size,
            "max_batch_tokens": s.max_batch_tokens,
            "batch_window_ms": s.batch_window_ms,
            "batch_low_threshold": s.batch_low_threshold,
            "batch_high_threshold": s.batch_high_threshold,
            "group_by_length": s.group_by_length,
            "group_window": s.group_window,
        }

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
        for entry in [*self._queue, *(e for b in self._rounds for e in b)]:  # only if the loop died
            entry.req.fail(APIError(503, "the server is shutting down"))
        self._queue.clear()
        self._rounds.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    async def submit(self, tokens: Sequence[TokenizedText], *, deadline: float | None = None) -> BatchOutcome:
        if self._closing or self._task is None or self._task.done():
            raise APIError(503, "the batcher is not running", headers={"Retry-After": "1"})
        if not tokens:
            return BatchOutcome(np.zeros((0, 0), np.float32), 0.0, 0.0, [])
        loop = asyncio.get_running_loop()
        req = _Request(len(tokens), loop.create_future(), deadline)
        self._queue.extend(_Entry(req, i, t.ids) for i, t in enumerate(tokens))
        if deadline is not None:
            req.timer = loop.call_later(max(deadline - time.monotonic(), 0), self._expire, req)
        if self._idle or len(self._queue) >= self.settings.max_batch_size:
            self._wakeup.set()
        try:
            return await req.future  # cancelled with the caller: its queued texts are skipped
        finally:
            if req.timer is not None:
                req.timer.cancel()

    def _expire(self, req: _Request) -> None:
        if req.taken == 0:  # still wholly queued; texts already in the model finish normally
            req.fail(DeadlineExceeded((time.perf_counter() - req.enqueued) * 1e3))

    # -- the background task ------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            batch: list[_Entry] = []
            try:
                tier = await self._wait_for_batch()
                if tier is None:
                    return
                batch = self._take()
                if batch:
                    await self._run_batch(batch, tier)
            except Exception as exc:  # never die: answer this batch's callers, keep serving
                log.exception("batcher loop error")
                for entry in batch:
                    entry.req.fail(exc)

    async def _wait_for_batch(self) -> str | None:
        """Wait for queued texts, then, at MEDIUM/HIGH depth, up to the window to fill a batch."""
        if self._rounds:  # sorted batches from an earlier look at the queue go first
            return self.tier(self.queue_depth)
        while not self._queue:
            if self._closing:
                return None
            self._idle = True
            self._wakeup.clear()
            await self._wakeup.wait()
        self._idle = False
        tier = self.tier(len(self._queue))
        if tier != "low" and not self._closing:
            window_end = self._queue[0].req.enqueued + self.settings.batch_window_ms / 1e3
            while len(self._queue) < self.settings.max_batch_size and not self._closing:
                left = window_end - time.perf_counter()
                if left <= 0:
                    break
                self._wakeup.clear()
                timer = asyncio.get_running_loop().call_later(left, self._wakeup.set)
                await self._wakeup.wait()  # a full queue, the window's end, or close()
                timer.cancel()
        return tier

    # --8<-- [end:batcher]

    # --8<-- [start:take]
    def _take(self) -> list[_Entry]:
        """The next batch: FIFO while the queue fits one batch, else the next of a sorted round."""
        s = self.settings
        if not self._rounds:
            size = max(s.group_window, s.max_batch_size) if s.group_by_length else s.max_batch_size
            window = self._pop_live(size)
            if s.group_by_length and not _fits(window, s):
                # NEW: sort a bounded window by length and cut it into batches. Nothing that
                # arrives later goes before them, so no text waits more than one window beyond FIFO.
                self._rounds.extend(_sorted_round(window, s))
                self._in_rounds = len(window)
            elif window:
                n = _fifo(window, s)
                self._queue.extendleft(reversed(window[n:]))
                self._rounds.append(window[:n])
                self._in_rounds = n
        if not self._rounds:  # everything queued was cancelled
            return []
        chosen = self._rounds.popleft()
        self._in_rounds -= len(chosen)
        now, batch = time.monotonic(), []
        for entry in chosen:
            req = entry.req
            if req.deadline is not None and now > req.deadline:
                req.fail(DeadlineExceeded((time.perf_counter() - req.enqueued) * 1e3))
            if req.future.done():  # cancelled by its caller, expired, or failed in another batch
                self.stats.skipped_texts += 1
                continue
            req.taken += 1
            batch.append(entry)
        return batch

    # --8<-- [end:take]

    def _pop_live(self, n: int) -> list[_Entry]:
        """Up to ``n`` of the oldest queued texts whose callers still wait."""
        window: list[_Entry] = []
        while self._queue and len(window) < n:
            entry = self._queue.popleft()
            if entry.req.future.done():
                self.stats.skipped_texts += 1
            else:
                window.append(entry)
        return window

    async def _run_batch(self, batch: list[_Entry], tier: str) -> None:
        started = time.perf_counter()
        ids = [e.ids for e in batch]
        self._in_flight = 1
        try:
            loop = asyncio.get_running_loop()
            vectors, errors = await loop.run_in_executor(self._pool, self._compute, ids)
        finally:
            self._in_flight = 0
        inference_ms = (time.perf_counter() - started) * 1e3
        longest = max(len(i) for i in ids)
        record = BatchRecord(
            size=len(batch),
            padded_tokens=len(batch) * longest,
            real_tokens=sum(len(i) for i in ids),
            tier=tier,
            queue_ms=[(started - e.req.enqueued) * 1e3 for e in batch],
            inference_ms=inference_ms,
            error=next((type(x).__name__ for x in errors if x is not None), None),
        )
        self._scatter(batch, vectors, errors, record)
        self.stats.add(record)
        if self._on_batch is not None:
            try:
                self._on_batch(record)
            except Exception:
                log.exception("on_batch observer failed")

    # --8<-- [start:scatter]
    def _scatter(
        self,
        batch: list[_Entry],
        vectors: np.ndarray,
        errors: list[BaseException | None],
        record: BatchRecord,
    ) -> None:
        """Hand each caller its rows; a request is answered when its last text is done."""
        for row, entry in enumerate(batch):
            req, error = entry.req, errors[row]
            if req.future.done():
                continue
            if error is not None:
                req.fail(error)
                continue
            if req.vectors is None:
                req.vectors = np.empty((req.left, vectors.shape[1]), np.float32)
            req.vectors[entry.index] = vectors[row]
            req.left -= 1
            req.queue_ms = max(req.queue_ms, record.queue_ms[row])
            if req.last_batch is not record:  # first of this caller's texts in this batch
                req.last_batch = record
                req.batch_sizes.append(record.size)
                req.inference_ms += record.inference_ms
            if req.left == 0:
                outcome = BatchOutcome(req.vectors, req.queue_ms, req.inference_ms, req.batch_sizes)
                req.future.set_result(outcome)

    # --8<-- [end:scatter]

    # --8<-- [start:compute]
    def _compute(self, ids: list[np.ndarray]) -> tuple[np.ndarray, list[BaseException | None]]:
        """Run the model (executor thread). On failure, split the batch to find the guilty text."""
        try:
            vectors = self._run(ids)
            if vectors.shape[0] != len(ids):  # never hand a caller someone else's vector
                raise RuntimeError(f"the model returned {vectors.shape[0]} vectors for {len(ids)} texts")
            return vectors, [None] * len(ids)
        except Exception as exc:
            if len(ids) == 1:
                return np.zeros((1, 0), np.float32), [exc]
        half = len(ids) // 2
        left, left_errors = self._compute(ids[:half])
        right, right_errors = self._compute(ids[half:])
        dim = max(left.shape[1], right.shape[1])
        out = np.zeros((len(ids), dim), np.float32)
        if left.shape[1] == dim:
            out[:half] = left
        if right.shape[1] == dim:
            out[half:] = right
        return out, left_errors + right_errors

    # --8<-- [end:compute]


def _fits(window: list[_Entry], s: Settings) -> bool:
    return _fifo(window, s) == len(window)


def _fifo(window: list[_Entry], s: Settings) -> int:
    """How many of the oldest texts fit one batch (always at least one)."""
    longest = 0
    for i, entry in enumerate(window):
        longest = max(longest, entry.n_tokens)
        if i and (i >= s.max_batch_size or (i + 1) * longest > s.max_batch_tokens):
            return i
    return len(window)


def _sorted_round(window: list[_Entry], s: Settings) -> list[list[_Entry]]:
    """Cut the window, sorted by length, into batches; the batch holding the oldest text goes first."""
    ordered = sorted(window, key=lambda e: e.n_tokens)
    batches = []
    while ordered:
        n = _fifo(ordered, s)
        batches.append(ordered[:n])
        ordered = ordered[n:]
    age = {id(e): i for i, e in enumerate(window)}
    return sorted(batches, key=lambda b: min(age[id(e)] for e in b))
