"""Refinement 3, length buckets: one batch of mixed lengths runs as a few calls of similar lengths.

Grouping only acts when the queue is deeper than a batch; a single batch of mixed texts still
pads every row to its longest. On a CPU a padded token costs as much as a real one, while one
more model call costs about CALL_OVERHEAD_TOKENS tokens (measured by benchmarks/stage3.py). So
the model thread runs a batch as the cheapest set of calls (an exact dynamic program over the
sorted lengths). One request's texts always stay together, in their order, in one call.
SPLIT_BY_LENGTH=false turns it off (one call per batch, the textbook way).
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np

from stage3_batching.batcher import Batcher, Computed
from stage3_batching.pending import QueuedText


# --8<-- [start:compute]
class LengthBuckets(Batcher):
    def _compute(self, batch: list[QueuedText]) -> Computed:
        if not self.settings.split_by_length:
            return super()._compute(batch)
        units: dict[int, list[int]] = {}  # a request's texts stay together, in its order
        for row, text in enumerate(batch):
            units.setdefault(id(text.req), []).append(row)
        groups = sorted(units.values(), key=lambda rows: max(batch[r].n_tokens for r in rows))
        longest = np.array([max(batch[r].n_tokens for r in rows) for rows in groups])
        sizes = np.array([len(rows) for rows in groups])
        ids, done = [t.ids for t in batch], Computed(len(batch))
        # NEW: the cheapest cut of the sorted units into calls, each padded to its own longest.
        for bucket in length_buckets(longest, self.settings.call_overhead_tokens, sizes):
            rows = [r for unit in groups[bucket] for r in unit]
            done.padded_tokens += len(rows) * int(longest[bucket][-1])
            self._run_rows(ids, rows, done)
        return done


# --8<-- [end:compute]


# --8<-- [start:buckets]
def length_buckets(lengths: np.ndarray, overhead: int, rows: np.ndarray | None = None) -> list[slice]:
    """Cut ascending ``lengths`` into runs so that calls x overhead + padded tokens is least.

    ``rows[i]`` texts share length ``lengths[i]`` (one request's texts, padded together).
    """
    n = len(lengths)
    before = np.concatenate([[0], np.cumsum(np.ones(n, np.int64) if rows is None else rows)])
    best = np.zeros(n + 1)
    start = np.zeros(n + 1, np.int64)
    for end in range(1, n + 1):  # best[end]: cheapest way to run the first `end` units
        costs = best[:end] + overhead + (before[end] - before[:end]) * lengths[end - 1]
        start[end] = int(np.argmin(costs))
        best[end] = costs[start[end]]
    cuts = [n]
    while cuts[-1] > 0:
        cuts.append(int(start[cuts[-1]]))
    cuts.reverse()
    return [slice(a, b) for a, b in pairwise(cuts)]


# --8<-- [end:buckets]
