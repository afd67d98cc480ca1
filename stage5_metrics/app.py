"""Stage 5: the finished server. Stage 4, plus what it takes to run it: metrics, a dashboard, logs.

Nothing about how a text is embedded changes; stage 4's backend does all of that. This
stage only watches, and everything it shows comes from one Prometheus registry:

* ``GET /metrics``: the registry as Prometheus text (``metrics.py``, ``stage_counts.py``);
* ``GET /v1/metrics`` and ``GET /v1/dashboard``: the last minute and since start, as JSON,
  from a window that samples the registry every second (``window.py``, ``views.py``), with
  with the model time the cache saved (``savings.py``);
* ``GET /dashboard``: a live page with uPlot charts, served by the server itself (``static/``);
* one JSON log line per request, with its ``X-Request-ID`` (``telemetry.py``, ``logs.py``).

    make stage5   # then open http://127.0.0.1:8000/dashboard
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from common.api import EmbedJob, EmbedResult
from common.engine import Engine
from common.settings import Settings, get_settings
from stage3_batching.batcher import BatchRecord
from stage4_cache_backpressure import app as stage4
from stage5_metrics.dashboard import add_dashboard_routes
from stage5_metrics.logs import configure_logging, current_record, stop_logging
from stage5_metrics.metrics import Metrics
from stage5_metrics.savings import CostModel
from stage5_metrics.stage_counts import StageCounts
from stage5_metrics.telemetry import add_telemetry
from stage5_metrics.window import Window


# --8<-- [start:backend]
class MetricsBackend(stage4.CacheBackend):
    """Stage 4's backend, counting every batch and every request's result in the registry."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        metrics: Metrics,
        window: Window,
        on_drain: Callable[[], None],
    ) -> None:
        # NEW: the batcher reports each batch once, after the model call.
        super().__init__(engine, settings, on_batch=self.on_batch, on_drain=on_drain, drain_on_signal=True)
        self.metrics, self.window = metrics, window
        self.cost: CostModel | None = None  # NEW: a lone text's cost, to price cache hits
        # NEW: stages 3 and 4's own counts, read when collected
        metrics.earlier_stages.source = self.stage_counts

    async def start(self) -> None:
        await super().start()
        # NEW: time the model on lone texts once: what a cache hit saves.
        self.cost = await run_in_threadpool(CostModel.measure, self.engine)
        self.window.start()  # NEW: sample the registry every second

    async def close(self) -> None:
        await super().close()
        await self.window.stop()
        stop_logging()  # NEW: the last request lines, before a SIGTERM ends the process

    async def embed(self, job: EmbedJob) -> EmbedResult:
        record = current_record.get()  # NEW: this request's log line (the middleware's)
        if record is not None:  # NEW: the text count first, so a 503 or 504 is logged with it too
            record.texts = len(job.texts)
        result = await super().embed(job)
        # NEW: count the typed result: texts, tokens, queue time, cache hits and what they saved.
        n, tokens = len(job.texts), sum(result.n_tokens)
        hits = result.cache_hits if result.cache_hits is not None and not result.cache_bypassed else None
        saved_ms = self.cost.cache_saved_ms(hits or 0, n, tokens) if self.cost is not None else 0.0
        queue_s = None if result.queue_ms is None else result.queue_ms / 1e3
        self.metrics.observe_result(n, tokens, queue_s, saved_ms / 1e3)
        if record is not None:  # NEW: and what the request's log line says
            record.tokens, record.queue_ms, record.inference_ms = tokens, result.queue_ms, result.inference_ms
            if hits is not None:
                record.cache_hits, record.cache_misses = hits, n - hits
        return result

    # --8<-- [end:backend]

    # --8<-- [start:on_batch]
    def on_batch(self, batch: BatchRecord) -> None:
        """Called by stage 3's batcher after each batch (one model call or several): once per batch."""
        self.metrics.observe_batch(
            batch.size, batch.padded_tokens, batch.real_tokens, batch.tier, batch.inference_ms / 1e3,
            batch.error is not None,
        )  # fmt: skip

    # --8<-- [end:on_batch]

    # --8<-- [start:stage_counts]
    def stage_counts(self) -> StageCounts:
        """What stages 3 and 4 count themselves, as the registry exports it (every name stage 5 reads)."""
        s, depth = self.stats.as_dict(), self.batcher.queue_depth  # s: /v1/cache/metrics' counters
        cache = s["cache"]
        return StageCounts(
            queue_depth=depth,
            in_flight=self.batcher.in_flight,
            tier=self.batcher.tier(depth),
            active=s["active"],
            max_queue=self.settings.max_queue,
            cache_hits=cache["hits"],
            cache_misses=cache["misses"],
            cache_errors=cache["errors"] or {"timeout": 0},
            cache_evictions=cache["evictions"],
            cache_expirations=cache["expirations"],
            deduplicated=s["deduplicated"],
            rejected={
                "overload": s["rejected"],
                "deadline": s["deadline_exceeded"],
                "disconnect": s["disconnects"],
            },
            dropped_texts=self.batcher.stats.as_dict()["skipped_texts"],  # /v1/batcher/metrics' count
            slot_busy_s={name.rsplit("_", 1)[-1]: s for name, s in self.batcher.stats.slot_busy_s.items()},
            info={"model": self.engine.model_name, "dimensions": str(self.engine.dimensions)},
        )

    # --8<-- [end:stage_counts]


# The backend from what stage 5 hands it (a subclass may run the model elsewhere: deploy/ray/composed.py).
BackendFactory = Callable[[Engine, Settings, Metrics, Window, Callable[[], None]], MetricsBackend]


# --8<-- [start:app]
def build_app(settings: Settings | None = None, backend: BackendFactory = MetricsBackend) -> FastAPI:
    settings = settings or get_settings()
    # NEW: JSON lines for ours and uvicorn's (uvicorn sets up its loggers before it imports the app).
    configure_logging(settings)
    metrics = Metrics()  # NEW: one registry per app, the one counting system
    window = Window(metrics)  # NEW: its values every second, for the JSON views and the page

    def make_backend(engine: Engine, s: Settings, on_drain: Callable[[], None]) -> MetricsBackend:
        return backend(engine, s, metrics, window, on_drain)

    app = stage4.build_app(settings, make_backend, "stage5_metrics", __doc__ or "")  # stage 4's app
    add_dashboard_routes(app, metrics, window)  # NEW: /metrics, /v1/metrics, /v1/dashboard, /dashboard
    add_telemetry(app, metrics)  # NEW: outermost, so it sees every answer
    return app


# --8<-- [end:app]

app = build_app()
