"""The soak: stage 5 with its Redis tier at 70% of its measured capacity, open loop, for minutes.

    make soak                          # 3.5 minutes of load, about 4 in all (SOAK_SECONDS=3600: an hour)
    python -m benchmarks.soak --quick  # 60 s at 50% of capacity

A private Redis and stage 5 on it; the largest batches once (ONNX Runtime's arena keeps the largest
shape it has run: a one-time step, before the baseline); capacity by wrk, the lowest of three
4-second runs; then a fixed arrival rate whatever the answers do (open loop), so that a server
falling behind shows it. Half the texts are hot, half new; the memory tier holds half the hot set,
so hot texts keep coming from Redis and growth after the warm-up is a leak. The client is aiohttp,
cheap with hundreds of requests in flight (a client whose cost grows as it falls behind stays
behind). Each interval records who had the cores and the server's queue: a neighbour's job and a
stalled server look different. Pass: no errors; the median interval p99 of the last third at most
twice the first third's after warm-up; RSS growth after warm-up under 10%; the arrival rate kept.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import psutil

from common import corpus
from loadtests import evidence
from loadtests.load import post_bodies, wrk
from loadtests.procs import redis_server, running_stage
from loadtests.tables import page, table

STAGE, ENV = "stage5_metrics", {"CACHE_MAX_ITEMS": "200", "LOG_LEVEL": "WARNING"}
LOAD_FACTOR, MAX_IN_FLIGHT = 0.7, 256
JSON = {"content-type": "application/json"}
CPU = {"server": "server CPU", "client": "client CPU", "others": "other processes (Redis among them)"}


def bodies(seed: int) -> Iterator[bytes]:
    """One to three texts a request, each half the time from a hot set of 400, else never seen."""
    hot, fresh = corpus.texts(400, seed, "sentence"), corpus.stream(seed + 1, "mixed")
    rng = random.Random(seed)
    while True:
        texts = [rng.choice(hot) if rng.random() < 0.5 else next(fresh) for _ in range(rng.randint(1, 3))]
        yield orjson.dumps({"inputs": texts})


def capacity(url: str) -> list[float]:
    """The largest batches once, then requests/s of this traffic in three 4-second runs of wrk."""
    rng, traffic = random.Random(3), bodies(1)
    largest = orjson.dumps({"inputs": [corpus.passage(rng, (16, 24)) for _ in range(16)], "cache": False})
    assert all(a.status == 200 for a in asyncio.run(post_bodies(url, [largest] * 4, 4)))
    runs = [wrk(url, [next(traffic) for _ in range(5000)], 16, seconds) for seconds in (1, 4, 4, 4)][1:]
    assert not any(r["non_2xx_per_s"] or r["socket_errors"] for r in runs), runs
    return [r["requests_per_s"] for r in runs]


def _cores(server: psutil.Process, client: psutil.Process) -> dict[str, float]:
    """Percent of one core since the last call: the server, this client, everything else busy."""
    mine = server.cpu_percent(), client.cpu_percent()
    t = psutil.cpu_times_percent()  # steal: time the hypervisor gave other machines
    busy = (100 - t.idle - getattr(t, "iowait", 0) - getattr(t, "steal", 0)) * (psutil.cpu_count() or 1)
    return {"server": mine[0], "client": mine[1], "others": round(max(busy - sum(mine), 0.0), 1)}


async def soak(url: str, pid: int, result: dict[str, Any]) -> None:
    """Open loop at ``target_rps`` for ``duration_s``, a row of ``intervals`` every ``interval_s``."""
    rate, every, ramp_s = result["target_rps"], result["interval_s"], result["warmup_s"] / 2
    traffic, server, client = bodies(7), psutil.Process(pid), psutil.Process()
    errors, in_flight = Counter[str](), set[asyncio.Task[None]]()  # errors by kind, requests unanswered
    now: dict[str, Any] = {"ms": [], "sent": 0, "errors": 0}  # this interval's answers
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)  # uvicorn closes idle ones at 5 s
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(60)) as session:

        async def one(body: bytes) -> None:
            started, error = time.perf_counter(), ""
            try:
                async with session.post("/v1/embed", data=body, headers=JSON) as r:
                    await r.read()
                    error = "" if r.status == 200 else str(r.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                error = type(exc).__name__
            if error:
                errors[error] += 1
                now["errors"] += 1
            else:
                now["ms"].append((time.perf_counter() - started) * 1e3)

        async def sample(began: float) -> None:
            _cores(server, client)  # start the counters
            for k in range(1, round(result["duration_s"] / every) + 1):
                await asyncio.sleep(began + k * every - time.monotonic())
                ms, sent, failed = now["ms"], now["sent"], now["errors"]
                now.update(ms=[], sent=0, errors=0)
                async with session.get("/v1/cache/metrics") as r:
                    view = await r.json()
                p = np.percentile(ms, (50, 95, 99)).round(2).tolist() if ms else [None] * 3
                result["intervals"].append({
                    "t": round(k * every, 1), "sent": sent, "answered": len(ms), "errors": failed,
                    "p50_ms": p[0], "p95_ms": p[1], "p99_ms": p[2], "in_flight": len(in_flight),
                    "rss_mib": round(server.memory_info().rss / 2**20, 1), **_cores(server, client),
                    "queue_depth": view["queue_depth"], "redis_errors": sum(view["cache"]["errors"].values()),
                })  # fmt: skip

        began = due = time.monotonic()
        sampler = asyncio.create_task(sample(began))
        while not sampler.done():
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            due += 1 / (rate * min(1.0, 0.1 + 0.9 * (due - began) / ramp_s))  # from 10% over the ramp
            if len(in_flight) >= MAX_IN_FLIGHT:  # not keeping up: an error, not a queue in the client
                errors["client_backlog"] += 1
                now["errors"] += 1
                continue
            now["sent"] += 1
            in_flight.add(task := asyncio.create_task(one(next(traffic))))
            task.add_done_callback(in_flight.discard)
        await sampler
        if in_flight:
            await asyncio.wait(in_flight, timeout=60)
    result["errors"], result["error_kinds"] = sum(errors.values()), dict(errors)
    result["sent"] = now["sent"] + sum(iv["sent"] for iv in result["intervals"])  # now: after the last row
    result["answered"] = len(now["ms"]) + sum(iv["answered"] for iv in result["intervals"])


def judge(result: dict[str, Any]) -> dict[str, Any]:
    """The pass criteria, with the numbers they were computed from."""
    steady = [iv for iv in result["intervals"] if iv["t"] > result["warmup_s"]]
    first, last = steady[: max(len(steady) // 3, 1)], steady[-max(len(steady) // 3, 1) :]
    p99 = [statistics.median(iv["p99_ms"] for iv in part if iv["p99_ms"]) for part in (first, last)]
    rss = steady[0]["rss_mib"], statistics.median(iv["rss_mib"] for iv in last)
    achieved = sum(iv["sent"] for iv in steady) / (len(steady) * result["interval_s"])
    checks = {
        "no_errors": result["errors"] == 0,
        "p99_stable": p99[1] <= 2 * p99[0],
        "rss_growth_under_10pct": rss[1] / rss[0] - 1 < 0.10,
        "rate_kept": achieved >= 0.9 * result["target_rps"],
    }
    return {**checks, "passed": all(checks.values()), "achieved_rps": round(achieved, 2),
            "p99_first_third_ms": round(p99[0], 2), "p99_last_third_ms": round(p99[1], 2),
            "rss_after_warmup_mib": rss[0], "rss_end_mib": rss[1],
            "rss_growth": round(rss[1] / rss[0] - 1, 4)}  # fmt: skip


def run(seconds: float, logs: Path, every: float | None = None, load: float = LOAD_FACTOR) -> dict[str, Any]:
    """Redis, stage 5, capacity, the soak (a row every ``every`` s) and its verdict; ``load``: of capacity."""
    every = every or max(seconds / 60, 2.0)
    result: dict[str, Any] = {"stage": STAGE, "duration_s": seconds, "interval_s": every}
    result |= {"load_factor": load, "warmup_s": max(seconds / 5, 2 * every), "intervals": []}
    with redis_server() as redis, running_stage(STAGE, logs, {"CACHE_URL": redis.url, **ENV}) as server:
        result["capacity_runs_rps"] = runs = capacity(server.url)
        result["capacity_rps"], result["target_rps"] = min(runs), round(load * min(runs), 2)
        asyncio.run(soak(server.url, server.pid, result))
    return {**result, "verdict": judge(result)}


def _headline(r: dict[str, Any]) -> str:
    rate = f"{r['target_rps']:g} req/s ({r['load_factor']:.0%} of {r['capacity_rps']:g})"
    verdict = "passed" if r["verdict"]["passed"] else "FAILED"
    return f"{rate} for {r['duration_s']:g} s, {r['errors']} errors: {verdict}"


def plot(result: dict[str, Any], img: Path) -> Path:
    """img/soak.png: latency, RSS, throughput and CPU over the run (``make results --render`` redraws it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ivs, every = result["intervals"], result["interval_s"]
    panels = {
        "latency (ms)": {f"p{q}": [iv[f"p{q}_ms"] for iv in ivs] for q in (50, 95, 99)},
        "server RSS (MiB)": {"RSS": [iv["rss_mib"] for iv in ivs]},
        "per second": {key: [iv[key] / every for iv in ivs] for key in ("answered", "errors")},
        "CPU (% of one core)": {name: [iv[key] for iv in ivs] for key, name in CPU.items()},
    }
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 10), sharex=True)
    for ax, (label, lines) in zip(axes, panels.items(), strict=True):
        for name, values in lines.items():
            ax.plot([iv["t"] for iv in ivs], values, label=name)
        ax.set_ylabel(label)
        ax.legend(loc="upper right", fontsize="small", ncol=3)
        ax.axvspan(0, result["warmup_s"], color="0.9")  # the warm-up
        top = max((v for values in lines.values() for v in values if v is not None), default=0)
        ax.set_ylim(0, top * 1.25 or 1)  # from zero: a rise of a few MiB reads as the small rise it is
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds")
    fig.suptitle(f"stage 5 soak, Redis tier on: {_headline(result)}")
    fig.tight_layout()
    path = evidence.save_figure(fig, img / "soak.png", result["stamp"], dpi=100)
    plt.close(fig)
    return path


def markdown(result: dict[str, Any]) -> str:
    """soak.md: what ran for how long, the verdict, and who had the cores after the warm-up."""
    v, steady = result["verdict"], [iv for iv in result["intervals"] if iv["t"] > result["warmup_s"]]
    length = f"Open loop at {_headline(result)}; {result['stamp']['wall_s'] / 60:.2g} minutes in all."
    runs = ", ".join(f"{c:g}" for c in result["capacity_runs_rps"])
    verdict = table(
        ["capacity, lowest of 3 runs (req/s)", "sent", "errors", "p99, first / last third",
         "RSS after warm-up → end", "passed"],
        [(f"{result['capacity_rps']:g} ({runs})", result["sent"], result["errors"],
          f"{v['p99_first_third_ms']} / {v['p99_last_third_ms']} ms",
          f"{v['rss_after_warmup_mib']} → {v['rss_end_mib']} MiB ({v['rss_growth'] * 100:+.1f}%)",
          "yes" if v["passed"] else "**no**")],
    )  # fmt: skip
    keys, errors = [*CPU, "queue_depth"], result["intervals"][-1]["redis_errors"]
    cores = table(
        [f"after warm-up, per {result['interval_s']:g} s (CPU: % of a core)", *CPU.values(),
         "server queue (texts)", "Redis errors (run)"],
        [("median", *(f"{statistics.median(iv[k] for iv in steady):g}" for k in keys), errors),
         ("highest", *(f"{max(iv[k] for iv in steady):g}" for k in keys), "")],
    )  # fmt: skip
    return page(result["stamp"], {"length": [length], "verdict": verdict, "cores": cores}) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, help="seconds of open-loop load (210, quick 60)")
    parser.add_argument("--load", type=float, help=f"share of capacity to send ({LOAD_FACTOR}, quick 0.5)")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run_ = evidence.start("benchmarks.soak", args, argv)
    # QUICK: one minute at 50%, as tests/test_soak.py runs it (70% overloads a shared 2-core machine).
    load = args.load or (0.5 if args.quick else LOAD_FACTOR)
    result = run(
        args.duration or (60 if args.quick else 210), run_.logs("soak"), 2 if args.quick else None, load
    )
    result["stamp"] = run_.stamp(ENV)
    plot(result, run_.img_dir)
    evidence.publish(run_, "soak", result, markdown)
    return 0 if result["verdict"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
