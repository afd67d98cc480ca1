"""Refinement 1, load tiers: a lone request goes at once, a busy queue waits to fill a batch.

The textbook batcher lets every batch wait up to BATCH_WINDOW_MS for company, which a request
that is alone in the server pays for nothing. Here the queue depth right now (what the load
*is*) picks the tier: below BATCH_LOW_THRESHOLD queued texts the batch is LOW and goes at once;
MEDIUM and HIGH (from BATCH_HIGH_THRESHOLD on, counted apart to show saturation) wait up to the
window. BATCH_LOW_THRESHOLD=1 turns the LOW tier off (the textbook behaviour).
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
        # NEW: a lone request is not held hostage for friends that may never come.
        return 0.0 if tier == "low" else super().window_s(tier)


# --8<-- [end:tiers]
