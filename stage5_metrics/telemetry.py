"""Per request: an id, a timer, the counters and the log line, in one middleware.

``TelemetryMiddleware`` gives each request an id (the caller's ``X-Request-ID`` when it is
sane, else a new one), returns it in ``x-request-id``, and once the answer is out counts the
request by route and status and writes its log line. On the way, the backend fills the
request's ``RequestRecord`` from its typed result (texts, tokens, cache hits, queue and model time).

It is a pure ASGI middleware, not FastAPI's ``@app.middleware("http")`` (Starlette's
``BaseHTTPMiddleware``, which runs the rest of the app in a task group and streams the answer
through a memory stream; Starlette's documentation lists its limitations, context variables
and background tasks among them). Starlette's own middleware are all pure ASGI, and so are the
others here (``common/limits.py``, ``common/auth.py``, stage 4's ``shed.py``): a middleware that
only watches the messages go by needs nothing more.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stage5_metrics.logs import RequestRecord, log_request
from stage5_metrics.metrics import EMBED_ROUTES, STATIC_ROUTE, Metrics

QUIET_ROUTES = frozenset(
    {"/health", "/ready", "/metrics", "/v1/metrics", "/v1/dashboard", "/dashboard", STATIC_ROUTE}
)
_KNOWN_PATHS = EMBED_ROUTES | QUIET_ROUTES | {"/v1/models"}
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_CLIENT_GONE = 499  # no answer was made: the client left first (nginx's code for it)
# Generated ids: a random half per process, a counter for the other (cheaper than 16 random bytes).
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count()


def _request_id(given: str | None) -> str:
    if given is not None and _REQUEST_ID.fullmatch(given):
        return given
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


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
class TelemetryMiddleware:
    """A pure ASGI middleware: it wraps ``send`` to read the status and add ``x-request-id``."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    # --8<-- [start:call]
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), None)
        record = RequestRecord(_request_id(given))
        # request.state.log_record: the contract hands it to the backend, as the job's log_record
        scope.setdefault("state", {})["log_record"] = record
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
