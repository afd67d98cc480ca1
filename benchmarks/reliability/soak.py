"""The soak: stage 5 with its Redis tier, at about 70% of its measured capacity, for a long time.

    make soak                                     # 10 minutes of soak (about 11 in all)
    python -m benchmarks.reliability.soak --quick # 60 s of soak at 50% (about 90 s in all)
    python -m benchmarks.reliability.soak --record   # docs/results/soak.*, docs/img/soak.png

Steps: start a private redis-server and stage 5 with CACHE_URL pointing at it; measure
capacity (closed loop, 16 clients, the same traffic; the lowest of three 4-second windows,
because on a shared machine a neighbour's job can halve it for a while); then send requests *open loop*
(``loadtests.httpload.OpenLoop``: a fixed arrival rate, whatever the answers do) at 70% of it for
``--duration`` seconds,
sampling latency percentiles, errors, the server's RSS and the cache hit share every
interval. The traffic is half texts from a hot set (cache hits, memory or Redis tier)
and half texts never seen before (model calls and Redis writes).

The in-process cache is kept small (CACHE_MAX_ITEMS=200, half the hot set) so it reaches
its bound during warm-up and hot texts keep coming from the Redis tier: after warm-up the
process holds steady state, and any growth is a leak.

Pass: no errors; p99 stable (median p99 of the last third of the run at most twice that of
the first third after warm-up); RSS growth after warm-up under 10%; the client kept the
arrival rate (a soak that sent less than it meant to proves nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import orjson
import psutil
from prometheus_client.parser import text_string_to_metric_families

from common import corpus
from loadtests import evidence
from loadtests.httpload import Answer, OpenLoop, closed_loop, post_requests
from loadtests.procs import redis_server, running_stage
from loadtests.tables import page, table

STAGE = "stage5_metrics"
LOAD_FACTOR = 0.7
HOT_SET = 400
MAX_IN_FLIGHT = 256  # past this the server is not keeping up: counted as errors, not queued forever
RSS_GROWTH_LIMIT = 0.10
P99_RATIO_LIMIT = 2.0


class _Traffic:
    """Half hot texts, half never-seen texts; one to three texts a request."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.hot = corpus.texts(HOT_SET, seed=seed, kind="sentence")
        self.fresh = corpus.stream(seed=seed + 1, kind="mixed")

    def body(self) -> dict[str, Any]:
        n = self.rng.randint(1, 3)
        texts = [self.rng.choice(self.hot) if self.rng.random() < 0.5 else next(self.fresh) for _ in range(n)]
        return {"inputs": texts}


@dataclass
class Interval:
    t: float  # seconds since the soak began (end of the interval)
    requests: int
    errors: int
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    rss_mib: float
    cache_hit_share: float | None
    in_flight: int  # requests sent and not yet answered at the end of the interval
    sent: int = 0  # requests due in this interval (the arrival schedule)
    # Both share the machine's cores: a client that needs more CPU slows the server it measures.
    server_cpu_pct: float = 0.0
    client_cpu_pct: float = 0.0
    # Who else had the cores (percent of one core, like the two above): Redis, everything else on
    # the machine (busy time not spent by server, client or Redis), and time the hypervisor
    # gave to other machines (steal). A stall with "others" high is a neighbour's, not the server's.
    redis_cpu_pct: float = 0.0
    others_cpu_pct: float = 0.0
    steal_pct: float = 0.0
    # The server's own view, scraped from /metrics at the end of the interval.
    queue_depth: float | None = None
    redis_errors: float | None = None  # cumulative, every kind


@dataclass
class SoakResult:
    duration_s: float
    interval_s: float
    warmup_s: float
    capacity_rps: float
    target_rps: float
    capacity_windows_rps: list[float] = field(default_factory=list)
    sent: int = 0
    answered: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    intervals: list[Interval] = field(default_factory=list)
    verdict: dict[str, Any] = field(default_factory=dict)
    load_average: dict[str, list[float]] = field(default_factory=dict)  # the machine is shared

    @property
    def passed(self) -> bool:
        return bool(self.verdict.get("passed"))


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if values else None


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


async def largest_batches(url: str, requests: int = 4, texts: int = 16) -> None:
    """Make the server form its largest batches once (full rows of the longest texts).

    ONNX Runtime's memory arena grows to the largest batch shape it has run and keeps it, so
    the first full-size batch is a one-time step in RSS (a 10-minute run showed one minutes
    in). Warm-up is for one-time costs: this puts that step before the baseline, so what the
    soak measures after warm-up is growth, not the arena finding its size.
    """
    rng = random.Random(3)
    bodies = [
        orjson.dumps(
            {"inputs": [corpus.passage(rng, sentences=(16, 24)) for _ in range(texts)], "cache": False}
        )
        for _ in range(requests)
    ]
    answers = await closed_loop(*_host_port(url), post_requests("/v1/embed", bodies), requests, timeout=120)
    assert all(a.status == 200 for a in answers), [(a.status, a.error) for a in answers]


async def measure_capacity(
    url: str, seconds: float, workers: int = 16, seed: int = 1, windows: int = 3
) -> list[float]:
    """Requests per second of this traffic, closed loop, in ``windows`` consecutive windows
    (after one second of warm-up)."""
    traffic = _Traffic(seed)
    requests = post_requests("/v1/embed", [orjson.dumps(traffic.body()) for _ in range(20_000)])
    width = seconds / windows
    done = [0] * windows
    counting_from = time.monotonic() + 1.0

    def count(answer: Answer) -> None:
        if answer.status != 200:
            raise RuntimeError(f"capacity run: status {answer.status} {answer.error or ''}")
        window = int((answer.started + answer.ms / 1e3 - counting_from) // width)
        if 0 <= window < windows:
            done[window] += 1

    await closed_loop(*_host_port(url), requests, workers, seconds=seconds + 1.0, record=count)
    return [n / width for n in done]


class _Machine:
    """CPU shares per interval: the server, the client, Redis, everyone else, and steal."""

    def __init__(self, server_pid: int, redis_pid: int | None) -> None:
        self.server, self.client = psutil.Process(server_pid), psutil.Process()
        self.redis = psutil.Process(redis_pid) if redis_pid else None
        self.cores = psutil.cpu_count() or 1
        self.sample()  # start every counter

    def sample(self) -> dict[str, float]:
        server, client = self.server.cpu_percent(), self.client.cpu_percent()
        redis = self.redis.cpu_percent() if self.redis is not None else 0.0
        times = psutil.cpu_times_percent()
        steal = getattr(times, "steal", 0.0)
        busy = (100.0 - times.idle - getattr(times, "iowait", 0.0) - steal) * self.cores
        return {
            "server_cpu_pct": server,
            "client_cpu_pct": client,
            "redis_cpu_pct": redis,
            "others_cpu_pct": round(max(busy - server - client - redis, 0.0), 1),
            "steal_pct": round(steal * self.cores, 1),
        }


async def _server_view(client: httpx.AsyncClient) -> dict[str, float | None]:
    """Queue depth and Redis errors from the server's /metrics (None if it did not answer)."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return {"queue_depth": None, "redis_errors": None}
    depth, errors = None, 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "embedserve_queue_depth_texts":
            depth = family.samples[0].value
        elif family.name == "embedserve_cache_errors":
            errors += sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    return {"queue_depth": depth, "redis_errors": errors}


@dataclass
class _Tally:
    """What the answers of the current interval said."""

    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    hits: int = 0
    misses: int = 0


async def soak(url: str, pid: int, result: SoakResult, seed: int = 7, redis_pid: int | None = None) -> None:
    """Open loop at ``result.target_rps`` for ``result.duration_s``, one ``Interval`` per interval."""
    traffic = _Traffic(seed)
    machine = _Machine(pid, redis_pid)
    tally = _Tally()

    def record(answer: Answer) -> None:
        if answer.status == 200:
            tally.latencies.append(answer.ms)
            tally.hits += int(answer.headers.get("x-cache-hits", 0))
            tally.misses += int(answer.headers.get("x-cache-misses", 0))
            result.answered += 1
            return
        tally.errors += 1
        kind = answer.error or str(answer.status)
        result.error_kinds[kind] = result.error_kinds.get(kind, 0) + 1

    # The load goes through raw keep-alive connections (``OpenLoop``), one per request in flight:
    # an open-loop client must stay cheap when the server falls behind, or it becomes the
    # bottleneck. A 10-minute run with httpx here showed exactly that: after a hiccup, 250
    # requests in flight cost the client 90% of a core, the server's CPU fell to 60% with its
    # queue empty, and the run never recovered.
    loop = OpenLoop(*_host_port(url), max_in_flight=MAX_IN_FLIGHT)
    ramp_s = result.warmup_s / 2

    def rate(t: float) -> float:
        # Ramp from 10% to the full rate over the first half of the warm-up: a cold cache
        # and a client opening its connections at full rate would start the run behind.
        return result.target_rps * (min(1.0, 0.1 + 0.9 * t / ramp_s) if ramp_s > 0 else 1.0)

    async def sample(metrics_client: httpx.AsyncClient) -> None:
        sent_before, k = 0, 1
        while k * result.interval_s <= result.duration_s:
            await asyncio.sleep(max(0.0, loop.began + k * result.interval_s - time.monotonic()))
            current, errors, hits, misses = tally.latencies, tally.errors, tally.hits, tally.misses
            tally.latencies, tally.errors, tally.hits, tally.misses = [], 0, 0, 0
            result.errors += errors
            result.intervals.append(
                Interval(
                    t=round(k * result.interval_s, 1),
                    requests=len(current) + errors,
                    sent=loop.sent - sent_before,
                    errors=errors,
                    p50_ms=_pct(current, 50),
                    p95_ms=_pct(current, 95),
                    p99_ms=_pct(current, 99),
                    rss_mib=round(machine.server.memory_info().rss / 2**20, 1),
                    cache_hit_share=round(hits / (hits + misses), 3) if hits + misses else None,
                    in_flight=loop.in_flight,
                    **machine.sample(),
                    **await _server_view(metrics_client),
                )
            )
            sent_before, k = loop.sent, k + 1

    # /metrics on a client of its own: never waiting behind the load for a connection.
    async with httpx.AsyncClient(base_url=url, timeout=2) as metrics_client:
        sampler = asyncio.create_task(sample(metrics_client))
        await loop.run("/v1/embed", lambda: orjson.dumps(traffic.body()), rate, result.duration_s, record)
        await sampler
    result.sent = loop.sent
    result.errors += tally.errors  # answers that arrived after the last interval


def judge(result: SoakResult) -> dict[str, Any]:
    """The pass criteria, with the numbers they were computed from."""
    steady = [iv for iv in result.intervals if iv.t > result.warmup_s]
    third = max(len(steady) // 3, 1)
    first, last = steady[:third], steady[-third:]
    p99_first = statistics.median(iv.p99_ms for iv in first if iv.p99_ms is not None)
    p99_last = statistics.median(iv.p99_ms for iv in last if iv.p99_ms is not None)
    rss_start = steady[0].rss_mib
    rss_end = statistics.median(iv.rss_mib for iv in last)
    rss_growth = rss_end / rss_start - 1
    # After the warm-up (and its ramp) the client must have sent at the target rate.
    achieved = sum(iv.sent for iv in steady) / (len(steady) * result.interval_s)
    checks = {
        "no_errors": result.errors == 0,
        "p99_stable": p99_last <= P99_RATIO_LIMIT * p99_first,
        "rss_growth_under_10pct": rss_growth < RSS_GROWTH_LIMIT,
        "rate_kept": achieved >= 0.9 * result.target_rps,
    }
    return {
        **checks,
        "passed": all(checks.values()),
        "p99_first_third_ms": round(p99_first, 2),
        "p99_last_third_ms": round(p99_last, 2),
        "rss_after_warmup_mib": rss_start,
        "rss_end_mib": round(rss_end, 1),
        "rss_growth": round(rss_growth, 4),
        "achieved_rps": round(achieved, 2),
    }


def run(
    duration_s: float,
    log_dir: Path,
    interval_s: float | None = None,
    capacity_s: float = 12.0,
    load_factor: float = LOAD_FACTOR,
) -> SoakResult:
    """Redis, stage 5, capacity, soak, verdict."""
    interval_s = interval_s or max(duration_s / 60, 2.0)
    with redis_server() as redis:
        env = {"CACHE_URL": redis.url, "CACHE_MAX_ITEMS": "200", "LOG_LEVEL": "WARNING"}
        with running_stage(STAGE, log_dir, env) as server:
            # The machine is shared: what the server manages in its worst window is what it can
            # be asked to hold for ten minutes, so capacity is the lowest of three windows.
            asyncio.run(largest_batches(server.url))
            capacity_windows = asyncio.run(measure_capacity(server.url, capacity_s))
            capacity = min(capacity_windows)
            result = SoakResult(
                duration_s=duration_s,
                interval_s=interval_s,
                warmup_s=max(duration_s / 5, 2 * interval_s),
                capacity_rps=round(capacity, 2),
                target_rps=round(load_factor * capacity, 2),
                capacity_windows_rps=[round(c, 2) for c in capacity_windows],
            )
            result.load_average["before"] = [round(x, 2) for x in os.getloadavg()]
            redis_pid = redis.process.pid if redis.process is not None else None
            asyncio.run(soak(server.url, server.pid, result, redis_pid=redis_pid))
            result.load_average["after"] = [round(x, 2) for x in os.getloadavg()]
    result.verdict = judge(result)
    return result


def payload(result: SoakResult, stamp: dict[str, Any]) -> dict[str, Any]:
    """What the JSON holds: the stamp, the stage, and every figure of the run."""
    return {"stamp": stamp, "stage": STAGE, **asdict(result)}


# --- what a run leaves behind: its JSON, the tables the docs include, the plot ----------


def plot(payload: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    intervals, interval_s = payload["intervals"], payload["interval_s"]
    t = [iv["t"] for iv in intervals]
    fig, (lat, rss, rate, cpu) = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    for key, style in (("p50_ms", "-"), ("p95_ms", "--"), ("p99_ms", ":")):
        lat.plot(t, [iv[key] for iv in intervals], style, label=key.removesuffix("_ms"))
    lat.set_ylabel("latency (ms)")
    lat.legend(loc="upper right")
    rss.plot(t, [iv["rss_mib"] for iv in intervals], color="tab:purple")
    rss.set_ylabel("server RSS (MiB)")
    rate.plot(t, [iv["requests"] / interval_s for iv in intervals], label="answered / s")
    rate.plot(t, [iv["errors"] for iv in intervals], color="tab:red", label="errors")
    rate.set_ylabel("requests")
    rate.legend(loc="upper right")
    # Who had the cores: a stall with "other processes" up is a neighbour's, not the server's.
    for key, label in (
        ("server_cpu_pct", "server"),
        ("client_cpu_pct", "load client"),
        ("redis_cpu_pct", "Redis"),
        ("others_cpu_pct", "other processes"),
        ("steal_pct", "steal"),
    ):
        cpu.plot(t, [iv.get(key, 0.0) for iv in intervals], label=label)
    cpu.set_ylabel("CPU (% of one core)")
    cpu.set_xlabel("seconds")
    cpu.legend(loc="upper right", fontsize="small", ncol=5)
    for ax in (lat, rss, rate, cpu):
        ax.axvspan(0, payload["warmup_s"], color="0.9")
        ax.grid(alpha=0.3)
    verdict = "PASS" if payload["verdict"].get("passed") else "FAIL"
    target, capacity = payload["target_rps"], payload["capacity_rps"]
    fig.suptitle(
        f"stage 5 soak, Redis tier on: {target:.0f} req/s ({target / capacity:.0%} of {capacity:.0f}), "
        f"{payload['duration_s'] / 60:.0f} min, {payload['errors']} errors: {verdict}"
    )
    fig.tight_layout()
    evidence.save_figure(fig, path, payload["stamp"], dpi=100)
    plt.close(fig)
    return path


def write(payload: dict[str, Any], out: Path) -> Path:
    """``out`` (JSON, every interval) and the same name with ``.md`` (the tables the docs include)."""
    evidence.write_json(out, payload, indent=1)
    evidence.write_text(out.with_suffix(".md"), markdown(payload))
    return out


def markdown(payload: dict[str, Any]) -> str:
    """soak.md: the verdict and who had the cores."""
    v, load = payload["verdict"], payload["load_average"]
    note = (
        f"1-minute load average {load['before'][0]} before the soak, {load['after'][0]} after:"
        " the machine is shared."
    )
    windows = ", ".join(f"{c:g}" for c in payload.get("capacity_windows_rps", []))
    yes = {True: "yes", False: "**no**"}
    verdict = table(
        ["duration", "capacity, lowest window (req/s)", "sent at", "requests", "errors",
         "p99, first / last third", "RSS after warm-up → end", "passed"],
        [(f"{payload['duration_s']:g} s", f"{payload['capacity_rps']} ({windows})",
          f"{payload['target_rps']} req/s", payload["sent"], payload["errors"],
          f"{v['p99_first_third_ms']} / {v['p99_last_third_ms']} ms",
          f"{v['rss_after_warmup_mib']} → {v['rss_end_mib']} MiB ({v['rss_growth'] * 100:+.1f}%)",
          yes[v["passed"]])],
    )  # fmt: skip
    return page(payload["stamp"], {"verdict": verdict, "cores": _cores(payload)}, note)


def _cores(payload: dict[str, Any]) -> list[str]:
    """Who had the cores after warm-up (percent of one core), and what the server itself saw:
    its queue and its Redis errors."""
    steady = [iv for iv in payload["intervals"] if iv["t"] > payload["warmup_s"]]

    def med(key: str) -> str:
        values = sorted(iv.get(key) or 0.0 for iv in steady)
        return f"{values[len(values) // 2]:g}"

    def top(key: str) -> str:
        return f"{max((iv.get(key) or 0.0) for iv in steady):g}"

    keys = ("server_cpu_pct", "client_cpu_pct", "redis_cpu_pct", "others_cpu_pct", "steal_pct")
    redis_errors = max((iv.get("redis_errors") or 0.0) for iv in payload["intervals"])
    return table(
        [f"after warm-up, per {payload['interval_s']:g} s", "server CPU", "client CPU", "Redis CPU",
         "other processes", "steal", "server queue (texts)", "Redis errors (whole run)"],
        [("median", *(f"{med(k)}%" for k in keys), med("queue_depth"), f"{redis_errors:g}"),
         ("highest", *(f"{top(k)}%" for k in keys), top("queue_depth"), "")],
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, help="seconds of soak after capacity (600, quick 60)")
    parser.add_argument("--load", type=float, help=f"share of capacity to send ({LOAD_FACTOR}, quick 0.5)")
    parser.add_argument("--out", type=Path, help="folder for soak.json and soak.md")
    parser.add_argument("--img", type=Path, help="folder for soak.png")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    _stop_children_on_sigterm()
    run_ = evidence.start("benchmarks.reliability.soak", args, argv)
    # QUICK: one minute at 50%, as tests/test_soak.py runs it (70% overloads a shared 2-core machine).
    duration = args.duration or (60.0 if args.quick else 600.0)
    load = args.load or (0.5 if args.quick else LOAD_FACTOR)
    result = run(duration, run_.logs("soak"), interval_s=2.0 if args.quick else None, load_factor=load)
    saved = payload(result, run_.stamp({"CACHE_MAX_ITEMS": "200", "LOG_LEVEL": "WARNING"}))
    out, img = args.out or run_.results_dir, args.img or run_.img_dir
    written = write(saved, out / "soak.json"), plot(saved, img / "soak.png")
    print(markdown(saved))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0 if result.passed else 1


def _stop_children_on_sigterm() -> None:
    # SIGTERM's default kills this process without unwinding, orphaning the servers it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


if __name__ == "__main__":
    sys.exit(main())
