"""Two refinements against padding: every row of a batch is padded to its longest text, and on a
CPU the model computes a padded token at the cost of a real one.

* **Length grouping** (GROUP_BY_LENGTH, GROUP_WINDOW): when more is queued than fits one batch, a
  window of GROUP_WINDOW texts is sorted by length and cut into batches (a *round*), the batch
  holding the oldest text first. Texts that arrive later wait for the round, so no text is
  overtaken by more than GROUP_WINDOW - 1 texts that arrived after it.
* **Length buckets** (SPLIT_BY_LENGTH, CALL_OVERHEAD_TOKENS): grouping only acts when the queue is
  deeper than a batch; one batch of mixed texts still pads every row to its longest. One more
  model call costs about CALL_OVERHEAD_TOKENS tokens, so the model thread runs a batch as the
  cheapest set of calls (every way to cut the sorted lengths into runs, each prefix's best cut
  reused). One request's texts always stay together, in their order, in one call.

``refined.py`` passes them to the batcher, in place of the textbook's take (``Oldest``) and split
(``one_call``); each is off (the textbook way) with its setting false.
"""

from __future__ import annotations

from collections import deque
from itertools import pairwise

import numpy as np

from common.settings import Settings
from stage3_batching.batcher import Gone, Oldest
from stage3_batching.pending import QueuedText, fits


# --8<-- [start:take]
class GroupByLength(Oldest):
    """The batcher's take order: sorted rounds of GROUP_WINDOW texts instead of arrival order.
    A round goes back to the front of the queue, its batches in order, ahead of later texts."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.cut: deque[int] = deque()  # the sizes of the round's batches still at the queue's front

    def take(self, queue: deque[QueuedText], gone: Gone) -> list[QueuedText]:
        """The next batch of the round; when all that is queued fits one batch, the oldest texts."""
        s = self.settings
        if not self.cut:
            window = [queue.popleft() for _ in range(min(len(queue), max(s.group_window, s.max_batch_size)))]
            window = [text for text in window if not gone(text)]
            if fifo_count(window, s) == len(window):  # it all fits one batch: nothing to sort
                queue.extendleft(reversed(window))
                return super().take(queue, gone)
            # NEW: sort a bounded window by length and cut it into batches.
            batches = sorted_round(window, s)
            queue.extendleft(reversed([text for batch in batches for text in batch]))
            self.cut.extend(len(batch) for batch in batches)
        chosen = [queue.popleft() for _ in range(min(self.cut.popleft(), len(queue)))]
        return [text for text in chosen if not gone(text)]


# --8<-- [end:take]


# --8<-- [start:round]
def fifo_count(texts: list[QueuedText], s: Settings) -> int:
    """How many of the first texts fit one batch (always at least one)."""
    longest = 0
    for i, text in enumerate(texts):
        longest = max(longest, text.n_tokens)
        if i and not fits(i + 1, longest, s):
            return i
    return len(texts)


def sorted_round(window: list[QueuedText], s: Settings) -> list[list[QueuedText]]:
    """Cut the window, sorted by length, into batches; the batch holding the oldest text goes first."""
    age = {id(t): i for i, t in enumerate(window)}
    ordered = sorted(window, key=lambda t: t.n_tokens)
    batches = []
    while ordered:
        n = fifo_count(ordered, s)
        batches.append(ordered[:n])
        ordered = ordered[n:]
    return sorted(batches, key=lambda b: min(age[id(t)] for t in b))


# --8<-- [end:round]


# --8<-- [start:compute]
class LengthBuckets:
    """The batcher's split: one batch run as a few model calls of similar lengths."""

    def __init__(self, call_overhead_tokens: int) -> None:
        self.overhead = call_overhead_tokens

    def calls(self, batch: list[QueuedText]) -> list[list[int]]:
        """The batch's rows, cut into the cheapest set of calls; a request's rows stay together."""
        units: dict[int, list[int]] = {}  # a request's texts stay together, in its order
        for row, text in enumerate(batch):
            units.setdefault(id(text.req), []).append(row)
        groups = sorted(units.values(), key=lambda rows: max(batch[r].n_tokens for r in rows))
        longest = np.array([max(batch[r].n_tokens for r in rows) for rows in groups])
        sizes = np.array([len(rows) for rows in groups])
        # NEW: the cheapest cut of the sorted units into calls, each padded to its own longest.
        return [
            [r for unit in groups[b] for r in unit] for b in length_buckets(longest, self.overhead, sizes)
        ]


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
