"""How many model-seconds the cache and the batcher saved: an estimate, and how it is made.

The baseline is stage 2: every text runs alone. At start the server times the model on one
text of a few lengths (the median of five runs each) and interpolates between them. Then

* a text answered from the cache saved what running it alone would have cost;
* a batch of n texts saved n runs alone minus what the batch took (negative when padding
  made it slower: reported as measured, not clipped).

The machine's speed changes (other processes, thermal limits), so every batch of one text
re-measures the baseline: a moving average of (measured / predicted) scales the curve.

Spent + saved by batching + saved by cache is the model time the same traffic would have
needed with neither.
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
        self.scale = 1.0  # measured / predicted, from batches of one

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

    def alone_ms(self, n_tokens: float) -> float:
        return self.scale * self._curve(n_tokens)

    def _curve(self, n_tokens: float) -> float:
        # Plain Python: np.interp on one number costs more than the rest of this function.
        i = bisect_left(self.tokens, n_tokens)
        if i == 0:
            return self.ms[0]
        if i == len(self.tokens):
            return self.ms[-1] * n_tokens / self.tokens[-1]
        x0, x1, y0, y1 = self.tokens[i - 1], self.tokens[i], self.ms[i - 1], self.ms[i]
        return y0 + (y1 - y0) * (n_tokens - x0) / (x1 - x0)

    # --8<-- [start:estimate]
    def batch_saved_ms(self, size: int, real_tokens: int, inference_ms: float) -> float:
        if size <= 1:  # a batch of one is the baseline itself: track the machine's speed
            predicted = self._curve(real_tokens)
            if predicted > 0 and inference_ms > 0:
                self.scale = 0.9 * self.scale + 0.1 * inference_ms / predicted
            return 0.0
        return size * self.alone_ms(real_tokens / size) - inference_ms

    # --8<-- [end:estimate]
    def as_dict(self) -> dict[str, object]:
        return {
            "tokens": self.tokens,
            "alone_ms": [round(x, 3) for x in self.ms],
            "scale": round(self.scale, 3),
        }
