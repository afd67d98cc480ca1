"""`make results ONLY=stage4`: the stage 4 measurements (stage4.json and stage4.md).

    python -m benchmarks.stage4            # about 3 minutes
    python -m benchmarks.stage4 --quick    # about a minute: fewer requests, one round
    python -m benchmarks.stage4 --record   # written to docs/results/

1. Latency of a cache hit in the memory tier and in the Redis tier, against a miss (same run).
   (A pooled client against one that connects per command, near and far, plain and TLS:
   ``benchmarks.cache_distance``.)
2. The seed's repeated-text workload (100 requests, unique ratio 0.3) on stage 3 and stage 4.
3. The seed's overload run (queue capped at 5, 300 requests of one passage at concurrency 200)
   on stage 4, and the same load on stage 3, which has no bound.
4. A flood: MAX_QUEUE=8 and 200 connections of ``wrk``, one new sentence per request, that wait
   a refusal's Retry-After before they send again (polite clients, Locust's users, the ``openai``
   client's retries) or send again at once (a naive retry loop), for several SHED_DELAY_MS.
   Goodput is the 200s per second as a share of stage 4's capacity (its defaults, 32 connections).

Parts 1 to 3 need each answer's headers and status: their client is httpx; part 4's is wrk.

Uses the Redis at 127.0.0.1:6379 when it answers, else starts a private ``redis-server``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import psutil

from benchmarks.stage3 import bodies_for
from common import corpus
from loadtests import evidence, load
from loadtests.load import Answer, post_bodies, process_cpu, settle
from loadtests.procs import StageProcess, any_redis, running_stage
from loadtests.tables import num, page, table

S3, S4 = "stage3_batching", "stage4_cache_backpressure"
LOGS = evidence.OUT / "logs" / "stage4"  # git-ignored server logs


def _ms(values: list[float]) -> dict[str, float]:
    """p50/p99/mean of seconds, in ms."""
    if not values:
        return {"n": 0}
    a = np.asarray(values) * 1e3
    p50, p99 = (round(float(np.percentile(a, q)), 3) for q in (50, 99))
    return {"n": len(values), "p50_ms": p50, "p99_ms": p99, "mean_ms": round(float(a.mean()), 3)}


@contextmanager
def _stage(stage: str, env: dict[str, str] | None = None) -> Iterator[StageProcess]:
    with running_stage(stage, LOGS, env) as server:
        yield server


def _fresh(n: int, kind: str = "sentence") -> list[str]:
    return corpus.texts(n, seed=random.randrange(2**31), kind=kind)


# --- 1. hit latency by tier -----------------------------------------------------------------
def _send(server: StageProcess, texts: list[str], clients: int, keep_alive: bool = True) -> list[Answer]:
    """Each text once, one text per request, ``clients`` at a time (closed loop)."""
    bodies = [orjson.dumps({"inputs": [t]}) for t in texts]
    return asyncio.run(post_bodies(server.url, bodies, clients, keep_alive=keep_alive))


def _sequential(server: StageProcess, texts: list[str]) -> tuple[list[float], list[str]]:
    answers = _send(server, texts, clients=1)
    assert all(a.status == 200 for a in answers), [a.status for a in answers]
    return [a.ms / 1e3 for a in answers], [a.headers["x-cache"] for a in answers]


def tier_latency(redis_url: str, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    setups = {"memory": {}, "redis": {"CACHE_URL": redis_url, "CACHE_MAX_ITEMS": "0"}}
    for tier, env in setups.items():
        with _stage(S4, env) as server:
            _sequential(server, _fresh(20))  # warm the connection and the allocator
            texts = _fresh(n)
            miss, miss_states = _sequential(server, texts)
            hit, hit_states = _sequential(server, texts)
            assert set(miss_states) == {"miss"} and set(hit_states) == {"hit"}, (miss_states, hit_states)
            out[f"{tier}_hit"] = _ms(hit)
            out[f"miss_{tier}_server"] = _ms(miss)
    return out


# --- 2 and 3. concurrent workloads ----------------------------------------------------------
def _fire(
    server: StageProcess, texts: list[str], concurrency: int, keep_alive: bool = True
) -> dict[str, Any]:
    """Status 0 in the results: the connection failed (counted, never hidden).
    ``keep_alive=False``: a new connection per request, as the seed's clients did."""
    started = time.perf_counter()
    answers = _send(server, texts, concurrency, keep_alive)
    wall = time.perf_counter() - started
    by_status: dict[str, Any] = {}
    for status in sorted({a.status for a in answers}):
        mine = [a for a in answers if a.status == status]
        by_status[str(status)] = _ms([a.ms / 1e3 for a in mine])
        server_s = [float(a.headers["x-total-time"]) / 1e3 for a in mine if "x-total-time" in a.headers]
        if server_s:  # the server's own time
            by_status[str(status)]["server_p50_ms"] = _ms(server_s)["p50_ms"]
    return {"requests": len(texts), "concurrency": concurrency, "wall_s": round(wall, 3),
            "rps": round(len(texts) / wall, 1), "latency": _ms([a.ms / 1e3 for a in answers]),
            "by_status": by_status}  # fmt: skip


def _texts_run(url: str) -> int:
    return int(httpx.get(f"{url}/v1/batcher/metrics", timeout=10).json()["texts"])


def repeated(requests: int, unique_ratio: float, concurrency: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": requests, "unique_ratio": unique_ratio, "rounds": rounds}
    for stage in (S3, S4):
        runs = []
        with _stage(stage) as server:
            _fire(server, _fresh(64), 8)  # warm-up, texts never used again
            for _ in range(rounds):  # every round has new texts: a cold cache each time
                unique = _fresh(int(requests * unique_ratio))
                texts = unique + [random.choice(unique) for _ in range(requests - len(unique))]
                random.shuffle(texts)
                before = _texts_run(server.url)
                run = _fire(server, texts, concurrency)
                run["model_texts"] = _texts_run(server.url) - before
                runs.append(run)
        best = sorted(runs, key=lambda r: r["rps"])[len(runs) // 2]  # the median round
        out[stage] = {"median_round": best, "rps_all_rounds": [r["rps"] for r in runs]}
    out["speedup"] = round(out[S4]["median_round"]["rps"] / out[S3]["median_round"]["rps"], 2)
    return out


def overload(requests: int, concurrency: int, max_queue: int) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": requests, "concurrency": concurrency, "max_queue": max_queue}
    for stage, env in ((S4, {"MAX_QUEUE": str(max_queue)}), (S3, {})):
        with _stage(stage, env) as server:
            _fire(server, _fresh(32), 8)
            texts = _fresh(requests, kind="passage")
            out[stage] = _fire(server, texts, concurrency, keep_alive=False)
            started = time.perf_counter()
            healthy = httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            out[stage]["health_after_ms"] = round((time.perf_counter() - started) * 1e3, 2)
            out[stage]["healthy_after"] = healthy
    return out


# --- 5. a flood -------------------------------------------------------------------------------
FLOOD = {"MAX_QUEUE": "8"}


def _wrk(server: StageProcess, clients: int, seconds: float, seed: int, polite: bool) -> dict[str, Any]:
    """``clients`` wrk connections for ``seconds``: 200s/s, refusals/s and the server's cores."""
    process = psutil.Process(server.pid)
    cpu, started = process_cpu(process), time.perf_counter()
    out = load.wrk(
        server.url, bodies_for("sentence", 60_000, seed), clients, seconds, honour_retry_after=polite
    )
    cores = (process_cpu(process) - cpu) / (time.perf_counter() - started)
    return {"ok_per_s": out["requests_per_s"], "refused_per_s": out["non_2xx_per_s"],
            "socket_errors": out["socket_errors"], "server_cores": round(cores, 2)}  # fmt: skip


def flood(
    clients: int, delays: Sequence[float], seconds: float, warmup: float, rounds: int
) -> dict[str, Any]:
    points: list[dict[str, Any]] = []
    for round_ in range(rounds):
        with _stage(S4) as server:
            load.wrk(server.url, bodies_for("sentence", 20_000, 7000 + round_), 32, warmup)
            settle(server.pid, server.url)
            points.append({"kind": "capacity", **_wrk(server, 32, seconds, 7100 + round_, False)})
        for delay in delays:
            with _stage(S4, {**FLOOD, "SHED_DELAY_MS": f"{delay:g}"}) as server:
                load.wrk(server.url, bodies_for("sentence", 20_000, 7200 + round_), 32, warmup)
                for kind, polite in (("honour", True), ("resend", False)):
                    settle(server.pid, server.url)
                    point = _wrk(server, clients, seconds, 7300 + 10 * round_ + polite, polite)
                    points.append({"kind": kind, "delay_ms": delay, **point})
                    print(json.dumps(points[-1]), flush=True)
    capacity = statistics.median(p["ok_per_s"] for p in points if p["kind"] == "capacity")
    rows = []
    for delay in delays:
        row: dict[str, Any] = {"delay_ms": delay}
        for kind in ("honour", "resend"):
            mine = [p for p in points if p["kind"] == kind and p["delay_ms"] == delay]
            row[kind] = {
                k: statistics.median(p[k] for p in mine)
                for k in ("ok_per_s", "refused_per_s", "server_cores")
            }
            row[kind]["goodput"] = round(row[kind]["ok_per_s"] / capacity, 4) if capacity else None
        rows.append(row)
    return {"clients": clients, "duration_s": seconds, "rounds": rounds, "settings": FLOOD, "points": points,
            "capacity_per_s": capacity, "by_delay": rows}  # fmt: skip


# --- the report ---------------------------------------------------------------------------
def _latency_rows(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return table(["request", "n", "p50 ms", "p99 ms"],
                 [(name, m.get("n", 0), num(m.get("p50_ms", 0), 2), num(m.get("p99_ms", 0), 2))
                  for name, m in rows])  # fmt: skip


def markdown(r: dict[str, Any]) -> str:
    t, rep, ov = r["tiers"], r["repeated"], r["overload"]
    sections: dict[str, list[str]] = {}
    sections["tiers"] = [
        "**Cache hit latency by tier** (sequential requests of one text, client side):",
        "",
        *_latency_rows([("hit, memory tier", t["memory_hit"]), ("hit, Redis tier", t["redis_hit"]),
                        ("miss (memory-only server)", t["miss_memory_server"]),
                        ("miss (Redis-only server)", t["miss_redis_server"])]),
    ]  # fmt: skip
    runs = {stage: rep[stage]["median_round"] for stage in (S3, S4)}
    sections["repeated"] = [
        f"**Repeated texts** ({rep['requests']} requests, unique ratio {rep['unique_ratio']}, "
        f"concurrency {runs[S3]['concurrency']}, median of {rep['rounds']} cold rounds):",
        "",
        *table(["stage", "req/s", "p50 ms", "p99 ms", "texts the model ran"],
               [(stage, run["rps"], num(run["latency"]["p50_ms"]), num(run["latency"]["p99_ms"]),
                 run["model_texts"]) for stage, run in runs.items()]),
        "",
        f"Stage 4 over stage 3: {rep['speedup']}x the requests per second.",
    ]  # fmt: skip
    rows = []
    for stage in (S4, S3):
        for status, s in ov[stage]["by_status"].items():
            own = num(s["server_p50_ms"], 2) if "server_p50_ms" in s else "–"
            label = "connection failed" if status == "0" else status
            rows.append((stage, label, s["n"], num(s["p50_ms"]), num(s["p99_ms"]), own))
    sections["overload"] = [
        f"**Overload** ({ov['requests']} requests of one passage each at concurrency {ov['concurrency']}; "
        f"stage 4 with MAX_QUEUE={ov['max_queue']}, stage 3 unbounded):",
        "",
        *table(["stage", "status", "count", "p50 ms", "p99 ms", "p50 ms, the server's own (x-total-time)"],
               rows, align="llrrrr"),
        "",
        *(f"- {stage}: all answered in {ov[stage]['wall_s']} s; `/health` right after: "
          f"{ov[stage]['health_after_ms']} ms." for stage in (S4, S3)),
    ]  # fmt: skip
    if "flood" in r:
        sections["flood"] = _flood_section(r["flood"])
    return page(r["stamp"], sections) + "\n"


def _flood_section(f: dict[str, Any]) -> list[str]:
    rows = []
    for row in f["by_delay"]:
        for kind, who in (("honour", "wait Retry-After"), ("resend", "send again at once")):
            m = row[kind]
            rows.append((f"{row['delay_ms']:g}", who, num(m["ok_per_s"], 0), num(m["refused_per_s"], 0),
                         f"{100 * (m['goodput'] or 0):.0f} %", num(m["server_cores"], 2)))  # fmt: skip
    return [
        f"**A flood** (stage 4, MAX_QUEUE={f['settings']['MAX_QUEUE']}, {f['clients']} `wrk` connections,"
        f" one new sentence per request, {f['duration_s']:g} s per point, median of {f['rounds']} rounds;"
        f" capacity, stage 4 with its defaults at 32 connections: {f['capacity_per_s']:.0f} answers/s):",
        "",
        *table(["SHED_DELAY_MS", f"{f['clients']} clients that ...", "200s/s", "503s/s", "of capacity",
                "server cores"], rows, align="rlrrrr"),
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--latency-requests", type=int, help="requests per tier (default 200, quick 30)")
    parser.add_argument(
        "--rounds", type=int, help="cold rounds of the repeated workload (default 3, quick 1)"
    )
    parser.add_argument("--flood-seconds", type=float, help="seconds per flood point (default 8, quick 2)")
    parser.add_argument("--out", type=Path, help="folder for stage4.json and stage4.md")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.stage4", args, argv)
    latency = args.latency_requests or (30 if args.quick else 200)
    rounds = args.rounds or (1 if args.quick else 3)
    result: dict[str, Any] = {}
    with any_redis() as url:
        print("1/4 cache hit latency by tier", flush=True)
        result["tiers"] = tier_latency(url, latency)
    print("2/4 repeated-text workload, stage 3 and stage 4", flush=True)
    result["repeated"] = repeated(100, 0.3, 8, rounds)
    print("3/4 overload, stage 4 and stage 3", flush=True)
    result["overload"] = overload(300, 200, 5)
    print("4/4 a flood, polite and impolite clients, by SHED_DELAY_MS", flush=True)
    seconds = args.flood_seconds or (2.0 if args.quick else 8.0)
    result["flood"] = flood(
        200, (0.0, 50.0, 200.0), seconds, 1.0 if args.quick else 2.0, 1 if args.quick else 2
    )
    result["stamp"] = run.stamp()
    evidence.publish(run, "stage4", result, markdown, args.out)


if __name__ == "__main__":
    main()
