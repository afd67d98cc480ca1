"""Optional bearer-key access control, as a middleware.

With ``API_KEY`` unset nothing changes. With ``API_KEY=key1,key2`` every ``/v1/*`` route
needs ``Authorization: Bearer <one of the keys>``; ``/metrics`` and ``/dashboard`` too
unless ``PROTECT_METRICS=false``. ``/health``, ``/ready`` and the OpenAPI docs stay open,
so a load balancer and a schema fuzzer need no key.

Why a middleware and not a FastAPI dependency: it answers before the body is read (an
unauthenticated client cannot make the server buffer anything) and it covers routes a
later stage adds (``/v1/batcher/config``, ``/metrics``) without touching them.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from common.limits import APIError, error_response
from common.settings import Settings

_METRICS_PATHS = ("/metrics", "/dashboard")
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="embedserve"'}


def parse_keys(raw: str) -> list[bytes]:
    """``"a, b,,c"`` -> the digests of ``a``, ``b`` and ``c`` (blank entries dropped)."""
    return [_digest(k.strip().encode()) for k in raw.split(",") if k.strip()]


def _digest(value: bytes) -> bytes:
    # Comparing fixed-length digests keeps hmac.compare_digest from leaking the key's length.
    return hashlib.sha256(value).digest()


def _protected(path: str, protect_metrics: bool) -> bool:
    if path == "/v1" or path.startswith("/v1/"):
        return True
    return protect_metrics and any(path == p or path.startswith(p + "/") for p in _METRICS_PATHS)


# --8<-- [start:check]
def allowed(header: str | None, keys: list[bytes]) -> bool:
    """Whether an ``Authorization`` header carries one of the keys (their digests)."""
    if header is None:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    presented = _digest(token.strip().encode("latin-1"))
    # Compare against every key, never stopping early, so timing says nothing about which matched.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key)
    return matched


# --8<-- [end:check]


def install_auth(app: FastAPI, settings: Settings) -> None:
    """The access check, when ``API_KEY`` is set (call it after the other middleware: outermost).
    401 in the API's error shape unless the request carries one of the keys."""
    raw = settings.api_key.get_secret_value().strip() if settings.api_key is not None else ""
    if not raw:  # unset, or `API_KEY=` in an env file: no access control
        return
    keys = parse_keys(raw)
    if not keys:  # `API_KEY=,` must not silently mean "open to all"
        raise ValueError("API_KEY holds no key: give one or several comma-separated keys")

    app.add_middleware(BearerAuth, keys=keys, protect_metrics=settings.protect_metrics)


class BearerAuth:
    """A pure ASGI middleware (as stage 5's telemetry, for the cost the stage 5 chapter measures)."""

    def __init__(self, app: ASGIApp, keys: list[bytes], protect_metrics: bool) -> None:
        self.app, self.keys, self.protect_metrics = app, keys, protect_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _protected(scope["path"], self.protect_metrics):
            await self.app(scope, receive, send)
            return
        raw = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        header = None if raw is None else raw.decode("latin-1")
        if allowed(header, self.keys):
            await self.app(scope, receive, send)
            return
        # Never echo what the client sent: it may be a real key meant for another server.
        missing = "missing API key: send `Authorization: Bearer <key>`"
        message = missing if header is None else "invalid API key"
        await error_response(APIError(401, message, headers=dict(_CHALLENGE)))(scope, receive, send)
