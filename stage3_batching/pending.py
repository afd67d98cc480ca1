"""What the batcher keeps for a request and a batch: the caller's future and its answer as the
batches fill it in, a queued text, a batch's result, and the two limits a batch must fit.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from common.batch_stats import BatchRecord
from common.settings import Settings


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
    started: float = 0.0  # perf_counter when that slot began it
    model_s: float = 0.0  # how long that slot was busy with it

    def put(self, rows: list[int], vectors: np.ndarray) -> None:
        if self.vectors is None:
            self.vectors = np.zeros((self.n, vectors.shape[1]), np.float32)
        self.vectors[rows] = vectors


def fits(n: int, longest: int, s: Settings) -> bool:
    """Whether ``n`` texts padded to ``longest`` tokens fit one batch."""
    return n <= s.max_batch_size and n * longest <= s.max_batch_tokens


# --8<-- [end:pending]
