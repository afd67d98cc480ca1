"""How long should a batch wait? Stage 3's load tiers with their windows, swept at 8, 32 and 128 connections.

    python -m benchmarks.windows            # about 8 minutes; run it on a quiet machine (needs wrk)
    python -m benchmarks.windows --quick    # seconds per point
    python -m benchmarks.windows --record   # written to docs/results/windows.*
    make bench-windows                      # the same (QUICK=1, RECORD=1)

A batch that waits for company costs every request in it the wait; it pays only if the fuller
batch runs enough faster per text. The load tiers decide who waits: a LOW-tier batch (fewer than
BATCH_LOW_THRESHOLD texts queued) never does, a MEDIUM one waits up to BATCH_WINDOW_MS and a HIGH
one (BATCH_HIGH_THRESHOLD texts or more) up to BATCH_WINDOW_HIGH_MS. Each pair of windows here is a
stage 3 server; they all run at once and take turns under the same closed loop of ``wrk``
connections, one new sentence per request. 50 ms for both is the window many servers ship with.

Per point: requests/s, p50 and p99, the average batch, and the share of batches each tier formed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from benchmarks.stage3 import bodies_for
from loadtests import evidence, wrk
from loadtests.harness import settle
from loadtests.procs import running_stage
from loadtests.tables import num, page, table

STAGE = "stage3_batching"
# (MEDIUM, HIGH) windows in ms; the first is the default, the last the common choice elsewhere.
WINDOWS = ((0.0, 0.0), (0.0, 2.0), (2.0, 2.0), (0.0, 5.0), (5.0, 5.0), (50.0, 50.0))
TIERS = ("low", "medium", "high")


def _env(medium: float, high: float) -> dict[str, str]:
    return {"BATCH_WINDOW_MS": f"{medium:g}", "BATCH_WINDOW_HIGH_MS": f"{high:g}"}


def _batches(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/v1/batcher/metrics", timeout=10).json())


def _point(server: Any, clients: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    bodies = bodies_for("sentence", 60_000, seed=seed)
    wrk.run(server.url, bodies[::-1], clients, args.warmup)
    before = _batches(server.url)
    point = wrk.run(server.url, bodies, clients, args.duration)
    after = _batches(server.url)
    batches = after["batches"] - before["batches"]
    point["average_batch"] = round((after["texts"] - before["texts"]) / batches, 2) if batches else None
    point["tiers"] = {t: after["tiers"][t] - before["tiers"][t] for t in TIERS}
    return point


def measure(args: argparse.Namespace) -> dict[str, Any]:
    points: list[dict[str, Any]] = []
    with ExitStack() as stack:
        logs = evidence.OUT / "logs" / "windows"
        servers = {w: stack.enter_context(running_stage(STAGE, logs, _env(*w))) for w in args.windows}
        for clients in args.clients:
            for round_ in range(args.rounds):
                for w in args.windows:  # every pair of windows once per round, in turns
                    settle(servers[w].pid, servers[w].url)
                    point = _point(servers[w], clients, 8000 + 100 * round_ + clients, args)
                    point.update(medium_ms=w[0], high_ms=w[1], round=round_)
                    print(json.dumps(point), flush=True)
                    points.append(point)
    return {
        "duration_s": args.duration,
        "rounds": args.rounds,
        "clients": list(args.clients),
        "windows": [list(w) for w in args.windows],
        "points": points,
        "summary": summarize(points),
    }


def summarize(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(p["connections"], p["medium_ms"], p["high_ms"]) for p in points})
    for n, medium, high in keys:
        mine = [p for p in points if (p["connections"], p["medium_ms"], p["high_ms"]) == (n, medium, high)]
        tiers = {t: sum(p["tiers"][t] for p in mine) for t in TIERS}
        total = sum(tiers.values()) or 1
        rows.append({
            "connections": n, "medium_ms": medium, "high_ms": high,
            **{k: statistics.median(p[k] for p in mine) for k in ("requests_per_s", "p50_ms", "p99_ms")},
            "average_batch": statistics.median(p["average_batch"] or 0 for p in mine),
            "tier_share": {t: round(tiers[t] / total, 3) for t in TIERS},
        })  # fmt: skip
    return rows


def markdown(result: dict[str, Any]) -> str:
    note = (
        f"Stage 3, wrk connections, one new sentence per request, {result['duration_s']:g} s per point,"
        f" median of {result['rounds']} rounds taken in turns; every other setting at its default."
    )
    best: dict[int, float] = {}
    for row in result["summary"]:
        best[row["connections"]] = max(best.get(row["connections"], 0.0), row["requests_per_s"])
    rows = []
    for row in result["summary"]:
        share = row["tier_share"]
        rows.append((
            row["connections"], f"{row['medium_ms']:g} / {row['high_ms']:g}", num(row["requests_per_s"], 0),
            f"{row['requests_per_s'] / best[row['connections']]:.2f}", num(row["p50_ms"], 1),
            num(row["p99_ms"], 1), num(row["average_batch"], 1),
            " / ".join(f"{100 * share[t]:.0f}" for t in TIERS),
        ))  # fmt: skip
    windows = table(
        ["connections", "window ms, MEDIUM / HIGH", "req/s", "of best", "p50 ms", "p99 ms", "avg batch",
         "batches % LOW / MEDIUM / HIGH"],
        rows, align="rlrrrrrr",
    )  # fmt: skip
    return page(result["stamp"], {"windows": windows}, note) + "\n"


def headline(result: dict[str, Any]) -> dict[str, float]:
    return {
        f"{r['connections']} conns, {r['medium_ms']:g}/{r['high_ms']:g} ms: req/s": r["requests_per_s"]
        for r in result["summary"]
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, help="Seconds measured per point (default 8).")
    parser.add_argument("--warmup", type=float, help="Seconds of load before each point (default 2).")
    parser.add_argument("--rounds", type=int, help="Rounds per connection count (default 2).")
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--out", type=Path, help="Folder for windows.json and .md.")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.windows", args, argv)
    args.duration = args.duration or (1.0 if args.quick else 8.0)
    args.warmup = args.warmup or (1.0 if args.quick else 2.0)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.windows = WINDOWS
    result = {"stamp": {}, **measure(args)}
    result["stamp"] = run.stamp()
    evidence.publish(run, args.out, "windows", result, markdown, headline)


if __name__ == "__main__":
    main()
