"""Stage 4 exercise, part 2 of 3: write ``SingleFlight.join``, ``resolve`` and ``fail`` (single-flight).

Fifty requests for the same new text arrive together: all fifty miss the cache. Without help,
the model computes the text fifty times. With single-flight, the first caller to miss a key
*leads*: it computes the value and publishes it; the callers that miss the same key while that
computation runs *follow*: they await the leader's future instead of queueing the text again.
Chapter: docs/stage4.md#the-idea (single-flight) and docs/stage4.md#the-code; the lab notes:
docs/lab/stage4.md#single-flight-the-edge-cases. (Go's
``golang.org/x/sync/singleflight`` is the classic; this is its asyncio shape.)

Your class extends the stage's ``SingleFlight`` (``stage4_cache_backpressure/singleflight.py``),
which gives ``__init__`` (``self._flights``), ``len`` and ``leading``: the backend computes inside
it, and whatever stops the leader early hands an error to the followers through your ``fail``, so
no follower waits forever. Write ``join``, ``resolve`` and ``fail``. The backend
(``stage4_cache_backpressure/backend.py``, ``_embed`` and ``_follow``) shows how the three are used.

Check your work (stage 4's backend built with your three pieces; the section "single-flight"
of ``tests/test_stage4_backend.py`` is the one about this part):

    make exercise STAGE=4

``make exercise STAGE=4 SOLUTION=1`` runs the same tests against ``stage4_cache_backpressure/``,
one solution.

Hints:
- One ``asyncio.Future`` per key in flight, in ``self._flights``; the leader gets None from
  ``join``, a follower gets the future (``asyncio.get_running_loop().create_future()``).
- A key leaves ``self._flights`` when it is resolved or failed: the next miss leads again.
- Set a future's result or exception only if it is not done yet.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TypeVar

from stage4_cache_backpressure import singleflight as stage
from stage4_cache_backpressure.singleflight import LeaderGone  # the backend retries on this one

T = TypeVar("T")

__all__ = ["LeaderGone", "SingleFlight"]


class SingleFlight(stage.SingleFlight[T]):
    def join(self, key: str) -> asyncio.Future[T] | None:
        """None: the caller leads (and must ``resolve`` or ``fail``). A future: the caller follows.

        TODO: a key in flight: return its future. Otherwise the caller leads: put a new future
        in flight for the key, and return None.
        """
        raise NotImplementedError(_todo("join: lead (None) or follow (the future in flight)"))

    def resolve(self, key: str, value: T) -> None:
        """The leader's value: every follower of ``key`` gets it, and the key is no longer in flight.

        TODO
        """
        raise NotImplementedError(_todo("resolve: hand the value to the followers, end the flight"))

    def fail(self, keys: Iterable[str], exc: BaseException) -> None:
        """Hand ``exc`` to the followers of every key still in flight, and end those flights.

        TODO. After ``set_exception``, call ``flight.exception()``: a flight nobody followed
        would otherwise log "Future exception was never retrieved".
        """
        raise NotImplementedError(_todo("fail: hand the error to the followers, end the flights"))


def _todo(what: str) -> str:
    return f"TODO (exercises/stage4_cache_backpressure/singleflight.py): write SingleFlight.{what}"
