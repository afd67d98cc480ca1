"""Refinement 2, length grouping: when more is queued than fits one batch, batch similar lengths.

Every row of a batch is padded to its longest text, and the model computes the padding too.
Taking texts in arrival order mixes short and long ones; here, when the queue holds more than
one batch, a window of GROUP_WINDOW texts is sorted by length and cut into batches (a *round*),
the batch holding the oldest text first. Texts that arrive later wait for the round, so no text
is overtaken by more than GROUP_WINDOW - 1 texts that arrived after it. GROUP_BY_LENGTH=false
turns it off (the textbook FIFO).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from common.settings import Settings
from stage3_batching.batcher import Batcher, fits
from stage3_batching.pending import QueuedText


# --8<-- [start:take]
class GroupByLength(Batcher):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rounds: deque[list[QueuedText]] = deque()  # batches already cut, in order
        self._in_rounds = 0  # texts in them

    def _take(self) -> list[QueuedText]:
        s = self.settings
        if not s.group_by_length:
            return super()._take()
        if not self._rounds:
            window = self._pop_live(max(s.group_window, s.max_batch_size))
            if fifo_count(window, s) == len(window):  # it all fits one batch: nothing to sort
                self._queue.extendleft(reversed(window))
                return super()._take()
            # NEW: sort a bounded window by length and cut it into batches.
            self._rounds.extend(sorted_round(window, s))
            self._in_rounds = len(window)
        chosen = self._rounds.popleft()
        self._in_rounds -= len(chosen)
        return [text for text in chosen if self._still_wanted(text)]

    # --8<-- [end:take]

    async def _wait_for_batch(self) -> str | None:
        if self._rounds:  # the rest of a round: its texts have had their wait
            return self.tier(self.queue_depth)
        return await super()._wait_for_batch()

    @property
    def queue_depth(self) -> int:
        return super().queue_depth + self._in_rounds

    def _drain(self) -> list[QueuedText]:
        left = [text for batch in self._rounds for text in batch]
        self._rounds.clear()
        self._in_rounds = 0
        return left + super()._drain()

    def _pop_live(self, n: int) -> list[QueuedText]:
        """Up to ``n`` of the oldest queued texts whose callers still wait."""
        window: list[QueuedText] = []
        while self._queue and len(window) < n:
            text = self._queue.popleft()
            if text.req.future.done():
                self.stats.skipped_texts += 1
            else:
                window.append(text)
        return window


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
