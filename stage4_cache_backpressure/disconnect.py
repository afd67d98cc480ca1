"""A client that hangs up stops its request's work: its queued texts never reach the model.

The body has been read by the time the backend runs, so the only message left on the ASGI
``receive`` channel is ``http.disconnect``. The work races against it in two plain tasks;
whichever ends first decides, and cancelling the work skips its texts in the batcher's queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.types import Receive

from common.limits import ClientGone

T = TypeVar("T")


# --8<-- [start:disconnect]
async def unless_client_leaves(work: Coroutine[Any, Any, T], receive: Receive) -> T:
    """Run ``work`` unless the client hangs up first: then cancel it and raise a 499."""
    working = asyncio.create_task(work)
    gone = asyncio.create_task(_client_gone(receive))
    try:
        await asyncio.wait({working, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this request is cancelled itself (shutdown): neither task outlives it
        gone.cancel()
        working.cancel()  # a no-op once it is done; else its queued texts are skipped by the batcher
    if working.done() and not working.cancelled():
        return working.result()  # its answer, or the error it raised
    raise ClientGone()  # nobody reads this answer


async def _client_gone(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# --8<-- [end:disconnect]
