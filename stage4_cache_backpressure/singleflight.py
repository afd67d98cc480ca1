"""In-flight de-duplication ("single-flight"): one computation per key at a time.

The first caller to miss the cache for a key *leads*: it computes the value and
publishes it. Callers that miss while that computation is queued or running *follow*:
they wait for the leader's result instead of queueing the same text again. (Go's
``golang.org/x/sync/singleflight`` is the classic; this is its asyncio shape.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class LeaderGone(Exception):
    """The leader gave up for a reason of its own (its client left, its deadline passed): followers retry."""


# --8<-- [start:singleflight]
class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._flights: dict[str, asyncio.Future[T]] = {}

    def __len__(self) -> int:
        return len(self._flights)

    # --8<-- [start:join]
    def join(self, key: str) -> asyncio.Future[T] | None:
        """None: the caller leads (and must ``resolve`` or ``fail``). A future: the caller follows."""
        flight = self._flights.get(key)
        if flight is not None:
            return flight
        self._flights[key] = asyncio.get_running_loop().create_future()
        return None

    # --8<-- [end:join]

    def resolve(self, key: str, value: T) -> None:
        flight = self._flights.pop(key, None)
        if flight is not None and not flight.done():
            flight.set_result(value)

    def fail(self, keys: Iterable[str], exc: BaseException) -> None:
        """Hand ``exc`` to the followers of every key still in flight."""
        for key in keys:
            flight = self._flights.pop(key, None)
            if flight is not None and not flight.done():
                flight.set_exception(exc)
                flight.exception()  # retrieved: a flight nobody followed must not log an error

    # --8<-- [end:singleflight]

    # --8<-- [start:leading]
    @contextmanager
    def leading(
        self, keys: Iterable[str], handover: Callable[[BaseException], BaseException]
    ) -> Iterator[None]:
        """The block computes the ``keys`` this caller leads (``join`` returned None for each).

        Whatever ends it before it resolved them all, an error or a cancellation, hands
        ``handover(exc)`` to the followers of the rest, so no follower waits forever.
        """
        mine = {key: self._flights[key] for key in keys}
        error: BaseException = LeaderGone()  # the block returned with a key unresolved: a bug, retry
        try:
            yield
        except BaseException as exc:
            error = handover(exc)
            raise
        finally:
            # Only flights still ours: a key resolved earlier may be led by a newer caller now.
            self.fail([key for key, flight in mine.items() if self._flights.get(key) is flight], error)

    # --8<-- [end:leading]
