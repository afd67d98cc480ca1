"""How much model time the cache saved, priced the way the cost model prices a model call.

The cost model chapter prices a call as a fixed overhead plus its tokens. At start the server
fits that line to lone calls of a few lengths (the median of five runs each): a cache hit saved
one such call of its request's mean text length. Had it missed, it might have joined a batch
instead; what a text costs there is the cost model's batching line.

Batching's saving is not estimated: what a batch's texts would have cost run apart cannot be
measured without running them apart. The batch charts show what batching did instead: sizes,
padding and model time per batch.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from common.engine import Engine

_LENGTHS = (8, 64, 128)  # tokens: a short query, a long sentence, a paragraph


class CostModel:
    """Model milliseconds of one call: ``overhead_ms`` plus ``token_ms`` for each of its tokens."""

    def __init__(self, overhead_ms: float, token_ms: float) -> None:
        # Timing noise must not price a call below nothing.
        self.overhead_ms, self.token_ms = max(overhead_ms, 0.0), max(token_ms, 0.0)

    @classmethod
    def measure(cls, engine: Engine, repeats: int = 5) -> CostModel:
        tokens, ms = [], []
        for length in _LENGTHS:
            ids = engine.tokenize(["hello " * (length - 2)])[0].ids
            runs = []
            for _ in range(repeats):
                started = time.perf_counter()
                engine.run([ids])
                runs.append((time.perf_counter() - started) * 1e3)
            # The median, not the best: the price of a typical call, not a lucky one.
            tokens.append(len(ids))
            ms.append(statistics.median(runs))
        token_ms, overhead_ms = np.polyfit(tokens, ms, 1)
        return cls(float(overhead_ms), float(token_ms))

    # --8<-- [start:estimate]
    def call_ms(self, tokens: float) -> float:
        """A call of this many tokens, as the cost model prices it."""
        return self.overhead_ms + self.token_ms * tokens

    def cache_saved_ms(self, hits: int, texts: int, tokens: int) -> float:
        """What a request's cache hits saved: each a call of its own, at the request's mean length."""
        return hits * self.call_ms(tokens / texts) if hits else 0.0

    # --8<-- [end:estimate]
    def as_dict(self) -> dict[str, float]:
        return {"overhead_ms": self.overhead_ms, "token_ms": self.token_ms}
