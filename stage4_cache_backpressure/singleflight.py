"""In-flight de-duplication ("single-flight"): one computation per key at a time.

The first caller to miss the cache for a key *leads*: it computes the value and
publishes it. Callers that miss while that computation is queued or running *follow*:
they wait for the leader's result instead of queueing the same text again. (Go's
``golang.org/x/sync/singleflight`` is the classic; this is its asyncio shape.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class LeaderGone(Exception):
    """The leader gave up (its client left or its own deadline passed): followers retry."""


# --8<-- [start:singleflight]
class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._flights: dict[str, asyncio.Future[T]] = {}

    def __len__(self) -> int:
        return len(self._flights)

    def join(self, key: str) -> asyncio.Future[T] | None:
        """None: the caller leads (and must ``resolve`` or ``fail``). A future: the caller follows."""
        flight = self._flights.get(key)
        if flight is not None:
            return flight
        self._flights[key] = asyncio.get_running_loop().create_future()
        return None

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
