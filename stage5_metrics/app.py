"""Stage 5: the finished server. Stage 4, plus what it takes to run it: metrics, a dashboard, logs.

Nothing about how a text is embedded changes; stage 4's backend does all of that, and stage 5's
(``backend.py``) wraps it and counts. Everything it shows comes from one Prometheus registry:

* ``GET /metrics``: the registry as Prometheus text, served by prometheus-client's own ASGI app
  (``metrics.py``, ``stage_counts.py``);
* ``GET /v1/metrics`` and ``GET /v1/dashboard``: the registry's running totals as JSON, and a
  reading of them every 5 seconds for 5 minutes (``window.py``), from which the page computes its
  rates and percentiles in the browser; the model time the cache saved (``savings.py``) is one;
* ``GET /dashboard``: a live page with uPlot charts, served by the server itself (``static/``);
* one JSON log line per request, with its ``X-Request-ID`` (``telemetry.py``, ``logs.py``).

The app is made by a factory, ``create_app``, which uvicorn calls (``--factory``) after it has set
up its own loggers and before it writes its first line, so uvicorn's lines come out in the same
format as the request lines; importing this module builds nothing and starts nothing.

    make stage5   # then open http://127.0.0.1:8000/dashboard
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from prometheus_client import disable_created_metrics

from common.api import create_app as create_contract_app
from common.engine import Engine
from common.settings import Settings, get_settings
from stage3_batching import routes as batcher_routes
from stage4_cache_backpressure import backend as stage4
from stage4_cache_backpressure import routes as cache_routes
from stage4_cache_backpressure.shed import ShedWhenFull
from stage5_metrics.backend import MetricsBackend
from stage5_metrics.dashboard import add_dashboard_routes
from stage5_metrics.logs import configure_logging
from stage5_metrics.metrics import Metrics
from stage5_metrics.telemetry import Telemetry
from stage5_metrics.window import Window


# --8<-- [start:app]
def create_app(
    settings: Settings | None = None,
    *,
    stage4_backend: Callable[[Engine, Settings], stage4.CacheBackend] = stage4.make_backend,
    backend: type[MetricsBackend] = MetricsBackend,
) -> FastAPI:
    """Stage 4's app with stage 5's ``backend`` around ``stage4_backend``'s (a cluster passes one whose
    batcher is a model deployment, ``deploy/ray/composed.py``; the exercise, its own ``backend``)."""
    settings = settings or get_settings()
    configure_logging(settings)  # NEW: JSON lines for ours and uvicorn's (its thread starts with the backend)
    # NEW: no `_created` twin for every counter: it doubles the series and Prometheus does not need
    # it. prometheus-client's switch is process-wide (idempotent), so it is thrown here, once an app.
    disable_created_metrics()
    metrics = Metrics()  # NEW: one registry per app, the one counting system
    window = Window(metrics)  # NEW: its values every second, for the JSON views and the page

    def make_backend(engine: Engine, s: Settings) -> MetricsBackend:
        return backend(stage4_backend(engine, s), metrics, window)  # NEW: stage 4's, wrapped

    app = create_contract_app("stage5_metrics", make_backend, settings, __doc__ or "",
                              calls_at_once=lambda s: s.batch_concurrency)  # fmt: skip
    app.state.metrics = metrics  # (a cluster copies it into Ray's metrics: deploy/ray/app.py)
    app.include_router(batcher_routes.router)  # stage 3's routes
    app.include_router(cache_routes.router)  # stage 4's route
    app.add_middleware(ShedWhenFull)  # stage 4's door
    add_dashboard_routes(app, metrics, window)  # NEW: /metrics, /v1/metrics, /v1/dashboard, /dashboard
    app.add_middleware(Telemetry, metrics=metrics)  # NEW: outermost, so it sees every answer
    return app


# --8<-- [end:app]
