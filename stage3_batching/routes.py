"""Stage 3's own routes: what the batcher runs with, and what it has done.

Any app whose backend holds a ``batcher`` includes them (stages 3, 4 and 5).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from common.api import backend_of
from stage3_batching.batcher import Batcher

BATCHER_SETTINGS = ("batcher", "max_batch_size", "max_batch_tokens", "batch_concurrency", "batch_window_ms",
          "batch_window_high_ms", "batch_low_threshold", "batch_high_threshold", "batch_tier_rule",
          "batch_rate_low", "batch_rate_high", "group_by_length",
          "group_window", "split_by_length", "call_overhead_tokens")  # fmt: skip

router = APIRouter(tags=["batcher"])


async def batcher_of(backend: Annotated[Any, Depends(backend_of)]) -> Batcher:
    batcher: Batcher = backend.batcher
    return batcher


TheBatcher = Annotated[Batcher, Depends(batcher_of)]


# --8<-- [start:routes]
@router.get("/v1/batcher/config")
async def batcher_config(batcher: TheBatcher) -> dict[str, Any]:
    """The batching settings this server runs with."""
    return {key: getattr(batcher.settings, key) for key in BATCHER_SETTINGS}


@router.get("/v1/batcher/metrics")
async def batcher_metrics(batcher: TheBatcher) -> dict[str, Any]:
    """Batches, texts, batch-size distribution, tier counts, padding ratio, queue depth now."""
    return {**batcher.stats.as_dict(), "queue_depth": batcher.queue_depth, "in_flight": batcher.in_flight}


# --8<-- [end:routes]
