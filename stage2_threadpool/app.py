"""Stage 2: the model runs off the event loop, in a bounded thread pool.

The handler awaits the model call in a pool of WORKER_THREADS threads, so the event
loop keeps accepting connections and answering ``/health`` while the model works.
ONNX Runtime releases the GIL during the call, and ONNX_INTRA_THREADS decides how many
cores one call uses: the two settings multiply, and by default the calls share the cores
out (stage 2's thread sweep, docs/lab/stage2.md, measures the layouts).

Every request still makes its own model call. ``stage3_batching`` groups them.

    make stage2   # uvicorn stage2_threadpool.app:app on 127.0.0.1:8000
"""

from __future__ import annotations

from common.api import create_app
from stage2_threadpool.backend import make_backend

app = create_app(
    "stage2_threadpool", make_backend, description=__doc__ or "", calls_at_once=lambda s: s.worker_threads
)
