"""Refinement 4, failure isolation: a text that makes the model raise fails only its own caller.

The textbook batcher gives a failed call's error to every caller in the batch: one bad text
costs its batch mates their answers. Here a failed call is split in halves, and each half run
again, until the guilty text is alone; every other text still gets its vector. A batch with one
bad text in n costs about 2 log2(n) extra calls, and only when something failed.
"""

from __future__ import annotations

import numpy as np

from stage3_batching.batcher import Batcher, Computed


# --8<-- [start:isolation]
class IsolateFailures(Batcher):
    def _run_rows(self, ids: list[np.ndarray], rows: list[int], done: Computed) -> None:
        if len(rows) == 1:  # alone: its error is its own
            super()._run_rows(ids, rows, done)
            return
        try:
            done.put(rows, self._call(ids, rows, done))
        except Exception:  # NEW: somebody's text made the call fail: halve until it is alone
            half = len(rows) // 2
            self._run_rows(ids, rows[:half], done)
            self._run_rows(ids, rows[half:], done)


# --8<-- [end:isolation]
