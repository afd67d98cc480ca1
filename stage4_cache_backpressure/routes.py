"""Stage 4's own route: what the cache, single-flight and admission have done."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from common.api import backend_of

router = APIRouter(tags=["cache"])


# --8<-- [start:routes]
@router.get("/v1/cache/metrics")
async def cache_metrics(backend: Annotated[Any, Depends(backend_of)]) -> dict[str, Any]:
    """Cache hits and misses by tier, Redis errors, de-duplicated texts, 503s, 504s, disconnects."""
    metrics: dict[str, Any] = backend.cache_metrics()
    return metrics


# --8<-- [end:routes]
