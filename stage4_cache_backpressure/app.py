"""Stage 4: a cache, in-flight de-duplication, a bounded queue, deadlines and a graceful drain.

The backend (``backend.py``) holds stage 3's batcher and puts its layers in front of it, in the
order a text meets them: the in-process LRU, single-flight, the Redis tier (when CACHE_URL is
set), admission (a full queue answers 503 or 429 at once, with Retry-After), then the batcher
with the request's deadline. On SIGTERM it drains (``drain.py``). While the queue is full, a
middleware refuses new requests before they are read (``shed.py``).

    make stage4                                   # in-process cache only
    CACHE_URL=redis://127.0.0.1:6379/0 make stage4  # two tiers, shared by every replica

New headers: ``x-cache: hit | miss | partial | bypass`` with ``x-cache-hits`` and
``x-cache-misses``. New route: ``GET /v1/cache/metrics``.
"""

from __future__ import annotations

from common.api import create_app
from stage3_batching import routes as batcher_routes
from stage4_cache_backpressure import routes as cache_routes
from stage4_cache_backpressure.backend import make_backend
from stage4_cache_backpressure.shed import ShedWhenFull

# --8<-- [start:build]
app = create_app(
    "stage4_cache_backpressure",
    make_backend,
    description=__doc__ or "",
    calls_at_once=lambda s: s.batch_concurrency,
)
app.include_router(batcher_routes.router)  # stage 3's routes
app.include_router(cache_routes.router)  # NEW: /v1/cache/metrics
app.add_middleware(ShedWhenFull)  # NEW: a full queue refuses requests unread
# --8<-- [end:build]
