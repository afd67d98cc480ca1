"""The routes that show what the server does: ``/metrics``, ``/v1/metrics``, ``/v1/dashboard``,
``/dashboard``.

``/metrics`` is for Prometheus; the other three are for people. The page is one HTML file
and one script (``static/``), no framework and no CDN: it polls ``/v1/dashboard`` every two
seconds and draws its charts as SVG.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from common.api import json_response
from stage5_metrics.metrics import CONTENT_TYPE
from stage5_metrics.telemetry import Telemetry

if TYPE_CHECKING:
    from stage4_cache_backpressure.app import CacheBackend

STATIC = Path(__file__).parent / "static"


def live_counters(backend: CacheBackend) -> dict[str, tuple[str, str, dict[str, float]]]:
    """Stage 4's and stage 3's own counters, as Prometheus counters (read at scrape time)."""
    s, c = backend.stats, backend.stats.cache
    tiers = ("memory", "redis")
    return {
        "cache_hits": ("Texts found in the cache, by tier.", "tier", {t: c.hits[t] for t in tiers}),
        "cache_misses": ("Texts not found in the cache, by tier.", "tier", {t: c.misses[t] for t in tiers}),
        "cache_errors": (
            "Redis lookups or writes that failed, by kind (the request was still answered).",
            "kind",
            dict(c.errors) or {"timeout": 0},
        ),
        "cache_evictions": (
            "Memory entries pushed out by CACHE_MAX_ITEMS or CACHE_MAX_BYTES.",
            "",
            {"": c.evictions},
        ),
        "cache_expirations": ("Memory entries found past CACHE_TTL_S.", "", {"": c.expirations}),
        "deduplicated_texts": (
            "Texts answered by another request's computation (single-flight).",
            "",
            {"": s.deduplicated},
        ),
        "rejected_requests": (
            "Requests refused or dropped: overload (queue full), deadline (504), disconnect (client left).",
            "reason",
            {"overload": s.rejected, "deadline": s.deadline_exceeded, "disconnect": s.disconnects},
        ),
        "dropped_texts": (
            "Queued texts skipped before the model (caller cancelled or deadline passed).",
            "",
            {"": backend.batcher.stats.skipped_texts},
        ),
    }


def _now(request: Request) -> dict[str, Any]:
    backend = getattr(request.app.state, "backend", None)
    if backend is None:
        return {"queue_depth": 0, "in_flight": 0, "tier": "low", "active_requests": 0}
    depth = backend.batcher.queue_depth
    return {
        "queue_depth": depth,
        "in_flight": backend.batcher.in_flight,
        "tier": backend.batcher.tier(depth),
        "active_requests": backend.stats.active,
        "max_queue": backend.admission.max_queue,
    }


def metrics_payload(request: Request, telemetry: Telemetry) -> dict[str, Any]:
    """``/v1/metrics``: the last minute and since start, and the state now."""
    window = telemetry.window
    since_start = window.summary(None)
    backend = getattr(request.app.state, "backend", None)
    if backend is not None:  # counts stage 4 keeps itself, since start only
        since_start["rejections"]["disconnect"] = backend.stats.disconnects
        since_start["cache"]["deduplicated"] = backend.stats.deduplicated
    engine = getattr(request.app.state, "engine", None)
    return {
        "model": engine.model_name if engine is not None else None,
        "uptime_s": round(time.time() - window.started, 1),
        "now": _now(request),
        "last_minute": window.summary(60),
        "since_start": since_start,
    }


def add_telemetry_routes(app: FastAPI, telemetry: Telemetry) -> None:
    page = (STATIC / "dashboard.html").read_bytes()
    script = (STATIC / "dashboard.js").read_bytes()

    @app.get(
        "/metrics",
        tags=["metrics"],
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text format"}},
    )
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition: every ``embedserve_*`` metric and the process defaults."""
        return Response(telemetry.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/metrics", tags=["metrics"])
    async def metrics_json(request: Request) -> Response:
        """Requests/s, latency percentiles, hit rate, batches, tiers, rejections and savings:
        over the last minute and since start."""
        return json_response(metrics_payload(request, telemetry))

    @app.get("/v1/dashboard", tags=["metrics"])
    async def dashboard_json(request: Request) -> Response:
        """Everything ``/v1/metrics`` has, plus 5-second points over the last 5 minutes for the charts."""
        payload = metrics_payload(request, telemetry)
        payload["series"] = telemetry.window.series(seconds=300, step=5)
        payload["step_s"] = 5
        if telemetry.cost is not None:
            payload["cost_model"] = telemetry.cost.as_dict()
        return json_response(payload)

    @app.get("/dashboard", tags=["metrics"], response_class=HTMLResponse)
    async def dashboard_page() -> Response:
        """The live dashboard (HTML; polls ``/v1/dashboard``)."""
        return HTMLResponse(page)

    @app.get("/dashboard/dashboard.js", include_in_schema=False)
    async def dashboard_script() -> Response:
        return Response(script, media_type="text/javascript")
