"""Stage 1: the naive server. The model is called straight from the ``async def`` handler
(``backend.py``).

It is correct, and it is the most common first attempt. It also blocks the event loop:
while the model runs, this process cannot accept a connection, answer ``/health`` or even
read the next request. ``stage2_threadpool`` fixes this.

    make stage1   # uvicorn stage1_naive.app:app on 127.0.0.1:8000
"""

from __future__ import annotations

from common.api import create_app
from stage1_naive.backend import make_backend

app = create_app("stage1_naive", make_backend, description=__doc__ or "")
