"""A middleware in Ray Serve's HTTP proxy: a request whose replica was lost still gets an answer.

Ray's proxy loads it from ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deploy.ray.proxy.middlewares``
(``make cluster`` sets it on the nodes). It never changes an answer: it adds one where there is
none. When the replica holding a request dies (its node crashed), the proxy gets an actor error
and sends *nothing*, so its web server writes a bare ``500 Internal Server Error``. Embedding is
idempotent, so the honest answer is **503 with Retry-After**: send it again, another replica will
take it.

Why in the proxy, through a variable Ray reads but does not document: Serve's documented place for
a middleware is the ingress deployment's app (``HTTPOptions.middlewares`` now refuses any, pointing
there), and a middleware in a replica cannot answer for that replica's own loss; only the proxy is
left to answer then. (A lost *model* replica in the composed design is the ingress's to answer:
``deploy/ray/composed.py`` maps the handle's actor error to the same 503.)

Refusals are not made here: every refusal is the replica's own (stage 4's bounded queue, in the
API's error shape), because the application gives each replica more room (``max_ongoing_requests``)
than stage 5 admits (``deploy/ray/app.py``).
"""

from __future__ import annotations

import contextlib

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.limits import APIError, error_response

LOST_RETRY_AFTER_S = 1


def middlewares() -> list[Middleware]:
    """What the proxy calls at start (the import path above names this function)."""
    return [Middleware(AnswerEveryRequest)]


# --8<-- [start:middleware]
class AnswerEveryRequest:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            if started:
                raise
        if not started:  # the replica was lost with the request: nothing was sent
            message = "the replica serving this request was lost; retry (embedding is idempotent)"
            error = APIError(503, message, headers={"Retry-After": str(LOST_RETRY_AFTER_S)})
            with contextlib.suppress(OSError):  # the client has gone too
                await error_response(error)(scope, receive, send)


# --8<-- [end:middleware]
