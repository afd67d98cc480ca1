"""Graceful drain: on SIGTERM, readiness goes 503 before uvicorn starts its own shutdown.

The sequence (``docs/stage4.md``): the backend's ``begin_drain`` turns readiness off; then
uvicorn's handler stops accepting connections and waits for the requests in progress (at most
DRAIN_TIMEOUT_S, passed by ``common.serve`` as ``timeout_graceful_shutdown``); then the
lifespan closes the backend: the batcher answers what is queued, the Redis pool closes.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any


# --8<-- [start:signals]
def chain_signal_handlers(on_signal: Callable[[], None]) -> None:
    """Run ``on_signal`` first on SIGTERM/SIGINT, then the handler already installed (uvicorn's).

    Called from the lifespan, where uvicorn has installed its handlers; replacing them would
    stop uvicorn from shutting down at all, so ours runs first and hands over.
    """
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread (tests, embedded servers)
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
            on_signal()
            if callable(previous):
                previous(signum, frame)

        signal.signal(sig, handler)


# --8<-- [end:signals]
