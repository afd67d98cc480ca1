"""The API contract's errors and limits: one JSON error shape, and a body-size guard.

Every error any stage returns has the OpenAI shape::

    {"error": {"type": "...", "message": "...", "param": "...", "code": ...}}
"""

from __future__ import annotations

import asyncio

import orjson
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "overloaded_error",
    500: "server_error",
    503: "overloaded_error",
    504: "timeout_error",
}


class APIError(Exception):
    """An error with a status code, answered in the OpenAI error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}


# --8<-- [start:outcomes]
# The outcomes a request can meet besides its answer, each a type of its own: a counter counts by
# type (stage 4's ``Stage4Stats``), never by status number, so a 503 for "not ready" is never
# counted as an overload.
class NotReady(APIError):
    """503: no backend to serve it: the model is loading, or the server is shutting down."""

    def __init__(self, message: str = "") -> None:
        message = message or "the server is not ready: the model is loading, or the server is shutting down"
        super().__init__(503, message, headers={"Retry-After": "1"})


class Overloaded(APIError):
    """503 (or 429, by OVERLOAD_STATUS): the bounded queue is full; ``Retry-After`` says when to retry."""

    def __init__(self, message: str, *, status: int = 503, retry_after_s: int = 1) -> None:
        super().__init__(status, message, headers={"Retry-After": str(retry_after_s)})


class DeadlineExceeded(APIError):
    """504: the request's deadline passed before its texts reached the model."""

    def __init__(self, message: str) -> None:
        super().__init__(504, message)


class ClientGone(APIError):
    """499: the client hung up; nobody reads this answer, and its queued work is dropped."""

    def __init__(self, message: str = "client closed the request") -> None:
        super().__init__(499, message)


# --8<-- [end:outcomes]


def not_ready() -> NotReady:
    """A request that needs the backend while there is none: before the lifespan has made it, or
    after it has closed it (and ``/ready`` from the drain's start)."""
    return NotReady()


def model_failed(exc: Exception) -> APIError:
    """The model raised on this request's texts: a 500 that names the error, never its text."""
    return APIError(500, f"the model failed on this request: {type(exc).__name__}")


def error_response(exc: APIError) -> Response:
    """The one way any error is answered, as JSON in the shape above. A Starlette response is an
    ASGI app too, so a pure ASGI middleware answers with it before any route runs:
    ``await error_response(exc)(scope, receive, send)``."""
    error = {"type": exc.type, "message": exc.message, "param": exc.param, "code": exc.status}
    return Response(
        orjson.dumps({"error": error}), exc.status, headers=exc.headers, media_type="application/json"
    )


class BodyGuard:
    """Refuse a request body that is too large, compressed, or too slow, before it is buffered.

    A pure ASGI middleware, because it wraps the ``receive`` channel the route reads the body
    from, which FastAPI's ``@app.middleware("http")`` cannot hand on to the app. Three rules:

    - **size**: over ``max_bytes`` gets 413. Content-Length is checked first, and the bytes of a
      chunked body are counted as they arrive, so a 100 MB upload is cut off after ``max_bytes``.
    - **encoding**: a body with a ``Content-Encoding`` other than ``identity`` gets 415 (RFC 9110
      15.5.16). The server does not decompress request bodies: a compressed body would otherwise
      reach the JSON parser as bytes and come back as a puzzling 422, and decompressing would
      need its own limits (a 50 KB gzip body can inflate to 50 MB).
    - **time**: the whole body must arrive within ``timeout_s`` of the request's start, or 408.
      A client that trickles its body a byte at a time holds no thread and no batch slot here,
      but without a deadline it would hold its connection and a task forever.

    The chunked and slow cases raise from ``receive``, inside the route's ``await request.body()``:
    the app's HTTPException handler answers; should nothing answer, this class does.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    await _refuse(400, "Content-Length is not a number", scope, receive, send)
                    return
                if too_big:
                    await _refuse(413, self._message(), scope, receive, send)
                    return
            elif name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
                encoding = value.decode("latin-1")[:40]
                message = f"Content-Encoding {encoding!r} is not supported: send the JSON body uncompressed"
                await _refuse(415, message, scope, receive, send)
                return
        received = 0
        body_done = False
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        response_started = False

        async def guarded_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # after the body, receive() waits for a disconnect: no deadline on that
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise _TooSlow(self.timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge(self._message())
                body_done = not message.get("more_body", False)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, tracking_send)
        except (_TooLarge, _TooSlow) as exc:
            if not response_started:
                await _refuse(exc.status_code, exc.detail, scope, receive, send)

    def _message(self) -> str:
        return f"request body is larger than MAX_BODY_BYTES ({self.max_bytes} bytes)"


async def _refuse(status: int, message: str, scope: Scope, receive: Receive, send: Send) -> None:
    # The connection closes after it: the rest of the body, unread, must not be taken for a request.
    await error_response(APIError(status, message, headers={"Connection": "close"}))(scope, receive, send)


class _TooLarge(HTTPException):
    def __init__(self, message: str) -> None:
        super().__init__(413, message, headers={"Connection": "close"})


class _TooSlow(HTTPException):
    def __init__(self, timeout_s: float) -> None:
        message = f"request body did not arrive within BODY_TIMEOUT_S ({timeout_s:g} s)"
        super().__init__(408, message, headers={"Connection": "close"})
