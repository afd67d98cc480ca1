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
    """Run ``work`` unless the client hangs up first: then cancel it and raise a 499."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()  # its queued texts are skipped by the batcher
    if task in done:
        return task.result()
    raise APIError(499, "client closed the request")  # nobody reads this answer


async def _client_gone(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# --8<-- [end:disconnect]
