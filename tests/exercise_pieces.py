"""The pieces the tests of stages 0, 3, 4 and 5 check: the stage's own, or with EXERCISE=1 the learner's.

``make exercise STAGE=N`` sets EXERCISE=1 (exercises/README.md). The test modules take the
pieces a learner writes from here instead of importing them from the stage, so the same tests
check ``exercises/``. A learner's class extends the stage's own (stage 0's the engine's, stage 3's
the stage's ``Batcher``, stage 4's and 5's the stage's classes) and writes only the methods left
to write. Each function imports only what it returns, so a half-written exercise never breaks
another's check. (Stages 1 and 2 need none of this: their tests serve ``exercises/stageN_*``.)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np

    from common.engine import Engine
    from stage3_batching.batcher import Batcher
    from stage4_cache_backpressure.backend import CacheBackend
    from stage4_cache_backpressure.cache import MemoryCache
    from stage5_metrics.backend import MetricsBackend

EXERCISE = os.environ.get("EXERCISE") == "1"


def stage0_engine() -> tuple[type[Engine], Callable[[np.ndarray], np.ndarray]]:
    """``common.engine``'s ``Engine`` and ``l2_normalize``, or yours from
    ``exercises/stage0_script/engine.py`` (your mean pooling in ``Engine.run``)."""
    if EXERCISE:
        from exercises.stage0_script.engine import Engine as YourEngine
        from exercises.stage0_script.engine import l2_normalize as your_l2_normalize

        return YourEngine, your_l2_normalize
    from common.engine import Engine, l2_normalize

    return Engine, l2_normalize


def textbook_batcher() -> Callable[..., Batcher]:
    """``stage3_batching.batcher.Batcher``, or yours from ``exercises/stage3_batching/batcher.py``,
    taking its texts with your ``Oldest`` unless a test passes another take."""
    if EXERCISE:
        from exercises.stage3_batching.batcher import Batcher as Yours
        from exercises.stage3_batching.batcher import Oldest as YourOldest

        def yours(run: Any, settings: Any, **policies: Any) -> Batcher:
            policies["order"] = policies.get("order") or YourOldest(settings)
            return Yours(run, settings, **policies)  # type: ignore[no-any-return]

        yours.__name__ = "Batcher"  # the tests' ids name it as they name the stage's
        return yours
    from stage3_batching.batcher import Batcher

    return Batcher


def memory_cache() -> type[MemoryCache]:
    """``stage4_cache_backpressure.cache.MemoryCache``, or yours from ``exercises/``."""
    if EXERCISE:
        from exercises.stage4_cache_backpressure.cache import MemoryCache as Yours

        return Yours  # type: ignore[return-value]
    from stage4_cache_backpressure.cache import MemoryCache

    return MemoryCache


def cache_backend() -> type[CacheBackend]:
    """Stage 4's backend; with EXERCISE=1 the same backend holding your LRU, single-flight and
    admission check from ``exercises/stage4_cache_backpressure/``."""
    from stage4_cache_backpressure.backend import CacheBackend

    if not EXERCISE:
        return CacheBackend
    from exercises.stage4_cache_backpressure.admission import Admission
    from exercises.stage4_cache_backpressure.cache import MemoryCache as YourMemoryCache
    from exercises.stage4_cache_backpressure.singleflight import SingleFlight

    class WithYourPieces(CacheBackend):
        def __init__(self, engine: Any, batcher: Any, settings: Any, **kwargs: Any) -> None:
            super().__init__(engine, batcher, settings, **kwargs)
            s = settings  # each piece built with the arguments the stage builds its own with
            self.cache.memory = YourMemoryCache(
                s.cache_max_items, s.cache_max_bytes, s.cache_ttl_s, self.stats.cache
            )
            self.flights = SingleFlight()
            self.admission = Admission(
                s.max_queue, s.overload_status, lambda: self.batcher.queue_depth, slots=s.batch_concurrency
            )
            batcher.watch(self.admission.observe)

    return WithYourPieces


def metrics_backend() -> type[MetricsBackend]:
    """``stage5_metrics.backend.MetricsBackend``, or yours from ``exercises/stage5_metrics/app.py``."""
    if EXERCISE:
        from exercises.stage5_metrics.app import MetricsBackend as Yours

        return Yours
    from stage5_metrics.backend import MetricsBackend

    return MetricsBackend


def stage5() -> str:
    """The stage 5 app a server test starts: the stage's, or yours (``exercises.stage5_metrics``)."""
    return "exercises.stage5_metrics" if EXERCISE else "stage5_metrics"
