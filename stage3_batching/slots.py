"""Refinement 5, busy slots: every model slot gets a fair share, and the next batch is ready in time.

Two ways the textbook batcher leaves a model slot idle while texts wait (measured by
``benchmarks/layers.py``: the slot-utilisation figures of the stage 3 chapter):

* **one slot takes everything.** With two slots, the first to free takes the whole queue (up to
  MAX_BATCH_SIZE) and the other, freeing a moment later, finds it empty: one slot runs a big batch,
  the other runs dry. Here a batch takes at most its share of the work in the server, the texts
  queued and those in the model, divided by the slots: ceil((queued + in the model) / slots).
  (Not when the batch waited a window to fill up: then it takes what it waited for.)
* **a freed slot waits for the event loop.** A slot's next batch is formed by the batcher's task on
  the event loop, which runs only when the loop gets to it: under load, after the requests ahead of
  it. Here one batch more than there are slots is handed over, so it waits at the pool and a freed
  slot starts it at once, without the loop. Its texts still count as queued (MAX_QUEUE, the
  queue depth) until a slot takes them; a deadline can no longer drop them.
"""

from __future__ import annotations

import asyncio

from stage3_batching.batcher import Batcher
from stage3_batching.pending import QueuedText


# --8<-- [start:slots]
class BusySlots(Batcher):
    _waiting = 0  # texts of the batch handed over ahead, not in a slot yet

    # --8<-- [start:share]
    def batch_limit(self) -> int:
        limit = super().batch_limit()
        if self.window_s(self.tier(self.queue_depth)) > 0:
            return limit  # a batch that waited to fill up takes what it waited for
        slots = self.settings.batch_concurrency
        work = super().queue_depth + self._in_flight_texts  # NEW: queued, and already in the model
        return max(1, min(limit, -(-work // slots)))  # ceil(work / slots)

    def batches_at_once(self) -> int:
        return super().batches_at_once() + 1  # NEW: the next batch waits at the pool, ready

    # --8<-- [end:share]

    @property
    def queue_depth(self) -> int:
        return super().queue_depth + self._waiting

    async def _run_in_slot(self, batch: list[QueuedText], tier: str, slots: asyncio.Semaphore) -> None:
        if self._in_flight > self.settings.batch_concurrency:  # every slot busy: this one waits
            self._waiting = len(batch)
        try:
            await super()._run_in_slot(batch, tier, slots)
        finally:
            self._waiting = 0  # a slot freed: it took the waiting batch at once


# --8<-- [end:slots]
