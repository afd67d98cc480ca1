"""Stage 3: dynamic batching. Concurrent requests share one model call.

The backend (``backend.py``) hands every request's texts to one batcher, which runs them in
batches (BATCH_CONCURRENCY side by side, in threads of its own) and answers every caller.
``batcher.py`` is the textbook batcher; the server runs it with the chapter's four refinements
(``refined.py``: load tiers, length grouping, length buckets, failure isolation).

New routes (``routes.py``): ``GET /v1/batcher/config`` and ``GET /v1/batcher/metrics``. New
headers: ``x-queue-time`` (ms waiting for a batch) and ``x-batch-size`` (sizes of the caller's
batches).

    make stage3   # MAX_BATCH_SIZE, MAX_BATCH_TOKENS, BATCH_WINDOW_MS, ... from the environment
"""

from __future__ import annotations

from common.api import create_app
from stage3_batching.backend import make_backend
from stage3_batching.routes import router

app = create_app(
    "stage3_batching", make_backend, description=__doc__ or "", calls_at_once=lambda s: s.batch_concurrency
)
app.include_router(router)  # NEW: /v1/batcher/config, /v1/batcher/metrics
