"""Exercise for stage 4, part 1 of 3: the in-process LRU, bounded in entries and in bytes, with a TTL.

A cache in front of the batcher answers a repeated text without the model. This is its first
tier, a dict in the server's memory: it must not grow without bound (MAX entries and MAX bytes,
evicting the least recently used first) and must not serve an entry older than its TTL.
Chapter: docs/stage4.md, "The in-process tier: an LRU with two bounds and a TTL".

Write ``get``, ``put`` and ``_drop``; the key, the entry's encoding and the Redis tier are
given (``stage4_cache_backpressure/cache.py`` uses this class's interface for its memory tier).
The other two parts: ``singleflight.py`` and ``admission.py`` beside this file.

Check your work (stage 4's own tests of the LRU, then stage 4's backend built with your three
pieces: the cache, single-flight and the bounded queue):

    make exercise STAGE=4

``make exercise STAGE=4 SOLUTION=1`` runs the same tests against ``stage4_cache_backpressure/``,
one solution.

Hints:
- ``collections.OrderedDict`` keeps insertion order and has ``move_to_end(key)`` and
  ``popitem(last=False)`` / ``next(iter(d))``: the least recently used entry is the first one.
- Count an entry's size with ``_size(key, value)``, so ``self.bytes`` stays exact when entries
  are replaced, evicted or expired.
- Read the time with ``self._clock()``, never ``time.monotonic()``: the TTL test moves the clock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from stage4_cache_backpressure.cache import ENTRY_OVERHEAD_BYTES
from stage4_cache_backpressure.stats import CacheStats


class MemoryCache:
    """An LRU of float32 bytes, bounded in entries and in bytes, each entry with a TTL."""

    def __init__(
        self,
        max_items: int,
        max_bytes: int,
        ttl_s: float,
        stats: CacheStats,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_items, self.max_bytes, self.ttl_s = max_items, max_bytes, ttl_s
        self.stats, self._clock = stats, clock
        self._data: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # key -> (expires, value)
        self.bytes = 0  # _size of every entry held

    @property
    def enabled(self) -> bool:
        return self.max_items > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: str) -> bytes | None:
        """The value, or None when absent or expired.

        TODO: an expired entry (its expiry time ``<=`` now) is dropped and counted in
        ``self.stats.expirations``; a hit becomes the most recently used entry.
        """
        raise NotImplementedError("TODO: look the key up, expire it or mark it recently used")

    def put(self, key: str, value: bytes) -> None:
        """Store the value for ``ttl_s`` seconds, evicting the least recently used beyond the bounds.

        TODO: nothing is stored when the cache is disabled or the entry alone is bigger than
        ``max_bytes``. An entry already under the key is replaced. Then, while there are more than
        ``max_items`` entries or more than ``max_bytes`` bytes, drop the least recently used one
        and count it in ``self.stats.evictions``.
        """
        raise NotImplementedError("TODO: store the entry, then evict to the bounds")

    def _drop(self, key: str) -> None:
        """Remove the entry and take its size off ``self.bytes``.

        TODO
        """
        raise NotImplementedError("TODO: remove the entry and its bytes")


def _size(key: str, value: bytes) -> int:
    """Given: what one entry counts against MAX bytes (key, value and the bookkeeping around them)."""
    return len(key) + len(value) + ENTRY_OVERHEAD_BYTES
