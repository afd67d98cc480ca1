"""What watching costs: stage 5 against stage 4, same machine, same texts, same run.

    python -m benchmarks.stage5            # about 3 minutes; run it on a quiet machine
    python -m benchmarks.stage5 --quick    # seconds per point, to see that it all runs
    make stage5-overhead                         # the same (QUICK=1 for the short one)

Both servers run side by side with their default settings (stage 5 writes its JSON request
log, as in production) and take turns, in ABBA order so a drift of the machine hits both
alike. Two workloads:

* ``unique``: a new sentence per request, so every text goes through the batcher and the
  model: per-request and per-batch instrumentation on a path of a few milliseconds;
* ``cached``: a few hundred sentences over and over, all answered from the memory cache:
  the cheapest request there is, where a per-request cost weighs the most.

First, ``overhead_asgi`` measures the same thing without sockets: both apps in one process,
one cached request at a time, in CPU time of the event loop's thread.

Writes docs/results/stage5_overhead.json and docs/results/stage5_overhead.md (the tables the
stage 5 chapter includes). The target: stage 5 within 5 % of stage 4's throughput.
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
from loadtests.harness import REPO, process_cpu, running_stage, server_env, settle
from loadtests.machine import machine_info
from loadtests.procs import free_port

RESULTS = REPO / "docs" / "results" / "stage5_overhead.json"
TABLE = REPO / "docs" / "results" / "stage5_overhead.md"
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
        servers = {}
        for stage in STAGES:
            port = free_port()
            log = REPO / ".benchmarks" / f"overhead-{stage}-{port}.log"
            servers[stage] = (stack.enter_context(running_stage(stage, "127.0.0.1", port, log)), port)
        for workload in args.workloads:
            for round_ in range(args.rounds):
                order = STAGES if round_ % 2 == 0 else STAGES[::-1]  # ABBA
                for stage in order:
                    process, port = servers[stage]
                    settle(process.pid, f"http://127.0.0.1:{port}")
                    point = _point(process.pid, port, _bodies(workload, round_), args)
                    point.update(stage=stage, workload=workload, round=round_)
                    print(json.dumps(point), flush=True)
                    points.append(point)
    return {
        "machine": machine_info(),
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


def table(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "<!-- generated by `make stage5-overhead`; do not edit -->",
        "<!-- --8<-- [start:machine] -->",
        f"Measured by `make stage5-overhead` on {m['cpu']} ({m['cores']} cores, {m['memory_gib']} GiB), "
        f"{m['date']}: {result['clients']} clients, {result['duration_s']:g} s per point, "
        f"median of {result['rounds']} rounds in ABBA order.",
        "<!-- --8<-- [end:machine] -->",
        "",
        "<!-- --8<-- [start:overhead] -->",
        "| workload | stage 4 req/s | stage 5 req/s | stage 5 / stage 4 | stage 4 p50 / p99 ms "
        "| stage 5 p50 / p99 ms | server CPU ms per request, 4 / 5 | at least 95 % of stage 4 |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for workload, row in result["summary"].items():
        s4, s5 = row[STAGES[0]], row[STAGES[1]]
        lines.append(
            f"| {workload} | {s4['requests_per_s']:.0f} | {s5['requests_per_s']:.0f} "
            f"| {100 * row['stage5_over_stage4']:.1f} % "
            f"| {s4.get('p50_ms', 0):.1f} / {s4.get('p99_ms', 0):.1f} "
            f"| {s5.get('p50_ms', 0):.1f} / {s5.get('p99_ms', 0):.1f} "
            f"| {s4.get('server_cpu_ms_per_request', 0):.2f} / {s5.get('server_cpu_ms_per_request', 0):.2f} "
            f"| {'yes' if row['within_target'] else 'no'} |"
        )
    lines.append("<!-- --8<-- [end:overhead] -->")
    a = result["in_process"]
    us = a["us_per_request"]
    lines += [
        "",
        "<!-- --8<-- [start:in_process] -->",
        "| one cached request, in process (CPU µs) | stage 4 | stage 5 | added | stage 5 / stage 4 |",
        "|---|---:|---:|---:|---:|",
        f"| median of {a['blocks']} blocks of {a['requests_per_block']} "
        f"| {us[STAGES[0]]:.1f} | {us[STAGES[1]]:.1f} | {a['added_us_per_request']:.1f} "
        f"| {100 * a['stage5_over_stage4']:.1f} % |",
        "",
        "| of which | CPU µs per request |",
        "|---|---:|",
        *[f"| {part} | {us_:.1f} |" for part, us_ in a["parts_us"].items()],
        "<!-- --8<-- [end:in_process] -->",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 s per point, 2 rounds: check that it runs.")
    parser.add_argument("--duration", type=float, help="Seconds measured per point (default 10).")
    parser.add_argument("--warmup", type=float, help="Seconds of load before each point (default 2).")
    parser.add_argument("--rounds", type=int, help="Rounds per workload (default 4, ABBA).")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--workloads", nargs="+", default=["unique", "cached"], choices=["unique", "cached"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--table", type=Path, default=TABLE)
    args = parser.parse_args(argv)
    args.duration = args.duration or (2.0 if args.quick else 10.0)
    args.warmup = args.warmup or (0.5 if args.quick else 2.0)
    args.rounds = args.rounds or (2 if args.quick else 4)
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.table.write_text(table(result))
    print(table(result))
    print(f"wrote {args.out} and {args.table}")


if __name__ == "__main__":
    main()
