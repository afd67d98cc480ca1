"""Stage 4 exercise, part 1 of 3: write ``MemoryCache.get``, ``put`` and ``_drop``: an LRU with a TTL.

A cache in front of the batcher answers a repeated text without the model. This is its first
tier, a dict in the server's memory: it must not grow without bound (MAX entries and MAX bytes,
evicting the least recently used first) and must not serve an entry older than its TTL.
Chapter: docs/stage4.md#the-idea (the cache); the lab notes: docs/lab/stage4.md#the-memory-tier.

Your class extends the stage's ``MemoryCache`` (``stage4_cache_backpressure/cache.py``), which
gives the rest: ``__init__`` (the bounds, ``self._data``, an ``OrderedDict`` of key ->
(expires, value), and ``self.bytes``), ``enabled`` and ``len``. The key, the entry's encoding and
the Redis tier are the stage's too. The other two parts: ``singleflight.py`` and ``admission.py``
beside this file.

Check your work (stage 4's own tests of the LRU, then stage 4's backend built with your three
pieces: the cache, single-flight and the bounded queue):

    make exercise STAGE=4

``make exercise STAGE=4 SOLUTION=1`` runs the same tests against ``stage4_cache_backpressure/``,
one solution.

Hints:
- ``collections.OrderedDict`` keeps insertion order and has ``move_to_end(key)`` and
  ``popitem(last=False)`` / ``next(iter(d))``: the least recently used entry is the first one.
- Count an entry's size with ``entry_size(key, value)``, so ``self.bytes`` stays exact when entries
  are replaced, evicted or expired.
- Read the time with ``self._clock()``, never ``time.monotonic()``: the TTL test moves the clock.
"""

from __future__ import annotations

from stage4_cache_backpressure import cache as stage
from stage4_cache_backpressure.cache import entry_size  # noqa: F401 (given: an entry's bytes)


class MemoryCache(stage.MemoryCache):
    """An LRU of float32 bytes, bounded in entries and in bytes, each entry with a TTL."""

    def get(self, key: str) -> bytes | None:
        """The value, or None when absent or expired.

        TODO: an expired entry (its expiry time ``<=`` now) is dropped and counted in
        ``self.stats.expirations``; a hit becomes the most recently used entry.
        """
        raise NotImplementedError(_todo("get: look the key up, expire it or mark it recently used"))

    def put(self, key: str, value: bytes) -> None:
        """Store the value for ``ttl_s`` seconds, evicting the least recently used beyond the bounds.

        TODO: nothing is stored when the cache is disabled or the entry alone is bigger than
        ``max_bytes``. An entry already under the key is replaced. Then, while there are more than
        ``max_items`` entries or more than ``max_bytes`` bytes, drop the least recently used one
        and count it in ``self.stats.evictions``.
        """
        raise NotImplementedError(_todo("put: store the entry, then evict to the bounds"))

    def _drop(self, key: str) -> None:
        """Remove the entry and take its size off ``self.bytes``.

        TODO
        """
        raise NotImplementedError(_todo("_drop: remove the entry and its bytes"))


def _todo(what: str) -> str:
    return f"TODO (exercises/stage4_cache_backpressure/cache.py): write MemoryCache.{what}"
