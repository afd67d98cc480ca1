"""Stage 5's backend: stage 4's, wrapped, every batch and every request's result counted.

Nothing about how a text is embedded changes: the backend holds stage 4's and awaits it, then
counts what came back, the way a middleware wraps the app it holds. The routes that stage 4's
backend serves (the shed check, ``/v1/cache/metrics``, stage 3's batcher routes) are handed
through.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from common.backend import EmbedJob, EmbedResult
from common.batch_stats import BatchRecord
from common.limits import Overloaded
from stage4_cache_backpressure.backend import CacheBackend
from stage5_metrics.logs import current_record, start_logging, stop_logging
from stage5_metrics.metrics import Metrics
from stage5_metrics.savings import CostModel
from stage5_metrics.stage_counts import StageCounts
from stage5_metrics.window import Window


# --8<-- [start:backend]
class MetricsBackend:
    """Stage 4's backend, counting every batch and every request's result in the registry."""

    def __init__(self, inner: CacheBackend, metrics: Metrics, window: Window) -> None:
        self.inner, self.metrics, self.window = inner, metrics, window  # NEW: stage 4's backend, held
        self.engine, self.batcher, self.settings = inner.engine, inner.batcher, inner.settings
        self.cost: CostModel | None = None  # NEW: a lone text's cost, to price cache hits
        inner.batcher.watch(self.on_batch)  # NEW: the batcher reports each batch once, after the model
        metrics.earlier_stages.source = self.stage_counts  # NEW: stages 3 and 4's counts, read when collected

    async def start(self) -> None:
        start_logging()  # NEW: the thread that writes the log lines
        await self.inner.start()
        # NEW: time the model on lone texts once: what a cache hit saves.
        self.cost = await run_in_threadpool(CostModel.measure, self.engine)
        self.window.start()  # NEW: sample the registry every second

    async def embed(self, job: EmbedJob) -> EmbedResult:
        record = current_record.get()  # NEW: this request's log line (the middleware's)
        if record is not None:  # NEW: the text count first, so a 503 or 504 is logged with it too
            record.texts = len(job.texts)
        result = await self.inner.embed(job)  # stage 4's steps, whole
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

    async def close(self) -> None:
        await self.inner.close()
        await self.window.stop()
        stop_logging()  # NEW: the last request lines, before a SIGTERM ends the process

    # --8<-- [end:backend]

    # What stage 4's backend answers, handed through: the drain, the door, /v1/cache/metrics.
    @property
    def draining(self) -> bool:
        return self.inner.draining

    def turn_away(self) -> Overloaded | None:
        return self.inner.turn_away()

    def cache_metrics(self) -> dict[str, Any]:
        return self.inner.cache_metrics()

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
        s, depth = self.inner.stats, self.batcher.queue_depth  # /v1/cache/metrics' counters
        cache = s.cache
        return StageCounts(
            queue_depth=depth,
            in_flight=self.batcher.in_flight,
            tier=self.batcher.window(depth)[0],
            active=s.active,
            max_queue=self.settings.max_queue,
            cache_hits={t: cache.hits[t] for t in ("memory", "redis")},
            cache_misses={t: cache.misses[t] for t in ("memory", "redis")},
            cache_errors=dict(cache.errors) or {"timeout": 0},
            cache_evictions=cache.evictions,
            cache_expirations=cache.expirations,
            deduplicated=s.deduplicated,
            rejected={"overload": s.rejected, "deadline": s.deadline_exceeded, "disconnect": s.disconnects},
            dropped_texts=self.batcher.stats.skipped_texts,  # /v1/batcher/metrics' count
            slot_busy_s={name.rsplit("_", 1)[-1]: s for name, s in self.batcher.stats.slot_busy_s.items()},
            info={"model": self.engine.model_name, "dimensions": str(self.engine.dimensions)},
        )

    # --8<-- [end:stage_counts]
