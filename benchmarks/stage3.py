"""Stage 3's measurements: the targets against stage 2 and the engine, and where batching stops paying.

    python -m benchmarks.stage3            # about 8 minutes; run it on a quiet machine
    python -m benchmarks.stage3 --quick    # a few seconds per point, about 3 minutes
    python -m benchmarks.stage3 --record   # written to docs/results/ and docs/img/

Writes stage3_sweep.json, stage3.md (the tables the chapter and its lab notes include) and
stage3_sweep.png.
One run, one machine:

* ``engine``: the engine alone on the same sentences at its best batch size (the ceiling), and
  what one more model call costs, in padded tokens (k calls of one row against one of k rows).
* ``targets``: stage 2 and stage 3 with their defaults at 1 and 32 clients, unique sentences.
* ``batch_size``: stage 3 with MAX_BATCH_SIZE 1..64.
* ``windows``: how long should a batch wait? The load tiers with their windows (MEDIUM, HIGH),
  one stage 3 server per pair, all running at once and taking turns at 8, 32 and 128
  connections; 50 ms for both is the window many servers ship with.
* ``concurrency``: BATCH_CONCURRENCY 1 and 2 (batches in the model at once), each with and
  without a 2 ms window, at 8 and 32 clients.
* ``mixed``: queries and passages together at 32 clients, GROUP_BY_LENGTH and SPLIT_BY_LENGTH.
* ``burst``: 256 mixed texts queued at once in the batcher (no HTTP): padding with and without
  grouping and length buckets.
* ``variant``: MODEL_VARIANT=int8-static, where length buckets change no vector.

The load comes from ``wrk`` (closed loop, one new text per request): on 2 cores every millisecond
the client spends is taken from the server, and wrk spends a small fraction of what Locust does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from benchmarks.compare import engine_ceiling
from common import corpus
from common.engine import Engine
from common.settings import Settings
from loadtests import evidence
from loadtests import load as loading
from loadtests.evidence import save_figure
from loadtests.load import settle
from loadtests.procs import running_stage
from loadtests.tables import num, page, table
from stage3_batching.app import RefinedBatcher

HOST = "127.0.0.1"
BATCH_SIZES = (1, 4, 8, 16, 32, 64)
# (MEDIUM, HIGH) windows in ms; the first is the default, the last the common choice elsewhere.
WINDOWS = ((0.0, 0.0), (0.0, 2.0), (2.0, 2.0), (0.0, 5.0), (5.0, 5.0), (50.0, 50.0))
TIERS = ("low", "medium", "high")


def load(url: str, bodies: list[bytes], clients: int, seconds: float, warmup: float) -> dict[str, Any]:
    """Requests/s and latency percentiles of ``clients`` wrk connections over ``seconds``, after
    ``warmup`` seconds of the same load on other texts."""
    loading.wrk(url, bodies[::-1], clients, warmup)
    point = loading.wrk(url, bodies, clients, seconds)
    errors = point.pop("socket_errors") + round(point.pop("non_2xx_per_s") * max(1, round(seconds)))
    return {"clients": point.pop("connections"), **point, "errors": errors}


def bodies_for(kind: str, n: int, seed: int) -> list[bytes]:
    return [orjson.dumps({"inputs": [t]}) for t in corpus.texts(n, seed=seed, kind=kind)]


def run_stage(
    stage: str, env: dict[str, str], points: Sequence[tuple[str, int]], args: argparse.Namespace, port: int
) -> list[dict[str, Any]]:
    """Start ``stage`` once with ``env`` and measure each (text kind, clients) point."""
    results = []
    with running_stage(stage, evidence.OUT / "logs" / "stage3", env, port=port or None, host=HOST) as server:
        url = server.url
        for kind, clients in points:
            settle(server.pid, url)
            before = _batcher_metrics(url)
            point = load(
                url, bodies_for(kind, 20_000, seed=31 + clients), clients, args.duration, args.warmup
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
    out["windows"] = windows(args)
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


def windows(args: argparse.Namespace, clients: Sequence[int] = (8, 32, 128)) -> dict[str, Any]:
    """Every (MEDIUM, HIGH) pair of windows a stage 3 server, all at once, measured in turns."""
    points: list[dict[str, Any]] = []
    with ExitStack() as stack:
        env = {w: {"BATCH_WINDOW_MS": f"{w[0]:g}", "BATCH_WINDOW_HIGH_MS": f"{w[1]:g}"} for w in WINDOWS}
        logs = evidence.OUT / "logs" / "stage3"
        servers = {w: stack.enter_context(running_stage("stage3_batching", logs, env[w])) for w in WINDOWS}
        for n in clients:
            for round_ in range(args.rounds):
                for w, server in servers.items():  # every pair once per round, in turns
                    settle(server.pid, server.url)
                    bodies = bodies_for("sentence", 60_000, seed=8000 + 100 * round_ + n)
                    before = _batcher_metrics(server.url)
                    point = load(server.url, bodies, n, args.duration, args.warmup)
                    point.update(medium_ms=w[0], high_ms=w[1], round=round_)
                    after = _batcher_metrics(server.url)
                    if before and after:
                        point.update(batch_delta(before, after))
                    print(json.dumps(point), flush=True)
                    points.append(point)
    rows = []
    for n in clients:
        for medium, high in WINDOWS:
            mine = [p for p in points if (p["clients"], p["medium_ms"], p["high_ms"]) == (n, medium, high)]
            tiers = {t: sum(p["tiers"][t] for p in mine) for t in TIERS}
            rows.append({
                "clients": n, "medium_ms": medium, "high_ms": high,
                **{k: _median([p[k] for p in mine]) for k in ("requests_per_s", "p50_ms", "p99_ms")},
                "average_batch_size": statistics.median(p["average_batch_size"] for p in mine),
                "tier_share": {t: round(tiers[t] / (sum(tiers.values()) or 1), 3) for t in TIERS},
            })  # fmt: skip
    return {"rounds": args.rounds, "points": points, "summary": rows}


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


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


# --- the report ------------------------------------------------------------------------
HTTP_HEAD = ["clients", "req/s", "p50 ms", "p99 ms", "avg batch", "padding"]


def _http_table(points: list[dict[str, Any]], first: str, key: str) -> list[str]:
    return table(
        [first, *HTTP_HEAD],
        [
            (p[key] if key in p else p["stage"], p["clients"], num(p["requests_per_s"]), num(p["p50_ms"]),
             num(p["p99_ms"]), num(p.get("average_batch_size") or None),
             "–" if p.get("padding_ratio") is None else f"{p['padding_ratio']:.0%}")
            for p in points
        ],
    )  # fmt: skip


def _windows_table(rows: list[dict[str, Any]]) -> list[str]:
    best: dict[int, float] = {}
    for row in rows:
        best[row["clients"]] = max(best.get(row["clients"], 0.0), row["requests_per_s"])
    return table(
        ["connections", "window ms, MEDIUM / HIGH", "req/s", "of best", "p50 ms", "p99 ms", "avg batch",
         "batches % LOW / MEDIUM / HIGH"],
        [(r["clients"], f"{r['medium_ms']:g} / {r['high_ms']:g}", num(r["requests_per_s"], 0),
          f"{r['requests_per_s'] / best[r['clients']]:.2f}", num(r["p50_ms"], 1), num(r["p99_ms"], 1),
          num(r["average_batch_size"], 1), " / ".join(f"{100 * r['tier_share'][t]:.0f}" for t in TIERS))
         for r in rows],
        align="rlrrrrrr",
    )  # fmt: skip


def _setting(point: dict[str, Any]) -> str:
    keys = ("group_by_length", "split_by_length", "model_variant")
    return ", ".join(f"{k.upper()}={point[k]}" for k in keys if k in point) or "defaults"


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def markdown(out: dict[str, Any]) -> str:
    e, cores = out["engine"], out["stamp"]["machine"]["logical_cores"]
    call, load = e["call_overhead"], out["load_average"]
    note = (
        f"{out['duration_s']:.0f} s per point; 1-minute load average {load['before']:.1f} before the run"
        f" and {load['after']:.1f} after"
        + (f" (above {cores} before it: other work shared the cores, and the absolute numbers are low)."
           if load["before"] > cores else ".")
    )  # fmt: skip
    summary = out["summary"]
    sections = {
        "engine": [f"Engine alone on the same sentences: **{e['texts_per_s']:.0f} texts/s** at batch "
                   f"{e['best_batch']}, {e.get('best_calls_at_once', 1)} call(s) side by side. "
                   f"One more model call costs about {call['fixed_ms']:.2f} ms of CPU, "
                   f"as much as **{call['tokens']:.0f} padded tokens**."],
        "engine_batches": table(["batch size", *e["by_batch"]],
                                [["texts/s", *(num(v, 0) for v in e["by_batch"].values())]]),
        "targets": _http_table(out["targets"], "stage", "stage"),
        "summary": table(["ratio", "measured", "target", "met"],
                         [(k, f"{v:.2f}", summary["target"][k], "yes" if summary["met"][k] else "**no**")
                          for k, v in summary["measured"].items()], align="lrrl"),
        "batch_size": _http_table(out["batch_size"], "MAX_BATCH_SIZE", "max_batch_size"),
        "windows": _windows_table(out["windows"]["summary"]),
        "concurrency": _http_table(
            [{**p, "setting": f"{p['batch_concurrency']}, {p['batch_window_ms']:g} ms"}
             for p in out.get("concurrency", [])],
            "BATCH_CONCURRENCY, BATCH_WINDOW_MS", "setting"),
        "mixed": _http_table([{**p, "setting": _setting(p)} for p in out["mixed"]], "setting", "setting"),
        "variant": _http_table([{**p, "setting": _setting(p)} for p in out["variant"]], "setting", "setting"),
        "burst": table(["texts", "grouping", "buckets", "batches", "model calls", "padding", "texts/s"],
                       [(b["texts"], _on(b["group_by_length"]), _on(b["split_by_length"]), b["batches"],
                         b["model_calls"], f"{b['padding_ratio']:.0%}", num(b["texts_per_s"]))
                        for b in out["burst"]]),
        "batch_mates": table(["variant", "texts", "min cosine", "mean cosine"],
                             [(v, c["texts"], num(c["min_cosine"], 4), num(c["mean_cosine"], 4))
                              for v, c in out["batch_mates"].items()]),
    }  # fmt: skip
    return page(out["stamp"], sections, note)


def plot(out: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    windows = [{**p, "pair": f"{p['medium_ms']:g} / {p['high_ms']:g}"} for p in out["windows"]["summary"]]
    for ax, points, x_key, label in (
        (axes[0], out["batch_size"], "max_batch_size", "MAX_BATCH_SIZE (32 clients)"),
        (axes[1], windows, "pair", "window ms, MEDIUM / HIGH (32 clients)"),
    ):
        points = [p for p in points if p["clients"] == 32]
        xs = [str(p[x_key]) for p in points]
        ax.bar(xs, [p["requests_per_s"] for p in points], color="#4a7ab0", label="stage 3 req/s")
        ax.axhline(out["engine"]["texts_per_s"], color="#999", linestyle="--", label="engine alone")
        ax.set_xlabel(label)
        ax.set_ylabel("requests/s")
        twin = ax.twinx()
        twin.plot(xs, [p["p99_ms"] for p in points], color="#c0392b", marker="o")
        twin.set_ylabel("p99 latency (ms)", color="#c0392b")
        twin.set_ylim(bottom=0)
        ax.legend(loc="lower right")
    stamp = out["stamp"]
    m = stamp["machine"]
    fig.suptitle(
        f"stage 3, unique sentences: {m['cpu_model']} ({m['logical_cores']} cores), {stamp['date'][:10]}"
    )
    fig.tight_layout()
    save_figure(fig, path, stamp)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, help="Seconds measured per point (default 10).")
    parser.add_argument("--warmup", type=float, help="Seconds of load before each point (default 2).")
    parser.add_argument("--ceiling-seconds", type=float, help="Seconds per batch size for the engine alone.")
    parser.add_argument("--rounds", type=int, help="Rounds of the windows sweep (default 2).")
    parser.add_argument("--port", type=int, default=0, help="Port for the servers (0: a free one each).")
    parser.add_argument("--out", type=Path, help="Folder for the JSON and markdown.")
    parser.add_argument("--img", type=Path, help="Folder for stage3_sweep.png.")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.stage3", args, argv)
    args.duration = args.duration or (2.0 if args.quick else 10.0)
    args.warmup = args.warmup or (0.5 if args.quick else 2.0)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.ceiling_seconds = args.ceiling_seconds or (0.5 if args.quick else 3.0)
    out = {"stamp": {}, **measure(args)}
    out["stamp"] = run.stamp()
    folder, img = args.out or run.results_dir, args.img or run.img_dir
    evidence.write_json(folder / "stage3_sweep.json", out)
    evidence.write_text(folder / "stage3.md", markdown(out))
    plot(out, img / "stage3_sweep.png")
    print(json.dumps(out["summary"], indent=2))
    print(f"wrote {folder}/stage3_sweep.json, {folder}/stage3.md and {img}/stage3_sweep.png")


if __name__ == "__main__":
    main()
