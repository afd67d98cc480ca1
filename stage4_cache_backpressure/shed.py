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

from fastapi import FastAPI, Request, Response
from starlette.middleware.base import RequestResponseEndpoint

from common.limits import error_response

EMBED_PATHS = frozenset({"/v1/embed", "/v1/embeddings"})


# --8<-- [start:shed]
def add_shedding(app: FastAPI) -> None:
    @app.middleware("http")
    async def shed_when_full(request: Request, call_next: RequestResponseEndpoint) -> Response:
        # The backend is on the app's state once the model has loaded (``common.api``'s lifespan).
        backend = getattr(request.app.state, "backend", None)
        embedding = request.method == "POST" and request.url.path in EMBED_PATHS
        if not embedding or backend is None or not backend.admission.full():
            return await call_next(request)
        started = time.perf_counter()
        backend.stats.rejected += 1
        if backend.settings.shed_delay_ms > 0:  # NEW: a client that sends again at once waits
            await asyncio.sleep(backend.settings.shed_delay_ms / 1e3)
        refusal = backend.admission.overloaded(backend.admission.depth(), 1)
        refusal.headers["x-total-time"] = f"{(time.perf_counter() - started) * 1e3:.2f}"
        return error_response(refusal)


# --8<-- [end:shed]
