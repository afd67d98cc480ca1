"""A windowed view of the registry: its values every second, kept for five minutes.

Prometheus keeps cumulative counters and leaves "per minute" to the server that scrapes it
(``rate()``, ``histogram_quantile()``). ``/v1/metrics`` and the dashboard have no such server,
so this module does the same on a small scale: once a second it reads the registry's
``embedserve_*`` values into a ``Snapshot`` (a few dozen numbers), keeps one a second for the
last minute and one every ``step`` seconds for five minutes. Anything over a span is the
difference of two snapshots (``views.py``). Nothing here runs on the request path.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from stage5_metrics.metrics import EMBED_ROUTES, Metrics
from stage5_metrics.stage_counts import PREFIX

# Of the histograms' buckets, the views need these two; the rest stay for Prometheus.
_BUCKETS = {"request_duration_seconds_bucket": "latency", "batch_size_texts_bucket": "sizes"}


@dataclass(slots=True)
class Snapshot:
    """The registry's cumulative values at one moment, summed over the embedding routes."""

    at: float
    values: dict[str, float] = field(default_factory=dict)  # "texts_total", "cache_hits_total redis", ...
    latency: dict[float, float] = field(default_factory=dict)  # bucket bound (s) -> requests at or below
    sizes: dict[float, float] = field(default_factory=dict)  # bucket bound (texts) -> batches at or below
    depth_max: float = 0.0  # most texts queued at a sample in the step this snapshot closes


# --8<-- [start:read]
def read(metrics: Metrics, at: float) -> Snapshot:
    """One pass over the samples: only the embedding routes count (not the dashboard's own polls)."""
    snap = Snapshot(at)
    values: defaultdict[str, float] = defaultdict(float)
    for family in metrics.own_families():
        for sample in family.samples:
            labels = dict(sample.labels)
            if labels.pop("route", None) not in (None, *EMBED_ROUTES):
                continue
            name = sample.name.removeprefix(PREFIX + "_")
            if name.endswith("_bucket"):
                if name in _BUCKETS:
                    buckets = getattr(snap, _BUCKETS[name])
                    bound = float(labels["le"])
                    buckets[bound] = buckets.get(bound, 0.0) + sample.value
                continue
            values[" ".join((name, *labels.values()))] += sample.value
    snap.values = dict(values)
    return snap


# --8<-- [end:read]


class Window:
    """Samples the registry every second (a task started and stopped with the backend)."""

    def __init__(
        self, metrics: Metrics, step: int = 5, keep_s: int = 300, clock: Callable[[], float] = time.time
    ):
        self.metrics, self.step, self.keep_s, self.clock = metrics, step, keep_s, clock
        self.started = clock()
        self.baseline = Snapshot(self.started)  # every counter is 0 when the app is built
        self.recent: deque[Snapshot] = deque(maxlen=62)  # one a second: the last minute
        self.steps: dict[int, Snapshot] = {}  # one per step boundary crossed: the last keep_s
        self._depth_max = 0.0
        self._task: asyncio.Task[None] | None = None

    def now(self) -> Snapshot:
        """The registry now, with the deepest queue seen in the step under way."""
        snap = read(self.metrics, self.clock())
        snap.depth_max = max(self._depth_max, snap.values.get("queue_depth_texts", 0.0))
        return snap

    def sample(self) -> None:
        snap = self.now()
        last = self.recent[-1].at if self.recent else None
        self.recent.append(snap)
        self._depth_max = snap.depth_max
        boundary = int(snap.at) // self.step * self.step
        if last is not None and boundary > last:  # crossed a boundary since the last sample
            self.steps[boundary] = snap
            self._depth_max = 0.0
            for old in [t for t in self.steps if t < snap.at - self.keep_s - self.step]:
                del self.steps[old]

    def minute_ago(self, now: Snapshot) -> Snapshot:
        """The oldest sample of the last minute (the baseline while the server is younger)."""
        if now.at - self.started <= 60:
            return self.baseline
        return next((snap for snap in self.recent if snap.at >= now.at - 60.5), self.baseline)

    def at(self, t: int) -> Snapshot:
        """The sample taken as boundary ``t`` passed (or the closest one before it)."""
        if t in self.steps:
            return self.steps[t]
        before = [s for s in self.steps if s < t]
        return self.steps[max(before)] if before else self.baseline

    def spans(self, seconds: int) -> list[tuple[int, Snapshot, Snapshot]]:
        """``(t, start, end)`` for each step of the last ``seconds`` since the start.

        The step under way ends now; it is left out while younger than 2 s (unless it is the
        only one), so the charts do not end on a fraction of a second that looks like a drop.
        """
        now = self.now()
        first = max(
            (int(now.at) - seconds) // self.step * self.step + self.step,
            int(self.started) // self.step * self.step,
        )
        last = int(now.at) // self.step * self.step
        spans = [(t, self.at(t), self.at(t + self.step)) for t in range(first, last, self.step)]
        if now.at - last >= 2 or not spans:
            spans.append((last, self.at(last), now))
        return spans

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
