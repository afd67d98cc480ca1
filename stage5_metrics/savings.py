"""How much model time the cache saved, and why batching's saving is not estimated.

At start the server times the model on one text of a few lengths (the median of five runs
each) and interpolates between them. A text answered from the cache saved what running it
alone costs: each hit is priced as a lone run at its request's mean text length. Had it
missed, it would have run in a batch instead, which on this model's CPU path costs a text
about as much as a lone run (the cost model chapter measures both).

Batching's saving is not estimated: what a batch's texts would have cost run apart cannot be
measured without running them apart. Pricing them from the curve of lone runs reported
savings far larger than the cost model finds batching can buy on two CPU cores. The batch
charts show what batching did instead: sizes, padding and model time per batch.
"""

from __future__ import annotations

import time
from bisect import bisect_left

import numpy as np

from common.engine import Engine

_LENGTHS = (4, 16, 32, 64, 128, 256)


class CostModel:
    """Model milliseconds of one text run alone, by its token count."""

    def __init__(self, points: list[tuple[int, float]]) -> None:
        self.tokens = [float(n) for n, _ in points]
        # Timing noise must not make a longer text look cheaper.
        self.ms = np.maximum.accumulate([ms for _, ms in points]).tolist()

    @classmethod
    def measure(cls, engine: Engine, repeats: int = 5) -> CostModel:
        points = []
        for length in _LENGTHS:
            ids = engine.tokenize(["hello " * max(length - 2, 1)])[0].ids
            runs = []
            for _ in range(repeats):
                started = time.perf_counter()
                engine.run([ids])
                runs.append((time.perf_counter() - started) * 1e3)
            # The median, not the best: the baseline is a typical lone call, not a lucky one.
            points.append((len(ids), float(np.median(runs))))
        return cls(points)

    # --8<-- [start:estimate]
    def alone_ms(self, n_tokens: float) -> float:
        """A lone run of a text this long: interpolated between the measured lengths."""
        # Plain Python: np.interp on one number costs more than the rest of this function.
        i = bisect_left(self.tokens, n_tokens)
        if i == 0:
            return self.ms[0]
        if i == len(self.tokens):
            return self.ms[-1] * n_tokens / self.tokens[-1]
        x0, x1, y0, y1 = self.tokens[i - 1], self.tokens[i], self.ms[i - 1], self.ms[i]
        return y0 + (y1 - y0) * (n_tokens - x0) / (x1 - x0)

    def cache_saved_ms(self, hits: int, texts: int, tokens: int) -> float:
        """What a request's cache hits saved: each a lone run at the request's mean text length."""
        return hits * self.alone_ms(tokens / texts) if hits else 0.0

    # --8<-- [end:estimate]
    def as_dict(self) -> dict[str, object]:
        return {"tokens": self.tokens, "alone_ms": [round(x, 3) for x in self.ms]}
