"""Refusing is nearly free? Stage 5 under a flood: clients that honour Retry-After, and clients that don't.

    python -m benchmarks.flood            # about 3 minutes; run it on a quiet machine (needs wrk)
    python -m benchmarks.flood --quick    # seconds per point
    python -m benchmarks.flood --record   # written to docs/results/flood.*
    make bench-flood                      # the same (QUICK=1, RECORD=1); installs wrk when missing

A bounded queue (MAX_QUEUE) keeps the wait of an admitted request short by refusing the rest at
once with 503 and a Retry-After. Under a flood the refusals themselves cost event-loop time that
the admitted requests needed. Three measurements, one new sentence per request:

* ``capacity``: stage 5 with its defaults, 32 closed-loop connections: answers per second, through
  the kit's client and through wrk (each flood is compared with the same client's capacity);
* ``honour``: MAX_QUEUE=8, 200 clients that wait Retry-After seconds after a 503 before they send
  again (what Locust users, the ``openai`` client's retries and a polite client do);
* ``resend``: MAX_QUEUE=8, 200 connections of ``wrk`` that send again the moment any answer
  arrives, 503 or not (what a naive retry loop or a load test does).

Goodput is the 200s per second as a share of ``capacity``. Also per point: the 503s per second, the
p50 of the 200s, and the server's CPU in cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from benchmarks.stage3 import bodies_for
from loadtests import evidence, wrk
from loadtests.harness import process_cpu, settle
from loadtests.httpload import closed_loop, percentile_ms, post_requests
from loadtests.procs import running_stage
from loadtests.tables import num, page, table

STAGE = "stage5_metrics"
FLOOD = {"MAX_QUEUE": "8"}


def _cores(pid: int) -> tuple[psutil.Process, float, float]:
    process = psutil.Process(pid)
    return process, process_cpu(process), time.perf_counter()


def _closed(server: Any, clients: int, seconds: float, seed: int, honour: bool) -> dict[str, Any]:
    """The kit's closed loop: 200s/s, 503s/s, p50 of the 200s and the server's cores."""
    requests = post_requests("/v1/embed", bodies_for("sentence", 60_000, seed=seed))
    process, cpu, started = _cores(server.pid)
    answers = asyncio.run(
        closed_loop("127.0.0.1", server.port, requests, clients, seconds=seconds, honour_retry_after=honour)
    )
    elapsed = time.perf_counter() - started
    ok = [a.ms for a in answers if a.status == 200]
    return {
        "ok_per_s": round(len(ok) / seconds, 1),
        "refused_per_s": round(sum(a.status in (503, 429) for a in answers) / seconds, 1),
        "other": sum(a.status not in (200, 503, 429) for a in answers),
        "p50_ms": percentile_ms(ok, 50),
        "server_cores": round((process_cpu(process) - cpu) / elapsed, 2),
    }


def _wrk(server: Any, clients: int, seconds: float, seed: int) -> dict[str, Any]:
    """``wrk`` with ``clients`` connections, each sending again at once, whatever the answer."""
    process, cpu, started = _cores(server.pid)
    out = wrk.run(server.url, bodies_for("sentence", 60_000, seed=seed), clients, seconds)
    return {
        "ok_per_s": out["requests_per_s"],
        "refused_per_s": out["non_2xx_per_s"],
        "other": out["socket_errors"],
        "p50_ms": None,  # wrk's percentiles mix the 200s and the 503s
        "server_cores": round((process_cpu(process) - cpu) / (time.perf_counter() - started), 2),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if not wrk.available():
        raise SystemExit("wrk is missing: `make tools` installs Debian's package")
    logs = evidence.OUT / "logs" / "flood"
    points: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        with running_stage(STAGE, logs) as server:
            settle(server.pid, server.url)
            _closed(server, 32, args.warmup, 7000 + round_, False)
            point = _closed(server, 32, args.duration, 7100 + round_, False)
            points.append({"kind": "capacity", "round": round_, **point})
            print(json.dumps(points[-1]), flush=True)
            settle(server.pid, server.url)
            point = _wrk(server, 32, args.duration, 7150 + round_)
            points.append({"kind": "capacity_wrk", "round": round_, **point})
            print(json.dumps(points[-1]), flush=True)
        for delay in args.delays:
            env = {**FLOOD, "SHED_DELAY_MS": f"{delay:g}"}
            with running_stage(STAGE, logs, env) as server:
                settle(server.pid, server.url)
                _closed(server, 32, args.warmup, 7200 + round_, False)
                point = _closed(server, args.clients, args.duration, 7300 + round_, True)
                points.append({"kind": "honour", "delay_ms": delay, "round": round_, **point})
                print(json.dumps(points[-1]), flush=True)
                settle(server.pid, server.url)
                point = _wrk(server, args.clients, args.duration, 7400 + round_)
                points.append({"kind": "resend", "delay_ms": delay, "round": round_, **point})
                print(json.dumps(points[-1]), flush=True)
    return {
        "clients": args.clients,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "flood_settings": FLOOD,
        "delays_ms": list(args.delays),
        "points": points,
        "summary": summarize(points, args.delays),
    }


def summarize(points: list[dict[str, Any]], delays: Sequence[float]) -> dict[str, Any]:
    def median(key: str, **match: Any) -> float | None:
        mine = [p for p in points if all(p.get(k) == v for k, v in match.items())]
        values = sorted(p[key] for p in mine if p[key] is not None)
        return values[len(values) // 2] if values else None

    capacity = {  # each flood against the same client's 32 connections
        "honour": median("ok_per_s", kind="capacity") or 0.0,
        "resend": median("ok_per_s", kind="capacity_wrk") or 0.0,
    }
    rows = []
    for delay in delays:
        row: dict[str, Any] = {"delay_ms": delay}
        for kind in ("honour", "resend"):
            ok = median("ok_per_s", kind=kind, delay_ms=delay) or 0.0
            row[kind] = {
                "ok_per_s": ok,
                "refused_per_s": median("refused_per_s", kind=kind, delay_ms=delay),
                "p50_ms": median("p50_ms", kind=kind, delay_ms=delay),
                "server_cores": median("server_cores", kind=kind, delay_ms=delay),
                "goodput": round(ok / capacity[kind], 4) if capacity[kind] else None,
            }
        rows.append(row)
    return {"capacity_per_s": capacity, "by_delay": rows}


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    note = (
        f"Stage 5, one new sentence per request, {result['duration_s']:g} s per point, median of"
        f" {result['rounds']} rounds. Capacity, stage 5 with its defaults at 32 connections:"
        f" {s['capacity_per_s']['honour']:.0f} answers/s through the kit's closed loop, the polite"
        f" clients' yardstick; {s['capacity_per_s']['resend']:.0f} through wrk, the yardstick of wrk's"
        f" flood. The floods: MAX_QUEUE=8 and {result['clients']} clients, for each SHED_DELAY_MS."
    )
    rows = []
    for row in s["by_delay"]:
        for kind, who in (("honour", "wait Retry-After"), ("resend", "send again at once (wrk)")):
            m = row[kind]
            rows.append((
                f"{row['delay_ms']:g}", who, num(m["ok_per_s"], 0), num(m["refused_per_s"], 0),
                f"{100 * (m['goodput'] or 0):.0f} %",
                num(m["p50_ms"], 1) if m["p50_ms"] is not None else "-", num(m["server_cores"], 2),
            ))  # fmt: skip
    goodput = table(
        ["SHED_DELAY_MS", f"{result['clients']} clients that ...", "200s/s", "503s/s", "of capacity",
         "p50 of 200s, ms", "server cores"],
        rows, align="rlrrrrr",
    )  # fmt: skip
    return page(result["stamp"], {"goodput": goodput}, note) + "\n"


def headline(result: dict[str, Any]) -> dict[str, float]:
    s = result["summary"]
    out = {f"capacity ({kind}) req/s": value for kind, value in s["capacity_per_s"].items()}
    for row in s["by_delay"]:
        for kind in ("honour", "resend"):
            out[f"delay {row['delay_ms']:g} ms, {kind}: 200s/s"] = row[kind]["ok_per_s"]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, help="Seconds measured per point (default 10).")
    parser.add_argument("--warmup", type=float, help="Seconds of load before a point (default 3).")
    parser.add_argument("--rounds", type=int, help="Rounds (default 3).")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument(
        "--delays", type=float, nargs="+", default=[0.0, 50.0, 200.0], help="SHED_DELAY_MS values to try."
    )
    parser.add_argument("--out", type=Path, help="Folder for flood.json and .md.")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.flood", args, argv)
    args.duration = args.duration or (2.0 if args.quick else 10.0)
    args.warmup = args.warmup or (0.5 if args.quick else 3.0)
    args.rounds = args.rounds or (1 if args.quick else 3)
    result = {"stamp": {}, **measure(args)}
    result["stamp"] = run.stamp(FLOOD)
    evidence.publish(run, args.out, "flood", result, markdown, headline)


if __name__ == "__main__":
    main()
