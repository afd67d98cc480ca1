"""Are the layers free? Stages 2 to 5 side by side on all-unique texts, taking turns.

    python -m benchmarks.layers            # about 14 minutes; run it on a quiet machine
    python -m benchmarks.layers --quick    # seconds per point, about a minute
    python -m benchmarks.layers --record   # written to docs/results/layers.*
    make bench-layers                      # the same (QUICK=1, RECORD=1)

Batching, the cache and the metrics cannot help a stream of texts the server has never seen:
every text must reach the model. On that traffic a later stage should cost close to nothing
over stage 2's thread pool, and batching should still gain a little (one thread hop per batch
instead of one per request). This experiment measures exactly that:

* the four servers run at once with their default settings, and take turns under the same
  closed-loop load (A B C, A B C, ... and the medians), so a drift of the machine hits all alike;
* at 1, 32 and 128 connections of ``wrk`` (the kit's C load generator: the Python one would take
  a third of a core from the server), one new 12-20 word sentence per request;
* per point: requests/s, p50 and p99, the server's CPU in cores (of the machine's two), where a
  request's CPU went (the event loop's thread, every other thread) and, for the stages with a
  batcher, the share of the interval each model slot spent computing;
* the engine alone on the same kind of texts (tokenize, model, normalize; no HTTP) is the
  yardstick: how close each stage gets to what the model can do on this machine.

Writes layers.json and layers.md (the ratio table the stage 3 and stage 5 chapters include).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.compare import engine_ceiling
from benchmarks.stage3 import bodies_for
from loadtests import evidence, wrk
from loadtests.harness import process_cpu, settle
from loadtests.procs import running_stage
from loadtests.tables import num, page, stage_label, table

STAGES = ("stage2_threadpool", "stage3_batching", "stage4_cache_backpressure", "stage5_metrics")


def _loop_cpu(process: psutil.Process) -> float:
    """CPU seconds of the process's main thread: uvicorn's event loop (the rest is the model
    threads, the tokenizer's and the log writer's)."""
    return next((t.user_time + t.system_time for t in process.threads() if t.id == process.pid), 0.0)


def _slots_busy(url: str) -> dict[str, float]:
    """Seconds each model slot has computed so far (stages with a batcher), else nothing."""
    try:
        return dict(httpx.get(f"{url}/v1/batcher/metrics", timeout=10).json()["slot_busy_s"])
    except (httpx.HTTPError, KeyError, ValueError):
        return {}


def measure_point(server: Any, clients: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One measured interval after a warm-up: throughput, latency, the server's cores, slot use."""
    bodies = bodies_for("sentence", 60_000 if clients > 1 else 10_000, seed=seed)  # never seen before
    wrk.run(server.url, bodies[::-1], clients, args.warmup)  # warm-up on other texts
    process = psutil.Process(server.pid)
    cpu, loop, busy = process_cpu(process), _loop_cpu(process), _slots_busy(server.url)
    point = wrk.run(server.url, bodies, clients, args.duration)
    cpu, loop = process_cpu(process) - cpu, _loop_cpu(process) - loop
    point["server_cores"] = round(cpu / args.duration, 2)
    answered = point["requests_per_s"] * args.duration
    if answered:  # where a request's CPU goes: the event loop, or every other thread
        point["loop_cpu_ms"] = round(loop / answered * 1e3, 3)
        point["other_cpu_ms"] = round((cpu - loop) / answered * 1e3, 3)
    after = _slots_busy(server.url)
    if after:  # the share of the interval each model slot spent computing
        point["slot_utilisation"] = {
            s: round((after[s] - busy.get(s, 0.0)) / args.duration, 3) for s in sorted(after)
        }
    return point


def in_turns(
    servers: Mapping[str, Any], clients: int, args: argparse.Namespace, seed: int = 9000
) -> list[dict[str, Any]]:
    """The running ``servers`` measured in turns (A B C, A B C: every stage once per round,
    ``args.rounds`` rounds) at ``clients`` connections; every point, with its stage and round."""
    points: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for stage, server in servers.items():
            settle(server.pid, server.url)
            point = measure_point(server, clients, seed=seed + 100 * round_ + clients, args=args)
            point.update(stage=stage, round=round_)
            print(json.dumps(point), flush=True)
            points.append(point)
    return points


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with ExitStack() as stack:
        logs = evidence.OUT / "logs" / "layers"
        servers = {stage: stack.enter_context(running_stage(stage, logs)) for stage in args.stages}
        points = [p for clients in args.clients for p in in_turns(servers, clients, args)]
    print("the engine alone ...", flush=True)
    ceiling = engine_ceiling(["sentence"], args.ceiling_seconds)["sentence"]
    return {
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "rounds": args.rounds,
        "clients": list(args.clients),
        "stages": list(args.stages),
        "points": points,
        "ceiling": ceiling,
        "summary": summarize(points, args.stages, args.clients, ceiling["texts_per_s"]),
    }


def summarize(
    points: list[dict[str, Any]], stages: Sequence[str], clients: Sequence[int], ceiling: float
) -> dict[str, Any]:
    """Medians over the rounds per (clients, stage), and each stage against stage 2 and the engine."""
    out: dict[str, Any] = {}
    for n in clients:
        row: dict[str, Any] = {}
        for stage in stages:
            mine = [p for p in points if p["connections"] == n and p["stage"] == stage]
            row[stage] = {
                key: statistics.median(p[key] for p in mine)
                for key in (
                    "requests_per_s",
                    "p50_ms",
                    "p99_ms",
                    "server_cores",
                    "loop_cpu_ms",
                    "other_cpu_ms",
                )
                if mine and all(p.get(key) is not None for p in mine)
            }
            row[stage]["errors"] = sum(p["socket_errors"] + round(p["non_2xx_per_s"]) for p in mine)
            slots = [p["slot_utilisation"] for p in mine if p.get("slot_utilisation")]
            if slots:
                row[stage]["slot_utilisation"] = {
                    s: statistics.median(u.get(s, 0.0) for u in slots) for s in sorted(slots[0])
                }
            row[stage]["of_ceiling"] = round(row[stage]["requests_per_s"] / ceiling, 4)
        base = row.get(stages[0])
        for stage in stages[1:]:
            mine = row[stage]
            mine["over_first"] = round(mine["requests_per_s"] / base["requests_per_s"], 4) if base else None
            if base and base.get("p50_ms"):
                mine["p50_over_first"] = round(mine["p50_ms"] / base["p50_ms"], 4)
        out[str(n)] = row
    return out


def markdown(result: dict[str, Any]) -> str:
    stages = result["stages"]
    note = (
        f"Closed loop, one new sentence per request, {result['duration_s']:g} s per point, median of"
        f" {result['rounds']} rounds taken in turns; the engine alone does"
        f" {result['ceiling']['texts_per_s']:.0f} texts/s on the same kind of texts"
        f" (batch {result['ceiling']['best_batch']}, {result['ceiling']['best_calls_at_once']} calls side"
        " by side)."
    )
    headers = ["connections"]
    for stage in stages:
        headers += [f"{stage_label(stage)} req/s"]
    headers += [f"{stage_label(s)} / {stage_label(stages[0])}" for s in stages[1:]]
    headers += [f"{stage_label(stages[-1])} of engine"]
    rows = []
    for n, row in result["summary"].items():
        cells: list[str] = [n]
        cells += [num(row[s]["requests_per_s"], 0) for s in stages]
        cells += [f"{row[s]['over_first']:.2f}×" for s in stages[1:]]
        cells += [f"{100 * row[stages[-1]]['of_ceiling']:.0f} %"]
        rows.append(cells)
    ratios = table(headers, rows, align="r" * len(headers))
    detail_rows = []
    for n, row in result["summary"].items():
        for s in stages:
            m = row[s]
            detail_rows.append((
                n, stage_label(s), num(m.get("p50_ms"), 1), num(m.get("p99_ms"), 1),
                num(m.get("server_cores"), 2), num(m.get("loop_cpu_ms"), 2), num(m.get("other_cpu_ms"), 2),
                " / ".join(f"{100 * u:.0f} %" for u in m.get("slot_utilisation", {}).values()) or "-",
                m["errors"],
            ))  # fmt: skip
    detail = table(
        [
            "connections",
            "stage",
            "p50 ms",
            "p99 ms",
            "server cores",
            "loop CPU ms/req",
            "other CPU ms/req",
            "model slots busy",
            "errors",
        ],
        detail_rows,
        align="rlrrrrrrr",
    )
    return page(result["stamp"], {"ratios": ratios, "detail": detail}, note) + "\n"


def headline(result: dict[str, Any]) -> dict[str, float]:
    out = {}
    for n, row in result["summary"].items():
        for stage in result["stages"]:
            out[f"{n} connections: {stage_label(stage)} req/s"] = row[stage]["requests_per_s"]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, help="Seconds measured per point (default 10).")
    parser.add_argument("--warmup", type=float, help="Seconds of load before each point (default 2).")
    parser.add_argument(
        "--rounds",
        type=int,
        help="Rounds per connection count (default 5: the machine drifts by more than a layer costs).",
    )
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--stages", nargs="+", default=list(STAGES))
    parser.add_argument("--ceiling-seconds", type=float, help="Seconds per batch size for the engine.")
    parser.add_argument("--out", type=Path, help="Folder for layers.json and .md.")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.layers", args, argv)
    args.duration = args.duration or (2.0 if args.quick else 10.0)
    args.warmup = args.warmup or (0.5 if args.quick else 2.0)
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.ceiling_seconds = args.ceiling_seconds or (0.3 if args.quick else 2.0)
    result = {"stamp": {}, **measure(args)}
    result["stamp"] = run.stamp()
    evidence.publish(run, args.out, "layers", result, markdown, headline)


if __name__ == "__main__":
    main()
