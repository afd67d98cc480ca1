"""Stage 2's thread settings, measured together: WORKER_THREADS x ONNX_INTRA_THREADS, and spinning.

    python -m benchmarks.stage2_threads            # about 2.5 minutes; run it on a quiet machine
    python -m benchmarks.stage2_threads --quick    # about a minute, to see that it works
    python -m benchmarks.stage2_threads --record   # written to docs/results/

The pool runs WORKER_THREADS model calls at once, each with ONNX_INTRA_THREADS threads (0, the
default: the cores shared out among the calls; for one call, ONNX Runtime's own choice, every
core). ONNX_SPINNING keeps idle ONNX threads spinning instead of sleeping. Each layout runs as
its own stage 2 server, all at once (an idle one costs nothing), loaded by ``wrk`` with 8 and 32
connections, one sentence per request (the same list at every point), in rounds that visit the
servers in a new random order each time, so a busy spell of the machine hits them all alike; each
figure of a point is its median over the rounds.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson

from benchmarks.compare import unanimous
from common.engine import intra_threads_for
from loadtests import evidence
from loadtests.load import bodies_for, settle, wrk
from loadtests.procs import running_stage
from loadtests.tables import num, page, table

# (WORKER_THREADS, ONNX_INTRA_THREADS, ONNX_SPINNING): one call on every core (stage 1's layout),
# one call of one thread, the defaults, two calls of two threads each, the defaults spinning.
LAYOUTS = ((1, 0, False), (1, 1, False), (2, 0, False), (2, 2, False), (2, 0, True))
DEFAULTS = (2, 0, False)
CONNECTIONS = (8, 32)


def sweep(seconds: float, rounds: int, logs: Path) -> list[dict[str, Any]]:
    bodies = bodies_for("sentence", 20_000, 2)
    runs: dict[tuple[tuple[int, int, bool], int], list[dict[str, Any]]] = {}
    with ExitStack() as stack:
        servers = {
            layout: stack.enter_context(running_stage("stage2_threadpool", logs, {
                "WORKER_THREADS": str(layout[0]), "ONNX_INTRA_THREADS": str(layout[1]),
                "ONNX_SPINNING": str(layout[2]).lower()}))
            for layout in LAYOUTS
        }  # fmt: skip
        for server in servers.values():  # a first load, on other texts: the servers warm
            wrk(server.url, bodies[::-1], 8, 1)
        rng = random.Random(0)
        for r in range(rounds):
            for layout in rng.sample(LAYOUTS, len(LAYOUTS)):
                for n in CONNECTIONS:
                    settle(servers[layout].pid, servers[layout].url)
                    point = wrk(servers[layout].url, bodies, n, seconds)
                    print(orjson.dumps({"round": r, "layout": layout, **point}).decode(), flush=True)
                    runs.setdefault((layout, n), []).append(point)
    return [
        {"layout": list(layout), "connections": n,
         "requests_per_s": statistics.median(p["requests_per_s"] for p in ps),
         "p99_ms": statistics.median(p["p99_ms"] or 0.0 for p in ps),
         "errors": sum(p["socket_errors"] for p in ps),
         "rounds_requests_per_s": [p["requests_per_s"] for p in ps]}
        for (layout, n), ps in runs.items()
    ]  # fmt: skip


def _rps(result: dict[str, Any], layout: tuple[int, int, bool], n: int) -> float:
    return float(next(p["requests_per_s"] for p in result["points"] if p["layout"] == list(layout)
                      and p["connections"] == n))  # fmt: skip


def _threads(layout: Sequence[Any], cores: int) -> int:
    """Threads per call: ONNX_INTRA_THREADS, else the cores shared out (one call: ONNX's all)."""
    return int(layout[1] or intra_threads_for(layout[0]) or cores)


def markdown(result: dict[str, Any]) -> str:
    cores = result["stamp"]["machine"]["logical_cores"]
    rows = []
    for layout in map(tuple, result["layouts"]):
        row: list[Any] = [layout[0], layout[1], "on" if layout[2] else "off", _threads(layout, cores)]
        for n in CONNECTIONS:
            p = next(x for x in result["points"] if x["layout"] == list(layout) and x["connections"] == n)
            row += [num(p["requests_per_s"], 0), num(p["p99_ms"], 0)]
        rows.append([f"**{c}**" if layout == DEFAULTS and i == 0 else c for i, c in enumerate(row)])
    head = ["WORKER_THREADS", "ONNX_INTRA_THREADS", "ONNX_SPINNING", "threads per call"]
    head += [h for n in CONNECTIONS for h in (f"req/s @{n}", f"p99 ms @{n}")]

    def ratios(layout: tuple[int, int, bool], of: tuple[int, int, bool]) -> str:
        at = [f"{_rps(result, layout, n) / _rps(result, of, n):.2f}x at {n}" for n in CONNECTIONS]
        return " and ".join(at) + " connections"

    def summed(lay: tuple[int, int, bool]) -> list[float]:  # each round's req/s over both loads
        at = [next(p for p in result["points"] if p["layout"] == list(lay) and p["connections"] == n)
              for n in CONNECTIONS]  # fmt: skip
        return [sum(r) for r in zip(*(p["rounds_requests_per_s"] for p in at), strict=True)]

    # the same layout first in every round, or none
    best = unanimous(max(LAYOUTS, key=lambda lay: summed(lay)[i]) for i in range(len(summed(DEFAULTS))))
    words = [
        f"The defaults (two calls at once, {_threads(DEFAULTS, cores)} thread(s) each here) did"
        f" {ratios(DEFAULTS, (1, 0, False))} of one call on every core, and"
        f" {ratios(DEFAULTS, (1, 1, False))} of one call of one thread. Two calls of two threads each"
        f" did {ratios((2, 2, False), DEFAULTS)} of the defaults; the defaults with ONNX_SPINNING on"
        f" did {ratios((2, 0, True), DEFAULTS)}"
        + (
            " (with one thread a call ONNX Runtime keeps no threads to spin: the same server twice, so this"
            " ratio is the sweep's noise)"
            if _threads(DEFAULTS, cores) == 1
            else ""
        )
        + ". Most requests/s over both loads in every round: "
        + (
            "no one layout (within noise)."
            if best is None
            else f"WORKER_THREADS={best[0]}, ONNX_INTRA_THREADS={best[1]},"
            f" ONNX_SPINNING={str(best[2]).lower()}"
            + (", the defaults." if best == DEFAULTS else ", not the defaults.")
        )
    ]
    note = (
        f"{result['rounds']} round(s) of {result['seconds']:g} s per point; each column its median over them."
    )
    return page(result["stamp"], {"table": table(head, rows), "best": words}, note)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per point and round")
    parser.add_argument("--rounds", type=int, default=3)
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.stage2_threads", args, argv)
    seconds, rounds = (1.0, 1) if args.quick else (args.seconds, args.rounds)
    points = sweep(seconds, rounds, run.logs("stage2_threads"))
    result = {
        "stamp": run.stamp(),
        "seconds": seconds,
        "rounds": rounds,
        "layouts": LAYOUTS,
        "points": points,
    }
    result = orjson.loads(orjson.dumps(result))  # tuples as lists, as a reader of the JSON sees them
    evidence.publish(run, "stage2_threads", result, markdown)


if __name__ == "__main__":
    main()
