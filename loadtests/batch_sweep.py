"""Stage 3's measurements: the targets against stage 2 and the engine, and where batching stops paying.

    python -m loadtests.batch_sweep            # about 6 minutes; run it on a quiet machine
    python -m loadtests.batch_sweep --quick    # a few seconds per point, to see that it all works

Writes docs/results/stage3_sweep.json and docs/img/stage3_sweep.png. Four parts, one run:

* ``targets``: the engine alone (same texts, best batch size), stage 2 and stage 3 with their
  defaults at 1 and 32 clients sending unique 12-20 word sentences.
* ``batch_size``: stage 3 at 32 clients with MAX_BATCH_SIZE 1, 4, 8, 16, 32, 64.
* ``window``: stage 3 at 32 clients with BATCH_WINDOW_MS 0 .. 20 (and at 4 clients, where a
  window has friends to wait for but few arrive).
* ``grouping``: mixed-length texts (queries and passages) with GROUP_BY_LENGTH on and off:
  throughput, p99 and the padding ratio the server reports at /v1/batcher/metrics.

The load comes from a small asyncio HTTP/1.1 client (keep-alive, one connection per client,
pre-built bodies): on 2 cores every millisecond the client spends is taken from the server, and
this client spends about a tenth of what Locust does. Its own CPU time is recorded with each point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import psutil

from common import corpus
from common.machine import machine_info
from loadtests.compare import engine_ceiling
from loadtests.harness import REPO, running_stage, settle

RESULTS = REPO / "docs" / "results" / "stage3_sweep.json"
PLOT = REPO / "docs" / "img" / "stage3_sweep.png"
HOST = "127.0.0.1"
BATCH_SIZES = (1, 4, 8, 16, 32, 64)
WINDOWS_MS = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0)


# --8<-- [start:driver]
async def _client(port: int, bodies: list[bytes], start: int, until: float, out: list[float]) -> int:
    """One keep-alive connection sending requests back to back; appends latencies in ms."""
    reader, writer = await asyncio.open_connection(HOST, port)
    errors, i = 0, start
    try:
        while time.perf_counter() < until:
            body = bodies[i % len(bodies)]
            i += 1
            head = b"POST /v1/embed HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            sent = time.perf_counter()
            writer.write(b"%scontent-length: %d\r\n\r\n%s" % (head, len(body), body))
            response = await reader.readuntil(b"\r\n\r\n")
            length = int(response.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            if response[9:12] == b"200":
                out.append((time.perf_counter() - sent) * 1e3)
            else:
                errors += 1
    finally:
        writer.close()
    return errors


async def _drive(port: int, bodies: list[bytes], clients: int, seconds: float) -> tuple[list[float], int]:
    until = time.perf_counter() + seconds
    latencies: list[float] = []
    step = len(bodies) // clients
    errors = await asyncio.gather(
        *(_client(port, bodies, i * step, until, latencies) for i in range(clients))
    )
    return latencies, sum(errors)


def load(port: int, bodies: list[bytes], clients: int, seconds: float, warmup: float) -> dict[str, Any]:
    """Requests/s and latency percentiles of ``clients`` closed-loop clients over ``seconds``."""
    asyncio.run(_drive(port, bodies[::-1], clients, warmup))  # other texts: no cache can help
    me = psutil.Process()
    cpu = sum(me.cpu_times()[:2])
    latencies, errors = asyncio.run(_drive(port, bodies, clients, seconds))
    lat = np.asarray(latencies)
    return {
        "clients": clients,
        "requests_per_s": len(lat) / seconds,
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else None,
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else None,
        "errors": errors,
        "client_cpu_cores": (sum(me.cpu_times()[:2]) - cpu) / seconds,
    }


# --8<-- [end:driver]


def bodies_for(kind: str, n: int, seed: int) -> list[bytes]:
    return [orjson.dumps({"inputs": [t]}) for t in corpus.texts(n, seed=seed, kind=kind)]


def run_stage(
    stage: str, env: dict[str, str], points: Sequence[tuple[str, int]], args: argparse.Namespace, port: int
) -> list[dict[str, Any]]:
    """Start ``stage`` once with ``env`` and measure each (text kind, clients) point."""
    results = []
    log = REPO / ".benchmarks" / f"{stage}-{port}.log"
    with running_stage(stage, HOST, port, log, env) as process:
        url = f"http://{HOST}:{port}"
        for kind, clients in points:
            settle(process.pid, url)
            before = _batcher_metrics(url)
            point = load(
                port, bodies_for(kind, 20_000, seed=31 + clients), clients, args.duration, args.warmup
            )
            after = _batcher_metrics(url)
            point.update({"stage": stage, "kind": kind, **{k.lower(): _num(v) for k, v in env.items()}})
            if before and after:
                point.update(_batch_delta(before, after))
            print(json.dumps(point), flush=True)
            results.append(point)
    return results


def _num(value: str) -> Any:
    try:
        return float(value) if "." in value else int(value)
    except ValueError:
        return value


def _batcher_metrics(url: str) -> dict[str, Any] | None:
    response = httpx.get(f"{url}/v1/batcher/metrics", timeout=5.0)
    return dict(response.json()) if response.status_code == 200 else None


def _batch_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Batch statistics of the measured interval only (warm-up included: it is the same load)."""
    batches = after["batches"] - before["batches"]
    texts = after["texts"] - before["texts"]
    padded = after["padded_tokens"] - before["padded_tokens"]
    real = after["real_tokens"] - before["real_tokens"]
    tiers = {t: after["tiers"][t] - before["tiers"][t] for t in after["tiers"]}
    return {
        "average_batch_size": texts / batches if batches else 0.0,
        "padding_ratio": 1 - real / padded if padded else 0.0,
        "tiers": tiers,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    port = args.port
    out: dict[str, Any] = {"machine": machine_info(), "duration_s": args.duration, "warmup_s": args.warmup}
    print("engine ceiling ...", flush=True)
    out["engine"] = engine_ceiling(["sentence"], args.ceiling_seconds)["sentence"]
    print(json.dumps(out["engine"]), flush=True)
    unique = [("sentence", 1), ("sentence", 32)]
    out["targets"] = run_stage("stage2_threadpool", {}, unique, args, port) + run_stage(
        "stage3_batching", {}, unique, args, port
    )
    out["batch_size"] = []
    for size in BATCH_SIZES:
        out["batch_size"] += run_stage(
            "stage3_batching", {"MAX_BATCH_SIZE": str(size)}, [unique[1]], args, port
        )
    out["window"] = []
    for window in WINDOWS_MS:
        env = {"BATCH_WINDOW_MS": str(window)}
        out["window"] += run_stage("stage3_batching", env, [("sentence", 4), ("sentence", 32)], args, port)
    out["grouping"] = []
    for group in ("true", "false"):
        env = {"GROUP_BY_LENGTH": group}
        out["grouping"] += run_stage("stage3_batching", env, [("mixed", 32)], args, port)
    out["summary"] = summarize(out)
    return out


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, as ratios inside this one run."""
    pick = {(p["stage"], p["clients"]): p for p in out["targets"]}
    s2_1, s2_32 = pick[("stage2_threadpool", 1)], pick[("stage2_threadpool", 32)]
    s3_1, s3_32 = pick[("stage3_batching", 1)], pick[("stage3_batching", 32)]
    ceiling = out["engine"]["texts_per_s"]
    return {
        "stage3_vs_engine_at_32": s3_32["requests_per_s"] / ceiling,
        "stage3_vs_stage2_at_32": s3_32["requests_per_s"] / s2_32["requests_per_s"],
        "p99_stage3_over_stage2_at_32": s3_32["p99_ms"] / s2_32["p99_ms"],
        "p50_stage3_over_stage2_at_1": s3_1["p50_ms"] / s2_1["p50_ms"],
        "targets": {
            "stage3_vs_engine_at_32": 0.80,
            "stage3_vs_stage2_at_32": 1.25,
            "p99_stage3_over_stage2_at_32": 1.0,
            "p50_stage3_over_stage2_at_1": 1.2,
        },
    }


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, x_key, label in (
        (axes[0], "batch_size", "max_batch_size", "MAX_BATCH_SIZE (32 clients)"),
        (axes[1], "window", "batch_window_ms", "BATCH_WINDOW_MS (32 clients)"),
    ):
        points = [p for p in out[key] if p["clients"] == 32]
        xs = [str(p[x_key]) for p in points]
        ax.bar(xs, [p["requests_per_s"] for p in points], color="#4a7ab0")
        ax.axhline(out["engine"]["texts_per_s"], color="#999", linestyle="--", label="engine alone")
        ax.set_xlabel(label)
        ax.set_ylabel("requests/s")
        twin = ax.twinx()
        twin.plot(xs, [p["p99_ms"] for p in points], color="#c0392b", marker="o", label="p99")
        twin.set_ylabel("p99 latency (ms)", color="#c0392b")
        ax.legend(loc="lower right")
    fig.suptitle(f"stage 3 on {out['machine']['cpu']} ({out['machine']['cores']} cores)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 s per point: check that it all runs.")
    parser.add_argument("--duration", type=float, help="Seconds measured per point (default 10).")
    parser.add_argument("--warmup", type=float, help="Seconds of load before each point (default 2).")
    parser.add_argument("--ceiling-seconds", type=float, help="Seconds per batch size for the engine alone.")
    parser.add_argument("--port", type=int, default=8931)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=PLOT)
    args = parser.parse_args(argv)
    args.duration = args.duration or (2.0 if args.quick else 10.0)
    args.warmup = args.warmup or (0.5 if args.quick else 2.0)
    args.ceiling_seconds = args.ceiling_seconds or (0.5 if args.quick else 3.0)
    out = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    plot(out, args.plot)
    print(json.dumps(out["summary"], indent=2))
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
