"""The batcher the server runs: the textbook ``Batcher`` with the chapter's four refinements.

Each refinement is one small policy with its setting, passed to the batcher in place of the
textbook's own (``batcher.py``); ``refined`` builds the batcher with all of them, as the server
runs it, and a test or an experiment leaves any out. A policy switched off by its setting is the
textbook's way.

1. load tiers (``LoadTiers``, the window): BATCH_LOW_THRESHOLD, BATCH_HIGH_THRESHOLD, BATCH_WINDOW_HIGH_MS
   (``RateTiers``, BATCH_TIER_RULE=rate: the tier from a rate instead, the rule the chapter measures)
2. length grouping (``lengths.GroupByLength``, the order of the take): GROUP_BY_LENGTH, GROUP_WINDOW
3. length buckets (``lengths.LengthBuckets``, the split of a batch): SPLIT_BY_LENGTH, CALL_OVERHEAD_TOKENS
4. failure isolation (``halves``, the retry of a failed call): always on
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from common.batch_stats import BatchRecord
from common.settings import Settings
from stage3_batching.batcher import Batcher, Model
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
        self.low: float = settings.batch_low_threshold  # the thresholds the tier is read against
        self.high: float = settings.batch_high_threshold

    def __call__(self, depth: float) -> tuple[str, float]:
        s = self.settings
        if depth < self.low:  # NEW: a lone request is not held hostage for friends
            return "low", 0.0  # that may never come
        if depth < self.high:
            return "medium", s.batch_window_ms / 1e3
        return "high", s.batch_window_high_ms / 1e3  # NEW: a window of its own where the queue is deep


# --8<-- [end:tiers]


# --8<-- [start:rate]
class RateTiers(LoadTiers):
    """The rule load tiers are measured against (BATCH_TIER_RULE=rate): the tier from the texts
    served over the last second, a rate as a dashboard shows it, not from the queue right now.
    Below BATCH_RATE_LOW texts a second LOW, from BATCH_RATE_HIGH on HIGH; the same windows."""

    interval_s = 1.0

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.low, self.high = settings.batch_rate_low, settings.batch_rate_high  # texts a second
        self.served: deque[tuple[float, int]] = deque()  # (when, texts) of each batch run lately

    def observe(self, record: BatchRecord) -> None:
        """Told of every batch once it has run (the batcher's ``watch``)."""
        self.served.append((time.perf_counter(), record.size))

    def __call__(self, depth: float) -> tuple[str, float]:
        while self.served and self.served[0][0] < time.perf_counter() - self.interval_s:
            self.served.popleft()
        # what the load was over the last second, whatever is queued now, against the rate thresholds
        return super().__call__(sum(n for _, n in self.served) / self.interval_s)


# --8<-- [end:rate]


# --8<-- [start:isolation]
def halves(rows: list[int]) -> list[list[int]]:
    """Refinement 4, failure isolation: a text that makes the model raise fails only its own
    caller. A failed call is split in halves, each run again, until the guilty text is alone:
    about 2 log2(n) more calls for one bad text in n, and only when something failed."""
    if len(rows) == 1:  # alone: its error is its own
        return []
    return [rows[: len(rows) // 2], rows[len(rows) // 2 :]]  # NEW: halve until it is alone


# --8<-- [end:isolation]


# --8<-- [start:compose]
def refined(
    run: Model,
    settings: Settings,
    *,
    on_batch: Callable[[BatchRecord], None] | None = None,
    tiers: bool = True,
    grouping: bool = True,
    buckets: bool = True,
    isolation: bool = True,
) -> Batcher:
    """The textbook batcher with the refinements (all of them, as the server runs it); each one
    left out, or switched off by its setting, is the textbook's way."""
    s = settings
    rate = RateTiers(s) if tiers and s.batch_tier_rule == "rate" else None
    batcher = Batcher(
        run,
        s,
        on_batch=on_batch,
        window=(rate or LoadTiers(s)) if tiers else None,  # 1. BATCH_LOW_THRESHOLD=1: no LOW tier
        order=GroupByLength(s) if grouping and s.group_by_length else None,  # 2. GROUP_BY_LENGTH
        split=LengthBuckets(s.call_overhead_tokens).calls if buckets and s.split_by_length else None,  # 3.
        retry=halves if isolation else None,  # 4. always on
    )
    if rate is not None:
        batcher.watch(rate.observe)  # the rate rule counts the batches that ran
    return batcher


# --8<-- [end:compose]
