"""The batch queue: the texts waiting for the model, and the rule that picks the next batch.

* FIFO while everything queued fits one batch (MAX_BATCH_SIZE texts, MAX_BATCH_TOKENS
  padded tokens: rows x longest row).
* Length grouping, when more is queued than fits: a window of GROUP_WINDOW texts is sorted
  by length and cut into batches (a "round"). Texts that arrive later wait for the round,
  so no text is overtaken by more than GROUP_WINDOW - 1 texts that arrived after it.
* Texts whose caller is gone (cancelled, past its deadline, failed) are dropped here,
  before the model.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from common.limits import APIError
from common.settings import Settings
from stage3_batching.stats import BatcherStats, BatchRecord

if TYPE_CHECKING:
    from stage3_batching.batcher import BatchOutcome


class DeadlineExceeded(APIError):
    def __init__(self, waited_ms: float) -> None:
        super().__init__(504, f"request deadline passed after {waited_ms:.0f} ms in the batch queue")


@dataclass(slots=True, eq=False)
class PendingRequest:
    """One caller: one future for all its texts, and the answer as it is filled in."""

    future: asyncio.Future[BatchOutcome]
    left: int  # texts not computed yet
    deadline: float | None  # time.monotonic()
    enqueued: float = field(default_factory=time.perf_counter)
    taken: int = 0  # texts taken into a batch
    vectors: np.ndarray | None = None
    queue_ms: float = 0.0
    inference_ms: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)
    last_batch: BatchRecord | None = None
    timer: asyncio.TimerHandle | None = None

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)

    def expire(self) -> None:
        self.fail(DeadlineExceeded((time.perf_counter() - self.enqueued) * 1e3))


@dataclass(slots=True, eq=False)
class QueuedText:
    req: PendingRequest
    index: int  # position in the caller's list
    ids: np.ndarray
    n_tokens: int


# --8<-- [start:take]
class BatchQueue:
    def __init__(self, settings: Settings, stats: BatcherStats) -> None:
        self.settings, self.stats = settings, stats
        self.fresh: deque[QueuedText] = deque()  # arrival order
        self._rounds: deque[list[QueuedText]] = deque()  # batches already cut, in order
        self._in_rounds = 0

    def __len__(self) -> int:
        return len(self.fresh) + self._in_rounds

    @property
    def has_cut_batches(self) -> bool:
        return bool(self._rounds)

    def take(self) -> list[QueuedText]:
        """The next batch: FIFO while the queue fits one batch, else the next of a sorted round."""
        s = self.settings
        if not self._rounds:
            window = self._pop_live(
                max(s.group_window, s.max_batch_size) if s.group_by_length else s.max_batch_size
            )
            n = fifo_count(window, s)
            if s.group_by_length and n < len(window):
                # NEW: sort a bounded window by length and cut it into batches.
                self._rounds.extend(sorted_round(window, s))
                self._in_rounds = len(window)
            elif window:
                self.fresh.extendleft(reversed(window[n:]))
                self._rounds.append(window[:n])
                self._in_rounds = n
        if not self._rounds:  # everything queued was cancelled
            return []
        chosen = self._rounds.popleft()
        self._in_rounds -= len(chosen)
        now, batch = time.monotonic(), []
        for text in chosen:
            req = text.req
            if req.deadline is not None and now > req.deadline:
                req.expire()
            if req.future.done():  # cancelled by its caller, expired, or failed in another batch
                self.stats.skipped_texts += 1
                continue
            req.taken += 1
            batch.append(text)
        return batch

    # --8<-- [end:take]

    def _pop_live(self, n: int) -> list[QueuedText]:
        """Up to ``n`` of the oldest queued texts whose callers still wait."""
        window: list[QueuedText] = []
        while self.fresh and len(window) < n:
            text = self.fresh.popleft()
            if text.req.future.done():
                self.stats.skipped_texts += 1
            else:
                window.append(text)
        return window

    def drain(self) -> list[QueuedText]:
        """Everything still queued, removed (for a batcher that stops)."""
        left = [*self.fresh, *(t for batch in self._rounds for t in batch)]
        self.fresh.clear()
        self._rounds.clear()
        self._in_rounds = 0
        return left


# --8<-- [start:round]
def fifo_count(window: list[QueuedText], s: Settings) -> int:
    """How many of the first texts fit one batch (always at least one)."""
    longest = 0
    for i, text in enumerate(window):
        longest = max(longest, text.n_tokens)
        if i and (i >= s.max_batch_size or (i + 1) * longest > s.max_batch_tokens):
            return i
    return len(window)


def sorted_round(window: list[QueuedText], s: Settings) -> list[list[QueuedText]]:
    """Cut the window, sorted by length, into batches; the batch holding the oldest text goes first."""
    age = {id(t): i for i, t in enumerate(window)}
    ordered = sorted(window, key=lambda t: t.n_tokens)
    batches = []
    while ordered:
        n = fifo_count(ordered, s)
        batches.append(ordered[:n])
        ordered = ordered[n:]
    return sorted(batches, key=lambda b: min(age[id(t)] for t in b))


# --8<-- [end:round]
