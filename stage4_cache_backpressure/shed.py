"""Shedding load at the door: while the queue is full, a new embedding request is refused unread.

Admission (step 4 of ``app.py``) refuses a request only after it has been routed, read, validated
and looked up in the cache. Under a flood of clients that send again the moment they are refused,
those refusals take the event loop from the requests that were admitted: the model slots then wait
for the loop, and the server answers fewer 200s the harder it is pushed (the flood in
``docs/results/stage4.md``). A refusal here costs only what uvicorn already did (the headers are
parsed): a middleware looks at the queue and, when it is full, answers 503 (or 429) with
Retry-After before the body is read.

The price: while the queue is full, a request whose texts are all cached is refused too (it is not
read, so nobody knows). Admission still guards the queue for requests that arrive when it is not
full yet.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from common.limits import error_response

EMBED_PATHS = frozenset({"/v1/embed", "/v1/embeddings"})


# --8<-- [start:shed]
class ShedWhenFull:
    """A pure ASGI middleware (the stage 5 chapter measures FastAPI's idiom beside it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in EMBED_PATHS and scope["method"] == "POST":
            # The backend is on the app's state once the model has loaded (``common.api``'s lifespan).
            backend = scope["app"].state.backend
            refusal = None if backend is None else backend.turn_away()  # NEW: the backend decides
            if refusal is not None:
                started = time.perf_counter()
                if backend.settings.shed_delay_ms > 0:  # NEW: a client that sends again at once waits
                    await asyncio.sleep(backend.settings.shed_delay_ms / 1e3)
                refusal.headers["x-total-time"] = f"{(time.perf_counter() - started) * 1e3:.2f}"
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# --8<-- [end:shed]
