"""The API contract's errors and limits: one JSON error shape, and a body-size guard.

Every error any stage returns has the OpenAI shape::

    {"error": {"type": "...", "message": "...", "param": "...", "code": ...}}
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
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


def error_body(status: int, message: str, param: str | None = None, type: str | None = None) -> bytes:
    error: dict[str, Any] = {
        "type": type or _TYPES.get(status, "invalid_request_error"),
        "message": message,
        "param": param,
        "code": status,
    }
    return orjson.dumps({"error": error})


class BodySizeLimit:
    """Refuse bodies over ``max_bytes`` with 413 before they are buffered.

    A pure ASGI middleware: it checks Content-Length first, and counts the bytes of a
    chunked body as they arrive, so a 100 MB upload is cut off after ``max_bytes``.
    (Starlette has no built-in limit; a ``BaseHTTPMiddleware`` would cost every request.)
    The chunked case raises from ``receive``, inside the route's ``await request.body()``:
    the app's HTTPException handler answers it; should nothing answer, this class does.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    await self._refuse(send, 400, "Content-Length is not a number")
                    return
                if too_big:
                    await self._refuse(send, 413, self._message())
                    return
        received = 0
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge(self._message())
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if not response_started:
                await self._refuse(send, 413, self._message())

    def _message(self) -> str:
        return f"request body is larger than MAX_BODY_BYTES ({self.max_bytes} bytes)"

    @staticmethod
    async def _refuse(send: Send, status: int, message: str) -> None:
        body = error_body(status, message)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _TooLarge(HTTPException):
    def __init__(self, message: str) -> None:
        super().__init__(413, message, headers={"Connection": "close"})
