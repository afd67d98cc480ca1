"""Per request: an id, a timer, the counters and the log line, in one middleware.

``Telemetry`` gives each request an id (the caller's ``X-Request-ID`` when it is sane, else a
new one), returns it in ``x-request-id``, and once the app has answered counts the request by
route and status and writes its log line. On the way, the backend fills the request's
``RequestRecord`` (``logs.current_record``) from its typed result: texts, tokens, cache hits,
queue and model time.

It is a pure ASGI middleware: it wraps ``send`` to read the status and add the header. FastAPI's
idiom, ``@app.middleware("http")`` (Starlette's ``BaseHTTPMiddleware``), runs the rest of the app
in a task of its own and streams the answer through a memory stream: measured against this one in
turns, on the same code otherwise (commit 0dc2988), in ``docs/results/idiom.md``; the stage 5
chapter shows both.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stage5_metrics.logs import RequestRecord, current_record, log_request
from stage5_metrics.metrics import EMBED_ROUTES, STATIC_ROUTE, Metrics

QUIET_ROUTES = frozenset(
    {"/health", "/ready", "/metrics", "/v1/metrics", "/v1/dashboard", "/dashboard", STATIC_ROUTE}
)
_KNOWN_PATHS = EMBED_ROUTES | QUIET_ROUTES | {"/v1/models"}
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_CLIENT_GONE = 499  # no answer was made: the server gave up on the request (nginx's code for it)


def _request_id(given: str | None) -> str:
    if given is not None and _REQUEST_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex


def route_of(scope: Scope) -> str:
    """The route template: a bounded label, whatever path the client sent."""
    route = getattr(scope.get("route"), "path", None)
    if route is not None:
        return str(route)
    path = scope["path"]  # answered before routing (a 401, a 413), or a file of the page (a mount)
    return (
        path if path in _KNOWN_PATHS else STATIC_ROUTE if path.startswith(STATIC_ROUTE + "/") else "unmatched"
    )


def finish(metrics: Metrics, scope: Scope, record: RequestRecord, status: int, seconds: float) -> None:
    """Count one answered request, then write its line (5xx at WARNING, the page's own polls at DEBUG)."""
    route = route_of(scope)
    metrics.observe_request(route, status, seconds)
    level = logging.WARNING if status >= 500 else logging.DEBUG if route in QUIET_ROUTES else logging.INFO
    log_request(level, scope["method"], route, status, record, seconds * 1e3)


# --8<-- [start:middleware]
class Telemetry:
    """The middleware, outermost when added last, so it sees every answer."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    # --8<-- [start:call]
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        record = RequestRecord(_request_id(Headers(scope=scope).get("x-request-id")))
        current_record.set(record)  # for the backend to fill in (each request runs in a task of its own)
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
        except Exception:
            if status == _CLIENT_GONE:
                status = 500  # Starlette's outermost handler answers it after us
            raise
        finally:  # also when cancelled: the server gave up on the request, logged as 499
            finish(self.metrics, scope, record, status, time.perf_counter() - started)

    # --8<-- [end:call]


# --8<-- [end:middleware]
