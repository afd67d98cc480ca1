"""One request's result, filled in row by row as the steps of stage 4 find each text.

A text's entry comes from the memory tier, the Redis tier, another request's computation
or the model; ``PartialResult`` keeps its vector, token count and truncation flag at the
text's row, and once every row is in turns them into the typed ``EmbedResult`` (the contract
renders the headers).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from common.api import EmbedJob, EmbedResult, check_truncation
from common.engine import Engine, TokenizedText, l2_normalize
from stage3_batching.pending import BatchOutcome
from stage4_cache_backpressure.cache import CacheEntry


class PartialResult:
    def __init__(self, engine: Engine, job: EmbedJob) -> None:
        self.engine, self.job = engine, job
        n = len(job.texts)
        self.vectors = np.empty((n, engine.dimensions), np.float32)
        self.n_tokens, self.truncated = [0] * n, [False] * n
        self.hits = 0  # texts a cache tier answered
        self.inference_ms = 0.0  # model time this request waited on (0: nothing ran)
        self.queue_ms: float | None = None
        self.batch_sizes: list[int] | None = None

    def fill(self, rows: Iterable[int], found: Sequence[CacheEntry | None]) -> list[int]:
        """Take the entries a cache tier found; return the rows still missing."""
        missing = []
        for row, entry in zip(rows, found, strict=True):
            if entry is None:
                missing.append(row)
            else:
                self.take(row, entry)
                self.hits += 1
        return missing

    def take(self, row: int, entry: CacheEntry) -> None:
        """One text's entry. A cut text is a 422 when the job says `truncate: false`, as the
        tokenizer would have said it (``common.api.tokenize``)."""
        check_truncation(self.engine, self.job, [(row, entry.truncated)])
        self.vectors[row] = entry.vector
        self.n_tokens[row], self.truncated[row] = entry.n_tokens, entry.truncated

    def computed(
        self, rows: list[int], tokens: list[TokenizedText], outcome: BatchOutcome
    ) -> list[CacheEntry]:
        """Take what the model computed for ``rows``; return the entries to cache."""
        vectors = l2_normalize(outcome.vectors) if self.job.normalize else outcome.vectors
        entries = [CacheEntry(v, t.n_tokens, t.truncated) for v, t in zip(vectors, tokens, strict=True)]
        for row, entry in zip(rows, entries, strict=True):
            self.take(row, entry)
        self.inference_ms, self.queue_ms = outcome.inference_ms, outcome.queue_ms
        self.batch_sizes = outcome.batch_sizes
        return entries

    def result(self, bypassed: bool = False) -> EmbedResult:
        return EmbedResult(
            self.vectors,
            self.n_tokens,
            self.truncated,
            self.inference_ms,
            queue_ms=self.queue_ms,
            batch_sizes=self.batch_sizes,
            cache_hits=0 if bypassed else self.hits,
            cache_bypassed=bypassed,
        )
