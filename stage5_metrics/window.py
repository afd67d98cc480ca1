"""The page's history: a reading of the registry at every step of five seconds, kept five minutes.

Prometheus keeps running totals and leaves "per second" and "p99" to whoever reads two scrapes
(``rate()``, ``histogram_quantile()``). The dashboard has no Prometheus beside it, so this module
keeps what a scraper would keep and nothing more: once a second it reads the registry's
``embedserve_*`` running totals into a ``Reading`` (a few dozen numbers, and the two histograms
the page draws), and keeps the one read as each 5-second step began, for five minutes. The page
(``static/dashboard.js``) computes every rate and percentile from two readings, in the browser,
the way Prometheus does; nothing here runs on the request path.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from stage5_metrics.metrics import EMBED_ROUTES, Metrics
from stage5_metrics.stage_counts import PREFIX

# Of the histograms' buckets, the page needs these two; the rest stay for Prometheus.
_BUCKETS = {"request_duration_seconds_bucket": "latency", "batch_size_texts_bucket": "sizes"}


@dataclass(slots=True)
class Reading:
    """The registry's running totals at one moment, summed over the embedding routes."""

    at: float  # time.time()
    values: dict[str, float] = field(default_factory=dict)  # "texts_total", "cache_hits_total redis", ...
    latency: dict[str, float] = field(default_factory=dict)  # bucket bound ("0.005", "+Inf") -> at or below
    sizes: dict[str, float] = field(default_factory=dict)  # bucket bound (texts) -> batches at or below
    depth_max: float = 0.0  # most texts queued at a sample in the step this reading closes

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --8<-- [start:read]
def read(metrics: Metrics, at: float) -> Reading:
    """One pass over the samples: only the embedding routes count (not the dashboard's own polls)."""
    reading = Reading(at)
    values: defaultdict[str, float] = defaultdict(float)
    for family in metrics.own_families():
        for sample in family.samples:
            labels = dict(sample.labels)
            if labels.pop("route", None) not in (None, *EMBED_ROUTES):
                continue
            name = sample.name.removeprefix(PREFIX + "_")
            if name.endswith("_bucket"):
                if name in _BUCKETS:
                    buckets = getattr(reading, _BUCKETS[name])
                    buckets[labels["le"]] = buckets.get(labels["le"], 0.0) + sample.value
                continue
            values[" ".join((name, *labels.values()))] += sample.value
    reading.values = dict(values)
    return reading


# --8<-- [end:read]


class Window:
    """Reads the registry every second (a task started and stopped with the backend)."""

    def __init__(
        self, metrics: Metrics, step: int = 5, keep_s: int = 300, clock: Callable[[], float] = time.time
    ):
        self.metrics, self.step, self.clock = metrics, step, clock
        self.started = clock()  # every total is 0 when the app is built
        self.readings: deque[Reading] = deque(maxlen=keep_s // step + 1)  # one a step, oldest first
        self._depth_max = 0.0
        self._task: asyncio.Task[None] | None = None

    def now(self) -> Reading:
        """The registry now, with the deepest queue seen in the step under way."""
        reading = read(self.metrics, self.clock())
        reading.depth_max = max(self._depth_max, reading.values.get("queue_depth_texts", 0.0))
        return reading

    def sample(self) -> None:
        reading = self.now()
        self._depth_max = reading.depth_max
        last = self.readings[-1].at if self.readings else self.started
        if int(reading.at) // self.step > int(last) // self.step:  # a step began since the last one
            self.readings.append(reading)
            self._depth_max = 0.0

    # --8<-- [start:sampler]
    async def _run(self) -> None:
        while True:
            await asyncio.sleep(1 - self.clock() % 1)  # on the second, so steps start on a boundary
            self.sample()

    def start(self) -> None:
        self.sample()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="metrics-window")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # --8<-- [end:sampler]
