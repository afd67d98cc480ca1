"""Where every request and every batch is counted once: Prometheus, the window, the log.

``TelemetryMiddleware`` is a pure ASGI middleware (a ``BaseHTTPMiddleware`` would run each
request through an extra task and stream; that alone costs a few percent). It gives each
request an id, times it, and after the response reads a small ``RequestRecord`` that the
backend filled in on the way (texts, tokens, cache hits, queue and inference time).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.settings import Settings
from stage5_metrics.logs import RequestLog, RequestRecord
from stage5_metrics.metrics import LiveState, Metrics
from stage5_metrics.savings import CostModel
from stage5_metrics.window import Window

RECORD_KEY = "embedserve.record"  # where the record lives in the ASGI scope
EMBED_ROUTES = frozenset({"/v1/embed", "/v1/embeddings"})
_QUIET_ROUTES = frozenset(
    {"/health", "/ready", "/metrics", "/v1/metrics", "/v1/dashboard", "/dashboard", "/dashboard/dashboard.js"}
)
_KNOWN_PATHS = EMBED_ROUTES | _QUIET_ROUTES | {"/v1/models"}
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
_CLIENT_GONE = 499  # no response was sent: the client left first (nginx's code for it)
# Generated ids: a random half per process, a counter for the other (cheaper than 16 random bytes).
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count()


def record_of(scope: Scope) -> RequestRecord | None:
    return scope.get(RECORD_KEY)


def _request_id(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id" and _REQUEST_ID.fullmatch(value):
            return value.decode()
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


class Telemetry:
    """The counters of one app: a Prometheus registry, a window for people, a cost model."""

    def __init__(self, settings: Settings) -> None:
        self.log = RequestLog(settings)
        self.live = LiveState()
        self.metrics = Metrics(self.live)
        self.window = Window()
        self.cost: CostModel | None = None  # measured when the backend starts

    # --8<-- [start:on_batch]
    def on_batch(self, batch: Any) -> None:
        """Called by stage 3's batcher after each model call: once per batch, not per text."""
        failed = getattr(batch, "error", None) is not None
        seconds = batch.inference_ms / 1e3
        self.metrics.observe_batch(
            batch.size, batch.padded_tokens, batch.real_tokens, batch.tier, seconds, failed
        )
        if failed:
            return
        saved = (
            self.cost.batch_saved_ms(batch.size, batch.real_tokens, batch.inference_ms) if self.cost else 0.0
        )
        self.window.record_batch(
            batch.size,
            batch.padded_tokens,
            batch.real_tokens,
            batch.tier,
            batch.inference_ms,
            saved,
            self.live.queue_depth(),
        )

    # --8<-- [end:on_batch]

    def finish(self, scope: Scope, record: RequestRecord, status: int, seconds: float) -> None:
        """Count one answered request everywhere, then write its log line."""
        route = getattr(scope.get("route"), "path", None)
        if route is None:  # answered before routing (401 from the key check, 413 from the body limit)
            route = scope["path"] if scope["path"] in _KNOWN_PATHS else "unmatched"
        total_ms = seconds * 1e3
        if route in EMBED_ROUTES:
            ok = status == 200
            queue_ms = record.queue_ms
            self.metrics.requests.observe(
                route,
                status,
                seconds,
                record.texts if ok else 0,
                record.tokens if ok else 0,
                None if queue_ms is None else queue_ms / 1e3,
            )
            self.window.record_request(
                status,
                total_ms,
                record.texts,
                record.tokens,
                record.cache_hits,
                record.cache_misses,
                queue_ms,
                record.saved_cache_ms,
            )
        else:
            self.metrics.requests.observe(route, status, seconds)
        level = (
            logging.WARNING if status >= 500 else logging.DEBUG if route in _QUIET_ROUTES else logging.INFO
        )
        if self.log.enabled(level):
            self.log.write(level, scope["method"], route, status, record, total_ms)


# --8<-- [start:middleware]
class TelemetryMiddleware:
    def __init__(self, app: ASGIApp, telemetry: Telemetry) -> None:
        self.app = app
        self.telemetry = telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        record = scope[RECORD_KEY] = RequestRecord(_request_id(scope))
        header = (b"x-request-id", record.request_id.encode())
        status = _CLIENT_GONE

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except asyncio.CancelledError:
            raise  # the server gave up on the request (client gone): logged as 499
        except Exception:
            if status == _CLIENT_GONE:
                status = 500  # Starlette's outermost handler answers it after us
            raise
        finally:
            self.telemetry.finish(scope, record, status, time.perf_counter() - started)


# --8<-- [end:middleware]
