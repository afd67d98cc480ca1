"""Stage 3's measurements: the targets against stage 2 and the engine, and where batching stops paying.

    python -m benchmarks.stage3            # about 8 minutes; run it on a quiet machine
    python -m benchmarks.stage3 --quick    # a few seconds per point, about 3 minutes
    python -m benchmarks.stage3 --record   # written to docs/results/ and docs/img/

Writes stage3_sweep.json, stage3.md (the tables the chapter includes) and stage3_sweep.png.
One run, one machine:

* ``engine``: the engine alone on the same sentences at its best batch size (the ceiling), and
  what one more model call costs, in padded tokens (k calls of one row against one of k rows).
* ``targets``: stage 2 and stage 3 with their defaults at 1 and 32 clients, unique sentences.
* ``batch_size`` and ``window``: stage 3 with MAX_BATCH_SIZE 1..64 and BATCH_WINDOW_MS 0..20.
* ``concurrency``: BATCH_CONCURRENCY 1 and 2 (batches in the model at once), each with and
  without a 2 ms window, at 8 and 32 clients.
* ``mixed``: queries and passages together at 32 clients, GROUP_BY_LENGTH and SPLIT_BY_LENGTH.
* ``burst``: 256 mixed texts queued at once in the batcher (no HTTP): padding with and without
  grouping and length buckets.
* ``variant``: MODEL_VARIANT=int8-static, where length buckets change no vector.

The load comes from loadtests.httpload, a small asyncio HTTP/1.1 client (keep-alive, one connection
per client, pre-built bodies): on 2 cores every millisecond the client spends is taken from the server, and
this client spends about a tenth of what Locust does. Its own CPU time is recorded with each point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from benchmarks.compare import engine_ceiling
from benchmarks.stage3_report import markdown, plot
from common import corpus
from common.engine import Engine
from common.settings import Settings
from loadtests import evidence
from loadtests.harness import settle
from loadtests.httpload import post_requests, run_load
from loadtests.procs import running_stage
from stage3_batching.app import RefinedBatcher

HOST = "127.0.0.1"
BATCH_SIZES = (1, 4, 8, 16, 32, 64)
WINDOWS_MS = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0)


def load(port: int, bodies: list[bytes], clients: int, seconds: float, warmup: float) -> dict[str, Any]:
    """Requests/s and latency percentiles of ``clients`` closed-loop clients over ``seconds``."""
    return run_load(HOST, port, post_requests("/v1/embed", bodies), clients, seconds, warmup)


def bodies_for(kind: str, n: int, seed: int) -> list[bytes]:
    return [orjson.dumps({"inputs": [t]}) for t in corpus.texts(n, seed=seed, kind=kind)]


def run_stage(
    stage: str, env: dict[str, str], points: Sequence[tuple[str, int]], args: argparse.Namespace, port: int
) -> list[dict[str, Any]]:
    """Start ``stage`` once with ``env`` and measure each (text kind, clients) point."""
    results = []
    with running_stage(stage, evidence.OUT / "logs" / "stage3", env, port=port or None, host=HOST) as server:
        url = server.url
        port = server.port
        for kind, clients in points:
            settle(server.pid, url)
            before = _batcher_metrics(url)
            point = load(
                port, bodies_for(kind, 20_000, seed=31 + clients), clients, args.duration, args.warmup
            )
            after = _batcher_metrics(url)
            point.update({"stage": stage, "kind": kind, **{k.lower(): _num(v) for k, v in env.items()}})
            if before and after:
                point.update(batch_delta(before, after))
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


def batch_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
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


SENTENCES, MIXED = [("sentence", 1), ("sentence", 32)], [("mixed", 32)]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    port, s3 = args.port, "stage3_batching"
    out: dict[str, Any] = {"duration_s": args.duration, "warmup_s": args.warmup}
    out["load_average"] = {"before": os.getloadavg()[0]}  # other work on the machine shows here
    print("engine alone ...", flush=True)
    out["engine"] = engine_ceiling(["sentence"], args.ceiling_seconds)["sentence"]
    out["engine"]["call_overhead"] = call_overhead()
    out["burst"] = asyncio.run(burst())
    out["batch_mates"] = batch_mates()
    out["targets"] = run_stage("stage2_threadpool", {}, SENTENCES, args, port)
    out["targets"] += run_stage(s3, {}, SENTENCES, args, port)
    out["batch_size"] = []
    for size in BATCH_SIZES:
        out["batch_size"] += run_stage(s3, {"MAX_BATCH_SIZE": str(size)}, SENTENCES[1:], args, port)
    out["window"] = []
    for window in WINDOWS_MS:
        env = {"BATCH_WINDOW_MS": str(window)}
        out["window"] += run_stage(s3, env, [("sentence", 4), ("sentence", 32)], args, port)
    out["concurrency"] = []  # model slots and the window, together: one decides the other
    for slots in (1, 2):
        for window in (0.0, 2.0):
            env = {"BATCH_CONCURRENCY": str(slots), "BATCH_WINDOW_MS": str(window)}
            out["concurrency"] += run_stage(s3, env, [("sentence", 8), ("sentence", 32)], args, port)
    out["mixed"] = []
    for env in ({}, {"GROUP_BY_LENGTH": "false"}, {"SPLIT_BY_LENGTH": "false"}):
        out["mixed"] += run_stage(s3, env, MIXED, args, port)
    out["variant"] = []
    for split in ("true", "false"):
        env = {"MODEL_VARIANT": "int8-static", "SPLIT_BY_LENGTH": split}
        out["variant"] += run_stage(s3, env, SENTENCES[1:], args, port)
    out["load_average"]["after"] = os.getloadavg()[0]
    out["summary"] = summarize(out)
    return out


def call_overhead(k: int = 16, length: int = 24, repeats: int = 7) -> dict[str, float]:
    """What one more model call costs: k texts as k calls of one row against one call of k rows.

    CPU time (all threads of this process), not wall time: it is what a saturated server
    runs out of, and other work on the machine disturbs it far less.
    """
    engine = Engine.from_settings(Settings())
    engine.warmup()
    ids = [np.arange(1000, 1000 + length) for _ in range(k)]
    joint = min(_cpu(lambda: engine.run(ids)) for _ in range(repeats))
    apart = min(_cpu(lambda: [engine.run([row]) for row in ids]) for _ in range(repeats))
    fixed = (apart - joint) / (k - 1)
    per_token = joint / (k * length)
    return {"fixed_ms": fixed * 1e3, "per_token_ms": per_token * 1e3, "tokens": fixed / per_token}


def _cpu(fn: Any) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def batch_mates(n: int = 64) -> dict[str, dict[str, float]]:
    """Cosine between a text's vector alone and inside one padded batch of mixed texts."""
    texts = corpus.texts(n, seed=78, kind="mixed")
    out = {}
    for variant in ("int8-dynamic", "int8-static"):
        engine = Engine(Settings().model_dir, variant=variant)
        alone = np.concatenate([engine.embed([t]).vectors for t in texts])
        cosines = (alone * engine.embed(texts).vectors).sum(axis=1)
        out[variant] = {"texts": n, "min_cosine": float(cosines.min()), "mean_cosine": float(cosines.mean())}
    print(json.dumps(out), flush=True)
    return out


async def burst(n: int = 256) -> list[dict[str, Any]]:
    """Mixed texts queued all at once, straight into the batcher with the real engine."""
    engine = Engine.from_settings(Settings())
    tokens = engine.tokenize(corpus.texts(n, seed=77, kind="mixed"))
    results = []
    for group, split in ((False, False), (True, False), (True, True)):
        settings = Settings(group_by_length=group, split_by_length=split)
        batcher = RefinedBatcher(engine.run, settings)
        await batcher.start()
        start = time.perf_counter()
        await asyncio.gather(*(batcher.submit([t]) for t in tokens))
        seconds = time.perf_counter() - start
        await batcher.close()
        stats = batcher.stats
        results.append(
            {"group_by_length": group, "split_by_length": split, "texts": n, "texts_per_s": n / seconds,
             "padding_ratio": stats.padding_ratio, "batches": stats.batches, "model_calls": stats.calls}
        )  # fmt: skip
        print(json.dumps(results[-1]), flush=True)
    return results


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, as ratios inside this one run."""
    pick = {(p["stage"], p["clients"]): p for p in out["targets"]}
    s2_1, s2_32 = pick[("stage2_threadpool", 1)], pick[("stage2_threadpool", 32)]
    s3_1, s3_32 = pick[("stage3_batching", 1)], pick[("stage3_batching", 32)]
    measured = {
        "stage 3 / engine alone, 32 clients": s3_32["requests_per_s"] / out["engine"]["texts_per_s"],
        "stage 3 / stage 2 throughput, 32 clients": s3_32["requests_per_s"] / s2_32["requests_per_s"],
        "stage 3 / stage 2 p99, 32 clients": s3_32["p99_ms"] / s2_32["p99_ms"],
        "stage 3 / stage 2 p50, 1 client": s3_1["p50_ms"] / s2_1["p50_ms"],
    }
    target = dict(zip(measured, (">= 0.80", ">= 1.25", "<= 1.00", "<= 1.20"), strict=True))
    met = {k: (v >= float(target[k][3:])) if target[k][0] == ">" else v <= float(target[k][3:])
           for k, v in measured.items()}  # fmt: skip
    return {"measured": measured, "target": target, "met": met}


def headline(out: dict[str, Any]) -> dict[str, float]:
    pick = {(p["stage"], p["clients"]): p["requests_per_s"] for p in out["targets"]}
    return {
        "engine alone, texts/s": out["engine"]["texts_per_s"],
        "stage 2, 32 clients, req/s": pick[("stage2_threadpool", 32)],
        "stage 3, 32 clients, req/s": pick[("stage3_batching", 32)],
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, help="Seconds measured per point (default 10).")
    parser.add_argument("--warmup", type=float, help="Seconds of load before each point (default 2).")
    parser.add_argument("--ceiling-seconds", type=float, help="Seconds per batch size for the engine alone.")
    parser.add_argument("--port", type=int, default=0, help="Port for the servers (0: a free one each).")
    parser.add_argument("--out", type=Path, help="Folder for the JSON and markdown.")
    parser.add_argument("--img", type=Path, help="Folder for stage3_sweep.png.")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.stage3", args, argv)
    args.duration = args.duration or (2.0 if args.quick else 10.0)
    args.warmup = args.warmup or (0.5 if args.quick else 2.0)
    args.ceiling_seconds = args.ceiling_seconds or (0.5 if args.quick else 3.0)
    out = {"stamp": {}, **measure(args)}
    out["stamp"] = run.stamp()
    folder, img = args.out or run.results_dir, args.img or run.img_dir
    evidence.write_json(folder / "stage3_sweep.json", out)
    evidence.write_text(folder / "stage3.md", markdown(out))
    plot(out, img / "stage3_sweep.png")
    print(json.dumps(out["summary"], indent=2))
    print(f"wrote {folder}/stage3_sweep.json, {folder}/stage3.md and {img}/stage3_sweep.png")
    evidence.against_reference(run, "stage3_sweep.json", out, headline)


if __name__ == "__main__":
    main()
