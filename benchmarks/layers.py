"""What does a layer cost a request? Stages 1 to 5 side by side on all-unique texts, in turns.

    python -m benchmarks.layers            # about 12 minutes; run it on a quiet machine
    python -m benchmarks.layers --quick    # seconds per point, about two minutes
    python -m benchmarks.layers --record   # written to docs/results/layers.*
    make results ONLY=layers                      # the same (QUICK=1, RECORD=1)

Each stage adds one layer to the one before: the thread pool (2), batching (3), the cache and
the bounded queue (4), metrics and request logs (5). On a stream of texts the server has never
seen every text must reach the model, so a cache or a counter can only cost; this experiment
says how much, stage against stage:

* the real servers, started as ``make stageN`` starts them with their default settings, all
  running at once and taking turns under the same closed-loop load (A B C D E, A B C D E, ...,
  then the medians), so a drift of the shared machine hits every stage alike;
* ``wrk`` at 1, 32 and 128 connections, one new 12-20 word sentence per request;
* per point: requests/s, p50 and p99, the server's CPU a request (all of it, and the event
  loop's thread alone) and, for the stages with a batcher, the share of the interval each
  model slot spent computing;
* the engine alone on the same kind of texts (tokenize, model, normalize; no HTTP) is the
  yardstick: its best texts/s, and its CPU a text one text a call (what stages 1 and 2 ask).

Writes layers.json and layers.md: one table a chapter (``stage2`` .. ``stage5``: each stage
against the one before it) and every stage at once (``all``, ``detail``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.compare import CEILING_SEED, _texts_per_s, engine_ceiling
from benchmarks.stage3 import bodies_for
from common import corpus
from common.engine import Engine
from common.serve import STAGES
from common.settings import Settings
from loadtests import evidence, load
from loadtests.load import process_cpu, settle
from loadtests.procs import running_stage
from loadtests.tables import num, page, stage_label, table

MEDIANS = ("requests_per_s", "p50_ms", "p99_ms", "server_cores", "cpu_ms", "loop_cpu_ms")


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
    """One measured interval after a warm-up: throughput, latency, the server's CPU, slot use."""
    bodies = bodies_for("sentence", 60_000 if clients > 1 else 10_000, seed=seed)  # never seen before
    load.wrk(server.url, bodies[::-1], clients, args.warmup)  # warm-up on other texts
    process = psutil.Process(server.pid)
    cpu, loop, busy = process_cpu(process), _loop_cpu(process), _slots_busy(server.url)
    point = load.wrk(server.url, bodies, clients, args.duration)
    cpu, loop = process_cpu(process) - cpu, _loop_cpu(process) - loop
    point["server_cores"] = round(cpu / args.duration, 2)
    answered = point["requests_per_s"] * args.duration
    if answered:
        point["cpu_ms"] = round(cpu / answered * 1e3, 3)
        point["loop_cpu_ms"] = round(loop / answered * 1e3, 3)
    after = _slots_busy(server.url)
    if after:  # the share of the interval each model slot spent computing
        point["slot_utilisation"] = {
            s: round((after[s] - busy.get(s, 0.0)) / args.duration, 3) for s in sorted(after)
        }
    return point


def in_turns(
    servers: Mapping[str, Any], clients: int, args: argparse.Namespace, seed: int = 9000
) -> list[dict[str, Any]]:
    """The running ``servers`` measured in turns (every stage once per round, ``args.rounds``
    rounds) at ``clients`` connections; every point, with its stage and round."""
    points: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for stage, server in servers.items():
            settle(server.pid, server.url)
            point = measure_point(server, clients, seed=seed + 1000 * round_ + clients, args=args)
            point.update(stage=stage, round=round_)
            print(json.dumps(point), flush=True)
            points.append(point)
    return points


def engine_alone(seconds: float) -> dict[str, Any]:
    """The yardstick: the engine's best texts/s (any batch, any layout), and its CPU a text
    when each call embeds one text on two calls side by side (stage 2's way)."""
    best = engine_ceiling(["sentence"], seconds)["sentence"]
    engine = Engine.from_settings(Settings(), calls_at_once=2)
    engine.warmup()
    texts = corpus.texts(2048, seed=CEILING_SEED, kind="sentence")
    cpu, wall = time.process_time(), time.perf_counter()
    rate = _texts_per_s(engine, texts, 1, 2, seconds)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {**best, "one_text_cpu_ms": round(cpu / (rate * wall) * 1e3, 3), "one_text_per_s": rate}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with ExitStack() as stack:
        logs = evidence.OUT / "logs" / "layers"
        servers = {stage: stack.enter_context(running_stage(stage, logs)) for stage in args.stages}
        points = [p for clients in args.clients for p in in_turns(servers, clients, args)]
    print("the engine alone ...", flush=True)
    engine = engine_alone(args.ceiling_seconds)
    return {
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "rounds": args.rounds,
        "clients": list(args.clients),
        "stages": list(args.stages),
        "points": points,
        "ceiling": engine,
        "summary": summarize(points, args.stages, args.clients, engine["texts_per_s"]),
    }


def summarize(
    points: list[dict[str, Any]], stages: Sequence[str], clients: Sequence[int], ceiling: float
) -> dict[str, Any]:
    """Medians over the rounds per (clients, stage); each stage against the one before it."""
    out: dict[str, Any] = {}
    for n in clients:
        row: dict[str, Any] = {}
        for stage in stages:
            mine = [p for p in points if p["connections"] == n and p["stage"] == stage]
            m = {
                k: statistics.median(p[k] for p in mine)
                for k in MEDIANS
                if mine and all(p.get(k) is not None for p in mine)
            }
            m["errors"] = sum(p["socket_errors"] + round(p["non_2xx_per_s"]) for p in mine)
            slots = [p["slot_utilisation"] for p in mine if p.get("slot_utilisation")]
            if slots:
                m["slot_utilisation"] = {
                    s: statistics.median(u.get(s, 0.0) for u in slots) for s in sorted(slots[0])
                }
            m["of_ceiling"] = round(m["requests_per_s"] / ceiling, 4)
            row[stage] = m
        for before, stage in itertools.pairwise(stages):
            mine, base = row[stage], row[before]
            mine["over_previous"] = round(mine["requests_per_s"] / base["requests_per_s"], 4)
            if "cpu_ms" in mine and "cpu_ms" in base:
                mine["cpu_ms_added"] = round(mine["cpu_ms"] - base["cpu_ms"], 3)
        out[str(n)] = row
    return out


def _pair(a: float | None, b: float | None, digits: int) -> str:
    return f"{num(a, digits)} / {num(b, digits)}"


def step_table(result: dict[str, Any], before: str, stage: str) -> list[str]:
    """``stage`` against ``before`` at every connection count: the chapter's own table."""
    a, b = stage_label(before).removeprefix("stage "), stage_label(stage).removeprefix("stage ")
    rows = []
    for n, row in result["summary"].items():
        x, y = row[before], row[stage]
        rows.append((
            n, num(x["requests_per_s"], 0), num(y["requests_per_s"], 0), f"{y['over_previous']:.2f}×",
            _pair(x.get("p50_ms"), y.get("p50_ms"), 1), _pair(x.get("p99_ms"), y.get("p99_ms"), 1),
            _pair(x.get("cpu_ms"), y.get("cpu_ms"), 2), num(y.get("cpu_ms_added"), 2),
        ))  # fmt: skip
    headers = [
        "connections",
        f"stage {a} req/s",
        f"stage {b} req/s",
        f"{b} / {a}",
        f"p50 ms, {a} / {b}",
        f"p99 ms, {a} / {b}",
        f"server CPU ms a request, {a} / {b}",
        "CPU ms added",
    ]
    return table(headers, rows, align="r" * len(headers))


def markdown(result: dict[str, Any]) -> str:
    stages, engine = result["stages"], result["ceiling"]
    calls = engine["best_calls_at_once"]
    note = (
        f"Closed loop (`wrk`), one new sentence per request, {result['duration_s']:g} s per point, median of"
        f" {result['rounds']} rounds taken in turns. The engine alone, no HTTP: {engine['texts_per_s']:.0f}"
        f" texts/s at its best (batch {engine['best_batch']}, {calls} call{'s' * (calls > 1)} at once);"
        f" one text a call, {engine['one_text_cpu_ms']:.2f} ms of CPU a text."
    )
    sections = {
        f"stage{stage_label(s).removeprefix('stage ')}": step_table(result, b, s)
        for b, s in itertools.pairwise(stages)
    }
    last = stages[-1]
    headers = ["connections", *(f"{stage_label(s)} req/s" for s in stages), f"{stage_label(last)} of engine"]
    rows = [
        [n, *(num(row[s]["requests_per_s"], 0) for s in stages), f"{100 * row[last]['of_ceiling']:.0f} %"]
        for n, row in result["summary"].items()
    ]
    sections["all"] = table(headers, rows, align="r" * len(headers))
    detail = []
    for n, row in result["summary"].items():
        for s in stages:
            m = row[s]
            detail.append((
                n, stage_label(s), num(m.get("p50_ms"), 1), num(m.get("p99_ms"), 1),
                num(m.get("server_cores"), 2), num(m.get("cpu_ms"), 2), num(m.get("loop_cpu_ms"), 2),
                " / ".join(f"{100 * u:.0f} %" for u in m.get("slot_utilisation", {}).values()) or "-",
                m["errors"],
            ))  # fmt: skip
    sections["detail"] = table(
        ["connections", "stage", "p50 ms", "p99 ms", "server cores", "CPU ms/req", "loop CPU ms/req",
         "model slots busy", "errors or over 2 s"],
        detail,
        align="rlrrrrrrr",
    )  # fmt: skip
    return page(result["stamp"], sections, note) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, help="Seconds measured per point (default 8).")
    parser.add_argument("--warmup", type=float, help="Seconds of load before each point (default 2).")
    parser.add_argument(
        "--rounds",
        type=int,
        help="Rounds per connection count (default 4: the machine drifts by more than a layer costs).",
    )
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--stages", nargs="+", default=list(STAGES))
    parser.add_argument("--ceiling-seconds", type=float, help="Seconds per batch size for the engine.")
    parser.add_argument("--out", type=Path, help="Folder for layers.json and .md.")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.layers", args, argv)
    args.duration = args.duration or (2.0 if args.quick else 8.0)
    args.warmup = args.warmup or (0.5 if args.quick else 2.0)
    args.rounds = args.rounds or (1 if args.quick else 4)
    args.ceiling_seconds = args.ceiling_seconds or (0.3 if args.quick else 2.0)
    result = {"stamp": {}, **measure(args)}
    result["stamp"] = run.stamp()
    evidence.publish(run, "layers", result, markdown, args.out)


if __name__ == "__main__":
    main()
