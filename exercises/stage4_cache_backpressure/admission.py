"""Exercise for stage 4, part 3 of 3: the admission check, a bounded queue that says no at once.

Stage 3's queue is unbounded: under overload every request is accepted and waits, the wait
grows without limit and every client times out together. Here a request whose texts would push
the queue past MAX_QUEUE is refused before it queues, at once, with 503 (or 429, by
OVERLOAD_STATUS) and a ``Retry-After`` header that says when the queue should have drained.
Chapter: docs/stage4.md, "The bounded queue, and why 503".

Write ``check``. ``retry_after`` (the header's value), ``observe`` (how fast the model drains
the queue, fed every batch), ``depth`` and ``full`` are given.

Check your work (stage 4's backend built with your three pieces; the section "the bounded
queue" of ``tests/test_stage4_backend.py`` is the one about this part):

    make exercise STAGE=4

``make exercise STAGE=4 SOLUTION=1`` runs the same tests against ``stage4_cache_backpressure/``,
one solution.

Hints:
- ``self.depth()`` is the batcher's queue depth now, in texts.
- Refuse with ``APIError(self.status, message, headers={"Retry-After": ...})``; the message names
  the bound (the test looks for ``MAX_QUEUE=<n>``), the header is a whole number of seconds.
- A request larger than the whole queue must still go when the queue is empty: otherwise it
  could never be served.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from common.limits import APIError  # noqa: F401 (check raises it)
from stage3_batching.batcher import BatchRecord

RETRY_AFTER_MAX_S = 30


class Admission:
    def __init__(self, max_queue: int, status: int, depth: Callable[[], int]) -> None:
        self.max_queue, self.status, self._depth = max_queue, status, depth
        self.drain_rate = 0.0  # texts per second the model clears, a moving average

    def depth(self) -> int:
        """Given: texts waiting for the model now."""
        return self._depth()

    def full(self) -> bool:
        """Given: no room for even one more text (the server's ``shed.py`` refuses new requests unread)."""
        return self._depth() >= self.max_queue

    def check(self, n: int) -> None:
        """Raise the overload error if ``n`` more texts would overflow the queue; never wait.

        TODO: with ``depth`` texts queued, ``n`` more overflow when ``depth + n > max_queue``;
        then raise (unless the queue is empty), with ``Retry-After: self.retry_after(depth + n)``.
        """
        raise NotImplementedError("TODO: refuse at once when the queue would overflow")

    def retry_after(self, texts: int) -> int:
        """Given: whole seconds (what HTTP allows) until ``texts`` queued texts should have drained."""
        if self.drain_rate <= 0:
            return 1
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(texts / self.drain_rate)))

    def observe(self, record: BatchRecord) -> None:
        """Given: fed every model call (stage 3's ``on_batch``): texts per second while the model works."""
        if record.inference_ms <= 0 or record.error is not None:
            return
        rate = record.size / (record.inference_ms / 1e3)
        self.drain_rate = rate if self.drain_rate == 0 else 0.8 * self.drain_rate + 0.2 * rate
