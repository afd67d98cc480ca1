"""A client that hangs up stops its request's work: its queued texts never reach the model.

The body has been read by the time the backend runs, so the only message left on the ASGI
``receive`` channel is ``http.disconnect``. The work races against it; whichever ends first
decides, and cancelling the work skips its texts in the batcher's queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request

from common.limits import APIError

T = TypeVar("T")


# --8<-- [start:disconnect]
async def unless_client_leaves(work: Coroutine[Any, Any, T], request: Request) -> T:
    """Run ``work`` unless the client hangs up first: then cancel it and raise a 499.

    The work runs in the caller's own task; one small task listens for the disconnect and, if
    it comes first, cancels the caller's task (an ``asyncio.wait`` over two new tasks costs
    about twice as much per request, on every request, for an event that is rare).
    """
    me = asyncio.current_task()
    assert me is not None
    watching = True

    def hang_up(gone: asyncio.Future[None]) -> None:
        if watching and not gone.cancelled():
            me.cancel()  # its queued texts are skipped by the batcher

    gone = asyncio.ensure_future(_client_gone(request))
    gone.add_done_callback(hang_up)
    try:
        return await work
    except asyncio.CancelledError:
        if not (gone.done() and not gone.cancelled()):
            raise  # cancelled for another reason (shutdown): not ours to swallow
        me.uncancel()
        raise APIError(499, "client closed the request") from None  # nobody reads this answer
    finally:
        watching = False
        gone.cancel()


async def _client_gone(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# --8<-- [end:disconnect]
