"""What watching costs: stage 5 against stage 4, same machine, same texts, same run.

    python -m benchmarks.stage5            # about 4 minutes; run it on a quiet machine
    python -m benchmarks.stage5 --quick    # seconds per point, about a minute
    python -m benchmarks.stage5 --record   # written to docs/results/stage5_overhead.*
    make stage5-overhead                   # the same (QUICK=1, RECORD=1)

Both servers run side by side with their default settings (stage 5 writes its JSON request
log, as in production) and take turns, in ABBA order so a drift of the machine hits both
alike. Two workloads:

* ``unique``: a new sentence per request, so every text goes through the batcher and the
  model: per-request and per-batch instrumentation on a path of a few milliseconds;
* ``cached``: a few hundred sentences over and over, all answered from the memory cache:
  the cheapest request there is, where a per-request cost weighs the most.

First, ``overhead_asgi`` measures the same thing without sockets: both apps in one process,
one cached request at a time, in CPU time of the event loop's thread.

Writes stage5_overhead.json and stage5_overhead.md (the tables the stage 5 chapter includes).
The target: stage 5 within 5 % of stage 4's throughput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil

from benchmarks.stage3 import bodies_for, load
from loadtests import evidence
from loadtests.harness import process_cpu, settle
from loadtests.procs import REPO, running_stage, server_env
from loadtests.tables import num, page, table

STAGES = ("stage4_cache_backpressure", "stage5_metrics")
TARGET = 0.95  # stage 5 keeps at least 95 % of stage 4's requests/s


def _bodies(workload: str, round_: int) -> list[bytes]:
    if workload == "unique":
        return bodies_for("sentence", 20_000, seed=500 + round_)  # new texts every round
    return bodies_for("sentence", 300, seed=499)  # the same few hundred: cache hits after warm-up


def _point(pid: int, port: int, bodies: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    """One measured interval after a warm-up, with the server's CPU time per request.

    Throughput counts wall time, which other programs on the machine take too; CPU time per
    request counts only the server's own work, so it is recorded next to it.
    """
    load(port, bodies[::-1], args.clients, args.warmup, warmup=0.001)  # warm-up, other texts
    server = psutil.Process(pid)
    cpu = process_cpu(server)
    point = load(port, bodies, args.clients, args.duration, warmup=0.001)
    answered = point["requests_per_s"] * args.duration
    point["server_cpu_ms_per_request"] = (process_cpu(server) - cpu) * 1e3 / answered if answered else None
    return point


def in_process(quick: bool) -> dict[str, Any]:
    """``overhead_asgi`` in its own process: both apps, one cached request at a time, no sockets."""
    blocks = ["--blocks", "6", "--per-block", "200"] if quick else ["--blocks", "30", "--per-block", "500"]
    command = [sys.executable, "-m", "benchmarks.stage5_asgi", *blocks]
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, check=True, env=server_env("", 0)
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    print("in-process cost per cached request ...", flush=True)
    asgi = in_process(args.quick)
    print(json.dumps(asgi), flush=True)
    points: list[dict[str, Any]] = []
    with ExitStack() as stack:
        logs = evidence.OUT / "logs" / "stage5"
        servers = {stage: stack.enter_context(running_stage(stage, logs)) for stage in STAGES}
        for workload in args.workloads:
            for round_ in range(args.rounds):
                order = STAGES if round_ % 2 == 0 else STAGES[::-1]  # ABBA
                for stage in order:
                    server = servers[stage]
                    settle(server.pid, server.url)
                    point = _point(server.pid, server.port, _bodies(workload, round_), args)
                    point.update(stage=stage, workload=workload, round=round_)
                    print(json.dumps(point), flush=True)
                    points.append(point)
    return {
        "clients": args.clients,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "rounds": args.rounds,
        "points": points,
        "summary": summarize(points, args.workloads),
        "in_process": asgi,
    }


def summarize(points: list[dict[str, Any]], workloads: Sequence[str]) -> dict[str, Any]:
    """Medians over the rounds, and stage 5's throughput as a share of stage 4's."""
    out: dict[str, Any] = {}
    for workload in workloads:
        row: dict[str, Any] = {}
        for stage in STAGES:
            mine = [p for p in points if p["workload"] == workload and p["stage"] == stage]
            row[stage] = {
                key: statistics.median(p[key] for p in mine)
                for key in ("requests_per_s", "p50_ms", "p99_ms", "server_cpu_ms_per_request")
                if all(p[key] is not None for p in mine)
            }
            row[stage]["errors"] = sum(p["errors"] for p in mine)
        ratio = row[STAGES[1]]["requests_per_s"] / row[STAGES[0]]["requests_per_s"]
        row["stage5_over_stage4"] = round(ratio, 4)
        cpu4 = row[STAGES[0]].get("server_cpu_ms_per_request")
        cpu5 = row[STAGES[1]].get("server_cpu_ms_per_request")
        row["cpu_per_request_stage5_over_stage4"] = round(cpu5 / cpu4, 4) if cpu4 and cpu5 else None
        row["within_target"] = ratio >= TARGET
        out[workload] = row
    return out


def markdown(result: dict[str, Any]) -> str:
    """stage5_overhead.md: over sockets (``overhead``) and in process (``in_process``)."""
    note = (
        f"{result['clients']} clients, {result['duration_s']:g} s per point,"
        f" median of {result['rounds']} rounds in ABBA order."
    )
    rows = []
    for workload, row in result["summary"].items():
        s4, s5 = row[STAGES[0]], row[STAGES[1]]
        rows.append((
            workload, num(s4["requests_per_s"], 0), num(s5["requests_per_s"], 0),
            f"{100 * row['stage5_over_stage4']:.1f} %",
            f"{s4.get('p50_ms', 0):.1f} / {s4.get('p99_ms', 0):.1f}",
            f"{s5.get('p50_ms', 0):.1f} / {s5.get('p99_ms', 0):.1f}",
            f"{s4.get('server_cpu_ms_per_request', 0):.2f} / {s5.get('server_cpu_ms_per_request', 0):.2f}",
            "yes" if row["within_target"] else "no",
        ))  # fmt: skip
    overhead = table(
        ["workload", "stage 4 req/s", "stage 5 req/s", "5 / 4", "p50 / p99 ms, stage 4",
         "p50 / p99 ms, stage 5", "server CPU ms per request, 4 / 5", "≥ 95 %"],
        rows, align="lrrrrrrc",
    )  # fmt: skip
    a = result["in_process"]
    us = a["us_per_request"]
    in_process = [
        *table(
            ["one cached request, in process (CPU µs)", "stage 4", "stage 5", "added", "stage 5 / stage 4"],
            [(f"median of {a['blocks']} blocks of {a['requests_per_block']}", num(us[STAGES[0]]),
              num(us[STAGES[1]]), num(a["added_us_per_request"]), f"{100 * a['stage5_over_stage4']:.1f} %")],
        ),
        "",
        *table(["of which", "CPU µs per request"], [(part, num(v)) for part, v in a["parts_us"].items()]),
    ]  # fmt: skip
    return page(result["stamp"], {"overhead": overhead, "in_process": in_process}, note) + "\n"


def headline(result: dict[str, Any]) -> dict[str, float]:
    out = {}
    for workload, row in result["summary"].items():
        out[f"{workload}: stage 5 req/s"] = row[STAGES[1]]["requests_per_s"]
        out[f"{workload}: stage 5 / stage 4"] = row["stage5_over_stage4"]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, help="Seconds measured per point (default 10).")
    parser.add_argument("--warmup", type=float, help="Seconds of load before each point (default 2).")
    parser.add_argument("--rounds", type=int, help="Rounds per workload (default 4, ABBA).")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--workloads", nargs="+", default=["unique", "cached"], choices=["unique", "cached"])
    parser.add_argument("--out", type=Path, help="Folder for stage5_overhead.json and .md.")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.stage5", args, argv)
    args.duration = args.duration or (2.0 if args.quick else 10.0)
    args.warmup = args.warmup or (0.5 if args.quick else 2.0)
    args.rounds = args.rounds or (2 if args.quick else 4)
    result = {"stamp": {}, **measure(args)}
    result["stamp"] = run.stamp()
    evidence.publish(run, args.out, "stage5_overhead", result, markdown, headline)


if __name__ == "__main__":
    main()
