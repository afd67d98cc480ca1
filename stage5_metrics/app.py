"""Stage 5: the finished server. Stage 4, plus what it takes to run it: metrics, a dashboard, logs.

Nothing about how a text is embedded changes; stage 4's backend does all of that. This
stage only watches, and watching must be cheap (measured: ``make stage5-overhead``):

* ``GET /metrics``: Prometheus text (``metrics.py``);
* ``GET /v1/metrics`` and ``GET /v1/dashboard``: the last minute and since start, as JSON
  (``window.py``), with the model-seconds saved by the cache and by batching (``savings.py``);
* ``GET /dashboard``: a live page, served by the server itself, no CDN (``static/``);
* one JSON log line per request, with its ``X-Request-ID`` (``logs.py``, ``telemetry.py``).

    make stage5   # then open http://127.0.0.1:8000/dashboard
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from common.api import EmbedJob, EmbedResult, create_app
from common.engine import Engine
from common.settings import Settings, get_settings
from stage3_batching.app import add_batcher_routes
from stage4_cache_backpressure.app import CacheBackend, add_cache_routes
from stage5_metrics.dashboard import add_telemetry_routes, live_counters
from stage5_metrics.savings import CostModel
from stage5_metrics.telemetry import Telemetry, TelemetryMiddleware, record_of


# --8<-- [start:backend]
class MetricsBackend(CacheBackend):
    """Stage 4's backend, reporting every batch and every request to ``Telemetry``."""

    def __init__(self, engine: Engine, settings: Settings, telemetry: Telemetry, app: FastAPI) -> None:
        def stop_ready() -> None:
            app.state.ready = False

        # NEW: the batcher tells us about each batch once, after the model call.
        super().__init__(
            engine, settings, on_batch=telemetry.on_batch, on_drain=stop_ready, drain_on_signal=True
        )
        self.telemetry = telemetry
        live = telemetry.live  # NEW: read at scrape time only
        live.queue_depth = lambda: self.batcher.queue_depth
        live.in_flight = lambda: self.batcher.in_flight
        live.tier = lambda: self.batcher.tier(self.batcher.queue_depth)
        live.counters = lambda: live_counters(self)
        live.info = {"model": engine.model_name, "dimensions": str(engine.dimensions)}

    async def start(self) -> None:
        await super().start()
        # NEW: time the model on lone texts once, the baseline of the savings estimate.
        self.telemetry.cost = await run_in_threadpool(CostModel.measure, self.engine)

    async def close(self) -> None:
        await super().close()
        self.telemetry.log.flush()  # NEW: the last request lines

    async def embed(self, job: EmbedJob) -> EmbedResult:
        record = record_of(job.request.scope) if job.request is not None else None
        if record is None:
            return await super().embed(job)
        # NEW: the text count first, so a 503 or 504 is logged with it too.
        record.texts = len(job.texts)
        result = await super().embed(job)
        record.tokens = sum(result.n_tokens)
        record.queue_ms = result.queue_ms
        record.inference_ms = result.inference_ms
        if result.cache_hits is not None and not result.cache_bypassed:
            record.cache_hits = result.cache_hits
            record.cache_misses = len(job.texts) - result.cache_hits
            cost = self.telemetry.cost
            if record.cache_hits and cost is not None:
                record.saved_cache_ms = record.cache_hits * cost.alone_ms(record.tokens / record.texts)
        return result


# --8<-- [end:backend]


# --8<-- [start:app]
def build_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    telemetry = Telemetry(settings)  # NEW: one registry, one window and the request log per app

    def make_backend(engine: Engine, s: Settings) -> MetricsBackend:
        return MetricsBackend(engine, s, telemetry, app)

    app = create_app(
        "stage5_metrics",
        make_backend,
        settings,
        description=__doc__ or "",
        calls_at_once=lambda s: s.batch_concurrency,
    )
    add_batcher_routes(app)
    add_cache_routes(app)
    add_telemetry_routes(app, telemetry)  # NEW: /metrics, /v1/metrics, /v1/dashboard, /dashboard
    app.add_middleware(TelemetryMiddleware, telemetry=telemetry)  # NEW: outermost, sees every answer
    return app


# --8<-- [end:app]

app = build_app()
