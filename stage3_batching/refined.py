"""The batcher the server runs: the textbook ``Batcher`` with the chapter's five refinements.

Each refinement is one named piece with its setting, and ``RefinedBatcher`` holds them as
fields: its methods are the textbook's points where a piece steps in, each overridden once,
calling the pieces it needs in plain sight. A piece left out (the tests, one refinement at a time) or
switched off by its setting leaves the textbook's way.

1. load tiers (``LoadTiers``): BATCH_LOW_THRESHOLD, BATCH_HIGH_THRESHOLD, BATCH_WINDOW_HIGH_MS
2. length grouping (``lengths.GroupByLength``): GROUP_BY_LENGTH, GROUP_WINDOW
3. length buckets (``lengths.LengthBuckets``): SPLIT_BY_LENGTH, CALL_OVERHEAD_TOKENS
4. failure isolation (``RefinedBatcher._run_rows``): always on
5. busy slots (``BusySlots``): always on
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import numpy as np

from common.settings import Settings
from stage3_batching.batcher import Batcher, BatchRecord, Computed, Model, QueuedText
from stage3_batching.lengths import GroupByLength, LengthBuckets


# --8<-- [start:tiers]
class LoadTiers:
    """Refinement 1: a lone request goes at once, a busy queue waits to fill a batch.

    The textbook batcher lets every batch wait up to BATCH_WINDOW_MS for company, which a request
    alone in the server pays for nothing. Here the queue depth right now picks the tier: below
    BATCH_LOW_THRESHOLD queued texts LOW, which goes at once; MEDIUM waits up to BATCH_WINDOW_MS;
    HIGH (from BATCH_HIGH_THRESHOLD on) up to BATCH_WINDOW_HIGH_MS. BATCH_LOW_THRESHOLD=1: no LOW.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def tier(self, depth: int) -> str:
        if depth < self.settings.batch_low_threshold:
            return "low"
        return "medium" if depth < self.settings.batch_high_threshold else "high"

    def window_s(self, tier: str) -> float:
        if tier == "low":  # NEW: a lone request is not held hostage for friends that may never come
            return 0.0
        if tier == "high":  # NEW: a window of its own where the queue is deep
            return self.settings.batch_window_high_ms / 1e3
        return self.settings.batch_window_ms / 1e3


# --8<-- [end:tiers]


# --8<-- [start:slots]
class BusySlots:
    """Refinement 5: every model slot gets a fair share, and the next batch is ready in time.

    With two slots, the textbook's first slot to free takes the whole queue and the other runs
    dry: here a batch takes at most its share of the work in the server (queued, and in the
    model) over the slots, unless it waited a window to fill up. And a freed slot waits for the
    event loop to form its next batch: here one batch more than there are slots is handed over,
    so it waits at the pool and a freed slot starts it at once. Its texts still count as queued.
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        # Texts of the batch handed over ahead, not in a slot yet. One number is enough because
        # batches_at_once is slots + 1: one batch at most waits, and the next batch to end frees
        # the slot it takes.
        self.waiting = 0

    def batches_at_once(self) -> int:
        return self.slots + 1  # NEW: the next batch waits at the pool, ready

    def share(self, work: int, limit: int) -> int:
        """Most texts the next batch may take: ceil(work / slots), within MAX_BATCH_SIZE."""
        return max(1, min(limit, math.ceil(work / self.slots)))  # NEW: queued and in the model


# --8<-- [end:slots]


# --8<-- [start:compose]
class RefinedBatcher(Batcher):
    """The textbook batcher with the pieces that refine it (all of them, as the server runs it)."""

    def __init__(
        self,
        run: Model,
        settings: Settings,
        *,
        on_batch: Callable[[BatchRecord], None] | None = None,
        tiers: bool = True,
        grouping: bool = True,
        buckets: bool = True,
        isolation: bool = True,
        busy_slots: bool = True,
    ) -> None:
        super().__init__(run, settings, on_batch=on_batch)
        s = settings
        # NEW: each refinement one piece with its setting; None (left out, or its setting off) is
        # the textbook's way. 1. BATCH_LOW_THRESHOLD (1: no LOW tier), BATCH_HIGH_THRESHOLD, ...
        self.tiers = LoadTiers(s) if tiers else None
        self.grouping = GroupByLength(s) if grouping and s.group_by_length else None  # 2. GROUP_BY_LENGTH
        split = buckets and s.split_by_length  # 3. SPLIT_BY_LENGTH, CALL_OVERHEAD_TOKENS
        self.buckets = LengthBuckets(s.call_overhead_tokens) if split else None
        self.isolation = isolation  # 4. always on
        self.busy = BusySlots(s.batch_concurrency) if busy_slots else None  # 5. always on

    # --8<-- [end:compose]

    # --- when a batch goes: load tiers ---------------------------------------------------------
    def tier(self, depth: int) -> str:
        return super().tier(depth) if self.tiers is None else self.tiers.tier(depth)

    def window_s(self, tier: str) -> float:
        return super().window_s(tier) if self.tiers is None else self.tiers.window_s(tier)

    # --- what a batch takes: length grouping, busy slots' share -------------------------------
    # --8<-- [start:take]
    async def _wait_for_batch(self) -> str | None:
        if self.grouping is not None and self.grouping.rounds:  # the rest of a round: its texts
            return self.tier(self.queue_depth)  # have had their wait
        return await super()._wait_for_batch()

    def _take(self, limit: int = 0) -> list[QueuedText]:
        if self.grouping is not None and (batch := self.grouping.take(self._queue, self._gone)) is not None:
            return batch
        if self.busy is not None and self.window_s(self.tier(self.queue_depth)) == 0:
            # (a batch that waited a window to fill up takes what it waited for)
            queued = len(self._queue) + (self.grouping.held if self.grouping else 0)
            limit = self.busy.share(queued + self._in_flight_texts, self.settings.max_batch_size)
        return super()._take(limit)

    # --8<-- [end:take]

    @property
    def queue_depth(self) -> int:
        """Texts not in a model slot yet: queued, in a round (grouping), handed over ahead (busy slots)."""
        held = self.grouping.held if self.grouping else 0
        return len(self._queue) + held + (self.busy.waiting if self.busy else 0)

    def _drain(self) -> list[QueuedText]:
        return (self.grouping.drain() if self.grouping else []) + super()._drain()

    # --- how a batch runs: busy slots, length buckets, failure isolation ------------------------
    def batches_at_once(self) -> int:
        return super().batches_at_once() if self.busy is None else self.busy.batches_at_once()

    async def _run_in_slot(self, batch: list[QueuedText], tier: str, slots: asyncio.Semaphore) -> None:
        busy = self.busy
        if busy is not None and self.in_flight > busy.slots:  # every slot busy: it waits at the pool
            busy.waiting = len(batch)
        try:
            await super()._run_in_slot(batch, tier, slots)
        finally:
            if busy is not None:
                busy.waiting = 0  # a slot freed: it took the waiting batch at once

    # --8<-- [start:compute]
    def _compute(self, batch: list[QueuedText]) -> Computed:
        if self.buckets is None:
            return super()._compute(batch)
        ids, done = [t.ids for t in batch], Computed(len(batch))
        for rows in self.buckets.calls(batch):  # NEW: a few calls of similar lengths
            done.padded_tokens += len(rows) * max(batch[r].n_tokens for r in rows)
            self._run_rows(ids, rows, done)
        return done

    # --8<-- [end:compute]

    # --8<-- [start:isolation]
    def _run_rows(self, ids: list[np.ndarray], rows: list[int], done: Computed) -> None:
        """Refinement 4, failure isolation: a text that makes the model raise fails only its own
        caller. A failed call is split in halves, each run again, until the guilty text is alone:
        about 2 log2(n) more calls for one bad text in n, and only when something failed."""
        if not self.isolation or len(rows) == 1:  # alone: its error is its own
            super()._run_rows(ids, rows, done)
            return
        try:
            done.put(rows, self._call(ids, rows, done))
        except Exception:  # NEW: somebody's text made the call fail: halve until it is alone
            self._run_rows(ids, rows[: len(rows) // 2], done)
            self._run_rows(ids, rows[len(rows) // 2 :], done)

    # --8<-- [end:isolation]
