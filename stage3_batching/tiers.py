"""Refinement 1, load tiers: a lone request goes at once, a busy queue waits to fill a batch.

The textbook batcher lets every batch wait up to BATCH_WINDOW_MS for company, which a request
that is alone in the server pays for nothing. Here the queue depth right now (what the load
*is*) picks the tier: below BATCH_LOW_THRESHOLD queued texts the batch is LOW and goes at once;
MEDIUM waits up to BATCH_WINDOW_MS, HIGH (from BATCH_HIGH_THRESHOLD queued texts on) up to its own
BATCH_WINDOW_HIGH_MS: a deep queue is where waiting for a fuller batch can pay. BATCH_LOW_THRESHOLD=1
turns the LOW tier off (the textbook behaviour).
"""

from __future__ import annotations

from stage3_batching.batcher import Batcher


# --8<-- [start:tiers]
class LoadTiers(Batcher):
    def tier(self, depth: int) -> str:
        if depth < self.settings.batch_low_threshold:
            return "low"
        return "medium" if depth < self.settings.batch_high_threshold else "high"

    def window_s(self, tier: str) -> float:
        if tier == "low":  # NEW: a lone request is not held hostage for friends that may never come
            return 0.0
        if tier == "high":  # NEW: a window of its own where the queue is deep
            return self.settings.batch_window_high_ms / 1e3
        return super().window_s(tier)


# --8<-- [end:tiers]
