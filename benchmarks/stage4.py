"""`make bench-stage4`: the stage 4 measurements, written to docs/results/stage4.json and stage4.md.

1. Latency of a cache hit in the memory tier and in the Redis tier, against a miss (same run).
2. Redis from Python: one pooled client versus a new connection per command (same Redis, same run).
3. The seed's repeated-text workload (100 requests, unique ratio 0.3) on stage 3 and stage 4.
4. The seed's overload run (queue capped at 5, 300 requests of one passage at concurrency 200)
   on stage 4, and the same load on stage 3, which has no bound.

Uses the Redis at 127.0.0.1:6379 when it answers, else starts a private ``redis-server``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import redis
import redis.asyncio as aioredis

from loadtests.harness import REPO, running_stage
from loadtests.machine import machine_info
from stage0_script import corpus

S3, S4 = "stage3_batching", "stage4_cache_backpressure"
OUT = REPO / "docs" / "results"
LOGS = REPO / "out" / "bench-stage4"  # git-ignored server logs


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ms(values: list[float]) -> dict[str, float]:
    """p50/p99/mean of seconds, in ms."""
    if not values:
        return {"n": 0}
    a = np.asarray(values) * 1e3
    p50, p99 = (round(float(np.percentile(a, q)), 3) for q in (50, 99))
    return {"n": len(values), "p50_ms": p50, "p99_ms": p99, "mean_ms": round(float(a.mean()), 3)}


@contextmanager
def _redis() -> Iterator[str]:
    shared = "redis://127.0.0.1:6379/0"
    try:
        if redis.Redis.from_url(shared, socket_timeout=1).ping():
            yield shared
            return
    except redis.RedisError:
        pass
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("no Redis at 127.0.0.1:6379 and no redis-server installed")
    port = _port()
    proc = subprocess.Popen([binary, "--port", str(port), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        time.sleep(0.5)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait()


@contextmanager
def _stage(stage: str, env: dict[str, str] | None = None) -> Iterator[str]:
    port = _port()
    with running_stage(stage, "127.0.0.1", port, LOGS / f"{stage}-{port}.log", env):
        yield f"http://127.0.0.1:{port}"


def _fresh(n: int, kind: str = "sentence") -> list[str]:
    return corpus.texts(n, seed=random.randrange(2**31), kind=kind)


# --- 1. hit latency by tier -----------------------------------------------------------------
def _sequential(url: str, texts: list[str]) -> tuple[list[float], list[str]]:
    times, states = [], []
    with httpx.Client(timeout=60) as client:
        for text in texts:
            started = time.perf_counter()
            response = client.post(f"{url}/v1/embed", json={"inputs": [text]})
            times.append(time.perf_counter() - started)
            response.raise_for_status()
            states.append(response.headers["x-cache"])
    return times, states


def tier_latency(redis_url: str, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    setups = {"memory": {}, "redis": {"CACHE_URL": redis_url, "CACHE_MAX_ITEMS": "0"}}
    for tier, env in setups.items():
        with _stage(S4, env) as url:
            _sequential(url, _fresh(20))  # warm the connection and the allocator
            texts = _fresh(n)
            miss, miss_states = _sequential(url, texts)
            hit, hit_states = _sequential(url, texts)
            assert set(miss_states) == {"miss"} and set(hit_states) == {"hit"}, (miss_states, hit_states)
            out[f"{tier}_hit"] = _ms(hit)
            out[f"miss_{tier}_server"] = _ms(miss)
    return out


# --- 2. pooled client versus a connection per command -------------------------------------
async def redis_connections(url: str, n: int) -> dict[str, Any]:
    key, value = f"bench:stage4:{random.random()}", np.zeros(384, np.float32).tobytes()
    pooled_client = aioredis.Redis.from_url(url)
    await pooled_client.set(key, value, ex=60)
    pooled, fresh = [], []
    for _ in range(n):  # interleaved, so both see the same machine at the same moment
        started = time.perf_counter()
        assert await pooled_client.get(key) == value
        pooled.append(time.perf_counter() - started)
        started = time.perf_counter()
        client = aioredis.Redis.from_url(url)  # the seed's mistake: a new connection per command
        assert await client.get(key) == value
        await client.aclose()
        fresh.append(time.perf_counter() - started)
    await pooled_client.aclose()
    return {"value_bytes": len(value), "pooled": _ms(pooled), "new_connection_per_command": _ms(fresh)}


# --- 3 and 4. concurrent workloads ----------------------------------------------------------
async def _fire(url: str, texts: list[str], concurrency: int, keep_alive: bool = True) -> dict[str, Any]:
    """Status 0 in the results: the connection failed (counted, never hidden)."""
    gate = asyncio.Semaphore(concurrency)
    keep = concurrency if keep_alive else 0  # off: every request is its own client, as in the seed
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=keep)
    async with httpx.AsyncClient(limits=limits, timeout=300) as client:

        async def one(text: str) -> tuple[int, float, float | None]:
            async with gate:
                started = time.perf_counter()
                try:
                    response = await client.post(f"{url}/v1/embed", json={"inputs": [text]})
                except httpx.TransportError:
                    return 0, time.perf_counter() - started, None
                server_ms = response.headers.get("x-total-time")  # the server's own time
                server_s = float(server_ms) / 1e3 if server_ms else None
                return response.status_code, time.perf_counter() - started, server_s

        started = time.perf_counter()
        results = await asyncio.gather(*(one(t) for t in texts))
        wall = time.perf_counter() - started
    by_status: dict[str, Any] = {}
    for status in sorted({s for s, _, _ in results}):
        by_status[str(status)] = _ms([lat for s, lat, _ in results if s == status])
        server = [t for s, _, t in results if s == status and t is not None]
        if server:
            by_status[str(status)]["server_p50_ms"] = _ms(server)["p50_ms"]
    return {"requests": len(texts), "concurrency": concurrency, "wall_s": round(wall, 3),
            "rps": round(len(texts) / wall, 1), "latency": _ms([lat for _, lat, _ in results]),
            "by_status": by_status}  # fmt: skip


def _texts_run(url: str) -> int:
    return int(httpx.get(f"{url}/v1/batcher/metrics", timeout=10).json()["texts"])


def repeated(requests: int, unique_ratio: float, concurrency: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": requests, "unique_ratio": unique_ratio, "rounds": rounds}
    for stage in (S3, S4):
        runs = []
        with _stage(stage) as url:
            asyncio.run(_fire(url, _fresh(64), 8))  # warm-up, texts never used again
            for _ in range(rounds):  # every round has new texts: a cold cache each time
                unique = _fresh(int(requests * unique_ratio))
                texts = unique + [random.choice(unique) for _ in range(requests - len(unique))]
                random.shuffle(texts)
                before = _texts_run(url)
                run = asyncio.run(_fire(url, texts, concurrency))
                run["model_texts"] = _texts_run(url) - before
                runs.append(run)
        best = sorted(runs, key=lambda r: r["rps"])[len(runs) // 2]  # the median round
        out[stage] = {"median_round": best, "rps_all_rounds": [r["rps"] for r in runs]}
    out["speedup"] = round(out[S4]["median_round"]["rps"] / out[S3]["median_round"]["rps"], 2)
    return out


def overload(requests: int, concurrency: int, max_queue: int) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": requests, "concurrency": concurrency, "max_queue": max_queue}
    for stage, env in ((S4, {"MAX_QUEUE": str(max_queue)}), (S3, {})):
        with _stage(stage, env) as url:
            asyncio.run(_fire(url, _fresh(32), 8))
            texts = _fresh(requests, kind="passage")
            out[stage] = asyncio.run(_fire(url, texts, concurrency, keep_alive=False))
            started = time.perf_counter()
            healthy = httpx.get(f"{url}/health", timeout=10).status_code == 200
            out[stage]["health_after_ms"] = round((time.perf_counter() - started) * 1e3, 2)
            out[stage]["healthy_after"] = healthy
    return out


# --- the report ---------------------------------------------------------------------------
def _row(name: str, m: dict[str, Any]) -> str:
    return f"| {name} | {m.get('n', 0)} | {m.get('p50_ms', 0):.2f} | {m.get('p99_ms', 0):.2f} |"


def markdown(r: dict[str, Any]) -> str:
    m, t, c, rep, ov = r["machine"], r["tiers"], r["redis_connections"], r["repeated"], r["overload"]
    lines = [
        f"<!-- generated by `{r['command']}`; do not edit -->",
        "<!-- --8<-- [start:machine] -->",
        f"Measured by `{r['command']}` on {m['cpu']}, {m['cores']} cores, "
        f"{m['memory_gib']} GiB memory, {m['date']}.",
        "<!-- --8<-- [end:machine] -->",
        "",
        "<!-- --8<-- [start:tiers] -->",
        "**Cache hit latency by tier** (sequential requests of one text, client side):",
        "",
        "| request | n | p50 ms | p99 ms |",
        "|---|---|---|---|",
        _row("hit, memory tier", t["memory_hit"]),
        _row("hit, Redis tier", t["redis_hit"]),
        _row("miss (memory-only server)", t["miss_memory_server"]),
        _row("miss (Redis-only server)", t["miss_redis_server"]),
        "<!-- --8<-- [end:tiers] -->",
        "",
        "<!-- --8<-- [start:redis] -->",
        f"**Redis GET of {c['value_bytes']} bytes** (local Redis, interleaved, same run):",
        "",
        "| client | n | p50 ms | p99 ms |",
        "|---|---|---|---|",
        _row("one pooled client", c["pooled"]),
        _row("new connection per command", c["new_connection_per_command"]),
        "<!-- --8<-- [end:redis] -->",
        "",
        "<!-- --8<-- [start:repeated] -->",
        f"**Repeated texts** ({rep['requests']} requests, unique ratio {rep['unique_ratio']}, "
        f"concurrency {rep[S3]['median_round']['concurrency']}, median of {rep['rounds']} cold rounds):",
        "",
        "| stage | req/s | p50 ms | p99 ms | texts the model ran |",
        "|---|---|---|---|---|",
    ]
    for stage in (S3, S4):
        run = rep[stage]["median_round"]
        lat = run["latency"]
        lines.append(
            f"| {stage} | {run['rps']} | {lat['p50_ms']:.1f} | {lat['p99_ms']:.1f} | {run['model_texts']} |"
        )
    lines += [
        "",
        f"Stage 4 over stage 3: {rep['speedup']}x the requests per second.",
        "<!-- --8<-- [end:repeated] -->",
        "",
        "<!-- --8<-- [start:overload] -->",
        f"**Overload** ({ov['requests']} requests of one passage each at concurrency {ov['concurrency']}; "
        f"stage 4 with MAX_QUEUE={ov['max_queue']}, stage 3 unbounded):",
        "",
        "| stage | status | count | p50 ms | p99 ms | p50 ms, the server's own (x-total-time) |",
        "|---|---|---|---|---|---|",
    ]
    for stage in (S4, S3):
        for status, s in ov[stage]["by_status"].items():
            label = "connection failed" if status == "0" else status
            own = f"{s['server_p50_ms']:.2f}" if "server_p50_ms" in s else "-"
            lines.append(f"| {stage} | {label} | {s['n']} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {own} |")
    lines.append("")
    for stage in (S4, S3):
        run = ov[stage]
        lines.append(f"- {stage}: all answered in {run['wall_s']} s; `/health` right after: "
                     f"{run['health_after_ms']} ms.")  # fmt: skip
    lines.append("<!-- --8<-- [end:overload] -->")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--latency-requests", type=int, default=200)
    parser.add_argument("--redis-commands", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"command": "make bench-stage4", "machine": machine_info()}
    with _redis() as url:
        print("1/4 cache hit latency by tier", flush=True)
        result["tiers"] = tier_latency(url, args.latency_requests)
        print("2/4 Redis: pooled versus new connection per command", flush=True)
        result["redis_connections"] = asyncio.run(redis_connections(url, args.redis_commands))
    print("3/4 repeated-text workload, stage 3 and stage 4", flush=True)
    result["repeated"] = repeated(100, 0.3, 8, args.rounds)
    print("4/4 overload, stage 4 and stage 3", flush=True)
    result["overload"] = overload(300, 200, 5)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stage4.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "stage4.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
