"""Shedding load at the door: while the queue is full, a new embedding request is refused unread.

Admission (step 4 of ``app.py``) refuses a request only after it has been routed, read, validated
and looked up in the cache. Under a flood of clients that send again the moment they are refused,
those refusals take the event loop from the requests that were admitted: the model slots then wait
for the loop, and the server answers fewer 200s the harder it is pushed (measured in
``docs/results/flood.md``). A refusal here costs only what uvicorn already did (the headers are
parsed): a pure ASGI middleware looks at the queue and, when it is full, answers 503 (or 429) with
Retry-After before the body is read.

The price: while the queue is full, a request whose texts are all cached is refused too (it is not
read, so nobody knows). Admission still guards the queue for requests that arrive when it is not
full yet.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from common.limits import error_body

EMBED_PATHS = frozenset({"/v1/embed", "/v1/embeddings"})


# --8<-- [start:shed]
class ShedWhenFull:
    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state  # the app's state: the backend appears there when the model has loaded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in EMBED_PATHS and scope["method"] == "POST":
            backend = getattr(self.state, "backend", None)
            if backend is not None and backend.admission.full():
                started = time.perf_counter()
                backend.stats.rejected += 1
                if backend.settings.shed_delay_ms > 0:  # NEW: a client that sends again at once waits
                    await asyncio.sleep(backend.settings.shed_delay_ms / 1e3)
                await _refuse(send, backend.admission, started)
                return
        await self.app(scope, receive, send)


async def _refuse(send: Send, admission: Any, started: float) -> None:
    depth = admission.depth()
    message = f"server overloaded: {depth} texts queued, MAX_QUEUE={admission.max_queue}; retry later"
    body = error_body(admission.status, message)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(admission.retry_after(depth + 1)).encode()),
        (b"x-total-time", f"{(time.perf_counter() - started) * 1e3:.2f}".encode()),
    ]
    await send({"type": "http.response.start", "status": admission.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# --8<-- [end:shed]
