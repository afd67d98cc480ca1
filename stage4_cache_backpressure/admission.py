"""Admission control: a bounded queue, counted in texts, that says no at once.

Stage 3's queue is unbounded: under overload every request is accepted and waits, the
wait grows without limit and every client times out together. Here a request whose texts
would push the queue past MAX_QUEUE is refused before it queues, with 503 (or 429, by
OVERLOAD_STATUS) and a ``Retry-After`` computed from how fast the queue drains.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from common.batch_stats import BatchRecord
from common.limits import Overloaded

RETRY_AFTER_MAX_S = 30


# --8<-- [start:admission]
class Admission:
    def __init__(self, max_queue: int, status: int, depth: Callable[[], int], slots: int = 1) -> None:
        self.max_queue, self.status, self._depth, self.slots = max_queue, status, depth, slots
        self.drain_rate = 0.0  # texts per second the model slots clear together, a moving average

    def depth(self) -> int:
        """Texts waiting for the model now."""
        return self._depth()

    def full(self) -> bool:
        """No room for even one more text (``shed.py`` refuses new requests unread)."""
        return self._depth() >= self.max_queue

    def check(self, n: int) -> None:
        """Raise the overload error if ``n`` more texts would overflow the queue; never wait."""
        depth = self._depth()
        # A request larger than the whole queue still goes when the queue is empty,
        # otherwise it could never be served.
        if depth + n > self.max_queue and depth > 0:
            raise self.overloaded(depth, n)

    def overloaded(self, depth: int, n: int) -> Overloaded:
        """The refusal of ``n`` texts with ``depth`` queued: 503 (or 429), with ``Retry-After``."""
        message = f"server overloaded: {depth} texts queued, MAX_QUEUE={self.max_queue}; retry later"
        return Overloaded(message, status=self.status, retry_after_s=self.retry_after(depth + n))

    def retry_after(self, texts: int) -> int:
        """Whole seconds (what HTTP allows) until ``texts`` queued texts should have drained."""
        if self.drain_rate <= 0:
            return 1
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(texts / self.drain_rate)))

    def observe(self, record: BatchRecord) -> None:
        """Fed every batch (stage 3's ``on_batch``): texts per second while the model works."""
        if record.inference_ms <= 0 or record.error is not None:
            return
        # One batch's rate is one slot's; BATCH_CONCURRENCY slots drain the queue side by side.
        rate = self.slots * record.size / (record.inference_ms / 1e3)
        self.drain_rate = rate if self.drain_rate == 0 else 0.8 * self.drain_rate + 0.2 * rate


# --8<-- [end:admission]
