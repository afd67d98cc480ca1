"""The routes that show what the server does: ``/metrics``, ``/v1/metrics``, ``/v1/dashboard``,
``/dashboard``.

``/metrics`` is for Prometheus; the other three are for people, and read the same registry
through the window: running totals, which the page turns into rates and percentiles itself, as
Prometheus would. The page is one HTML file, one script and a vendored copy of uPlot
(``static/``), served by the server itself: no CDN, so it works without internet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import make_asgi_app
from starlette.types import Receive, Scope, Send

from stage5_metrics.metrics import STATIC_ROUTE, Metrics
from stage5_metrics.window import Window

STATIC = Path(__file__).parent / "static"


def counts_now(request: Request, metrics: Metrics, window: Window) -> dict[str, Any]:
    """``/v1/metrics``: what is queued now and the running totals (a rate needs two of these)."""
    now = metrics.earlier_stages.source()
    engine = getattr(request.app.state, "engine", None)
    return {
        "model": engine.model_name if engine is not None else None,
        "started": window.started,
        "uptime_s": round(window.clock() - window.started, 1),
        "now": {
            "queue_depth": now.queue_depth,
            "in_flight": now.in_flight,
            "tier": now.tier,
            "active_requests": now.active,
            "max_queue": now.max_queue,
        },
        "reading": window.now().as_dict(),
    }


class _Exposition:
    """prometheus-client's ASGI app as a route's endpoint: Starlette calls an endpoint that is not a
    plain function as an ASGI app."""

    def __init__(self, metrics: Metrics) -> None:
        self.app = make_asgi_app(metrics.registry)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def add_dashboard_routes(app: FastAPI, metrics: Metrics, window: Window) -> None:
    page = (STATIC / "dashboard.html").read_text()

    # Prometheus text exposition, every ``embedserve_*`` metric and the process defaults: served by
    # prometheus-client's own ASGI app (content negotiation, gzip) at /metrics itself (mounted, it
    # would answer /metrics/ and redirect /metrics there).
    # (Starlette's annotation names a request handler; an ASGI app is the documented other kind.)
    app.add_route("/metrics", _Exposition(metrics), ["GET"], include_in_schema=False)  # type: ignore[arg-type]

    @app.get("/v1/metrics", tags=["metrics"])
    async def metrics_json(request: Request) -> dict[str, Any]:
        """The queue now, and the running totals of every figure the page shows (requests by
        status, texts, tokens, cache hits by tier, batches by tier, latency and batch-size buckets,
        model time spent and saved), as one reading of the registry."""
        return counts_now(request, metrics, window)

    @app.get("/v1/dashboard", tags=["metrics"])
    async def dashboard_json(request: Request) -> dict[str, Any]:
        """What ``/v1/metrics`` has, plus a reading at every 5-second step of the last 5 minutes,
        oldest first: the page computes its rates and percentiles from them."""
        payload = counts_now(request, metrics, window)
        payload["readings"] = [r.as_dict() for r in window.readings]
        payload["step_s"] = window.step
        cost = getattr(getattr(request.app.state, "backend", None), "cost", None)
        if cost is not None:  # measured when the model has loaded
            payload["cost_model"] = cost.as_dict()
        return payload

    @app.get("/dashboard", tags=["metrics"], response_class=HTMLResponse)
    async def dashboard_page() -> str:
        """The live dashboard (HTML; polls ``/v1/dashboard``)."""
        return page

    # The page's script and stylesheet, and uPlot (static/vendor/), under /dashboard like the page.
    app.mount(STATIC_ROUTE, StaticFiles(directory=STATIC), name="dashboard-static")
