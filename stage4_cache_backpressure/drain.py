"""Graceful drain: on SIGTERM, readiness goes 503 while the server still serves, then uvicorn stops.

The sequence (``docs/stage4.md``): the backend's ``begin_drain`` turns readiness off; for
DRAIN_DELAY_S the server goes on answering everything, readiness included (503), so a load
balancer that probes every few seconds sees the 503 and stops sending; then uvicorn's handler
stops accepting connections and waits for the requests in progress (at most DRAIN_TIMEOUT_S,
passed by ``common.serve`` as ``timeout_graceful_shutdown``); then the lifespan closes the
backend: the batcher answers what is queued, the Redis pool closes. Ctrl-C (SIGINT) and a
second SIGTERM skip the delay: a person at the terminal, or an orchestrator that means now.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any


# --8<-- [start:signals]
def chain_signal_handlers(on_signal: Callable[[], None], delay_s: float = 0.0) -> None:
    """Run ``on_signal`` first on SIGTERM/SIGINT, then, ``delay_s`` later, the handler already
    installed (uvicorn's, which stops accepting and finishes what is in flight).

    Called from the lifespan, where uvicorn has installed its handlers; replacing them would
    stop uvicorn from shutting down at all, so ours runs first and hands over.
    """
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread (tests, embedded servers)
    loop = asyncio.get_running_loop()
    delayed = False

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
            nonlocal delayed
            on_signal()
            if not callable(previous):
                return
            if signum == signal.SIGTERM and delay_s > 0 and not delayed:
                delayed = True  # keep serving; uvicorn's shutdown starts when the delay is over
                loop.call_soon_threadsafe(loop.call_later, delay_s, previous, signum, frame)
            else:
                previous(signum, frame)

        signal.signal(sig, handler)


# --8<-- [end:signals]
