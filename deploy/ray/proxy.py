"""A middleware in Ray Serve's HTTP proxy: every request gets an answer in the API's error shape.

Ray's proxy loads it from ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deploy.ray.proxy.middlewares``
(``make cluster`` sets it on the head node). It changes two answers of the proxy, never a
replica's own:

* the replica holding a request dies (its node crashed): the proxy gets an actor error and
  sends *nothing*, so its web server writes a bare ``500 Internal Server Error``. Embedding is
  idempotent, so the honest answer is **503 with Retry-After**: send it again, another replica
  will take it;
* the proxy refuses a request itself (its queue, ``max_queued_requests``, is full): Ray writes a
  text body; it becomes the same JSON error a replica's own refusal has, status and Retry-After kept;
* a request outlives the proxy's timeout (``CLUSTER_PROXY_TIMEOUT_S``, queue included): Ray answers
  408, the status for a client too slow to send its request; it becomes a 504, a deadline passed
  on the server's side, as a replica's own deadline answers.
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
        refusal: Message | None = None  # the proxy's own 503/429, held until its text body

        async def send_error(error: APIError) -> None:
            with contextlib.suppress(OSError):  # the client has gone too
                await error_response(error)(scope, receive, send)

        async def watch(message: Message) -> None:
            nonlocal started, refusal
            if message["type"] == "http.response.start":
                started = True
                if message["status"] in (408, 429, 503) and _is_text(message):
                    refusal = message  # the proxy's own answer; a replica's is JSON
                    return
            elif refusal is not None and message["type"] == "http.response.body":
                text = message.get("body", b"").decode(errors="replace").strip()
                if refusal["status"] == 408:
                    return await send_error(APIError(504, f"deadline passed in the cluster: {text}"))
                kept = {k.decode(): v.decode() for k, v in refusal["headers"] if k.lower() == b"retry-after"}
                return await send_error(APIError(refusal["status"], f"overloaded: {text}", headers=kept))
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            if started:
                raise
        if not started:  # the replica was lost with the request: nothing was sent
            message = "the replica serving this request was lost; retry (embedding is idempotent)"
            await send_error(APIError(503, message, headers={"Retry-After": str(LOST_RETRY_AFTER_S)}))


# --8<-- [end:middleware]


def _is_text(message: Message) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/") for k, v in message["headers"])
