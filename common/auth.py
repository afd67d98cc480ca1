"""Optional bearer-key access control, as a pure ASGI middleware.

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


def parse_keys(raw: str) -> list[bytes]:
    """``"a, b,,c"`` -> the digests of ``a``, ``b`` and ``c`` (blank entries dropped)."""
    return [_digest(k.strip().encode()) for k in raw.split(",") if k.strip()]


def _digest(value: bytes) -> bytes:
    # Comparing fixed-length digests keeps hmac.compare_digest from leaking the key's length.
    return hashlib.sha256(value).digest()


class BearerAuth:
    """401 in the OpenAI error shape unless the request carries one of the keys."""

    def __init__(self, app: ASGIApp, keys: list[bytes], protect_metrics: bool = True) -> None:
        if not keys:
            raise ValueError("BearerAuth needs at least one key")
        self.app = app
        self.keys = keys
        self.protect_metrics = protect_metrics

    def _protected(self, path: str) -> bool:
        if path == "/v1" or path.startswith("/v1/"):
            return True
        return self.protect_metrics and any(path == p or path.startswith(p + "/") for p in _METRICS_PATHS)

    # --8<-- [start:check]
    def _allowed(self, header: bytes | None) -> bool:
        if header is None:
            return False
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return False
        presented = _digest(token.strip())
        # Compare against every key, never stopping early, so timing says nothing about which matched.
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(presented, key)
        return matched

    # --8<-- [end:check]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if self._allowed(header):
            await self.app(scope, receive, send)
            return
        # Never echo what the client sent: it may be a real key meant for another server.
        message = (
            "missing API key: send `Authorization: Bearer <key>`" if header is None else "invalid API key"
        )
        challenge = {"WWW-Authenticate": 'Bearer realm="embedserve"'}
        await error_response(APIError(401, message, headers=challenge))(scope, receive, send)


def install_auth(app: FastAPI, settings: Settings) -> None:
    """Add :class:`BearerAuth` when ``API_KEY`` is set (call it after the other middleware: outermost)."""
    raw = settings.api_key.get_secret_value().strip() if settings.api_key is not None else ""
    if not raw:  # unset, or `API_KEY=` in an env file: no access control
        return
    keys = parse_keys(raw)
    if not keys:  # `API_KEY=,` must not silently mean "open to all"
        raise ValueError("API_KEY holds no key: give one or several comma-separated keys")
    app.add_middleware(BearerAuth, keys=keys, protect_metrics=settings.protect_metrics)
