"""A client that hangs up stops its request's work: its queued texts never reach the model.

The body has been read by the time the backend runs, so the only message left on the ASGI
``receive`` channel is ``http.disconnect``. One task waits for it while the request awaits the
batcher's future; when it comes first, it cancels that future, which skips the request's texts
in the batcher's queue. (Racing the work against it in two tasks, with ``asyncio.wait``, was
most of what stage 4 added to a request's CPU on the event loop.)
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from starlette.types import Receive

from common.limits import ClientGone

T = TypeVar("T")


# --8<-- [start:disconnect]
async def unless_client_leaves(pending: asyncio.Future[T], receive: Receive) -> T:
    """Await ``pending`` unless the client hangs up first: then cancel it and raise a 499."""
    gone = asyncio.create_task(_client_gone(receive))
    gone.add_done_callback(lambda _: pending.cancel())  # a no-op once it is done; else its texts are skipped
    try:
        return await pending  # its answer, or the error it raised
    except asyncio.CancelledError:
        if gone.done() and not gone.cancelled():  # the client left (not this request's own cancellation)
            raise ClientGone() from None  # nobody reads this answer
        raise
    finally:  # also when this request is cancelled itself (shutdown): the watcher does not outlive it
        gone.cancel()


async def _client_gone(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# --8<-- [end:disconnect]
