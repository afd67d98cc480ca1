"""The API contract with no model: what a request costs apart from the model (``benchmarks.cost_model``).

A backend that tokenizes, as every stage does, and answers with fixed vectors instead of running
the model: ``python -m common.serve benchmarks.null_backend``.
"""

from __future__ import annotations

import numpy as np

from common.api import EmbedJob, EmbedResult, create_app, tokenize
from common.engine import Engine, l2_normalize
from common.settings import Settings


class NullBackend:
    """Answers without the model: what a request still costs is the contract's own work."""

    draining = False

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.vectors = l2_normalize(np.ones((settings.max_items, engine.dimensions), np.float32))

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def embed(self, job: EmbedJob) -> EmbedResult:
        tokens = await tokenize(self.engine, job)  # every stage tokenizes; only the model is left out
        n = len(job.texts)
        return EmbedResult(self.vectors[:n], [t.n_tokens for t in tokens], [t.truncated for t in tokens])


app = create_app("null backend", NullBackend)
