"""What a lone request costs each stage's event loop, in Python function calls, and where they are.

    python -m benchmarks.request_path            # about 6 minutes
    python -m benchmarks.request_path --quick    # about 2 minutes
    python -m benchmarks.request_path --record   # written to docs/results/request_path.*
    make bench-request-path                      # the same (QUICK=1, RECORD=1)

At one connection a request has the server to itself, so its latency is the CPU it costs:
the event loop's share (parse, route, validate, the layers, encode) and the model thread's.
``make bench-layers`` measures both; this experiment shows what the loop's share is made of:

* each stage runs as ``make stageN`` runs it, under ``cProfile`` on the event loop's thread, and
  counts only while ``wrk`` sends one new sentence at a time (SIGUSR1 starts the count, SIGUSR2
  stops it and writes it out): the Python function calls per request, by where the function is
  defined (a C function counts where its caller is). Unlike a time, a count is the same in
  every run on every machine;
* then the same stages, unprofiled, take turns at one connection (medians of 5 rounds): the
  loop's CPU per request beside the other threads' (the model's, mostly) and the p50. The slope
  of the loop's CPU over the stages' calls is what a call costs the loop on this machine;
* last, stage 5 is counted again with one of its layers taken out at a time (``WITHOUT``): what
  each layer's calls are, and what they cost at that price.

Writes request_path.json and request_path.md (the stage 5 chapter includes the tables).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import itertools
import os
import pstats
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.layers import STAGES, in_turns
from benchmarks.stage3 import bodies_for
from loadtests import evidence, wrk
from loadtests.harness import settle
from loadtests.procs import running_stage
from loadtests.tables import num, page, stage_label, table

# Where a function is defined, by the first part of its file's path (the venv's packages, the
# standard library, this repository), and the group it counts in.
GROUPS = {
    "uvicorn": "HTTP server and framework",
    "starlette": "HTTP server and framework",
    "fastapi": "HTTP server and framework",
    "pydantic": "HTTP server and framework",
    "anyio": "HTTP server and framework",
    "asyncio": "asyncio",
    "concurrent": "asyncio",
    "common": "common/ (the contract)",
    "stage2_threadpool": "the stage's own code",
    "stage3_batching": "stage 3 (the batcher)",
    "stage4_cache_backpressure": "stage 4 (cache, single-flight, admission)",
    "stage5_metrics": "stage 5 (telemetry)",
    "prometheus_client": "stage 5 (telemetry)",
    "logging": "stage 5 (telemetry)",
    "pythonjsonlogger": "stage 5 (telemetry)",
}
OTHER = "the rest of the standard library"
ORDER = (
    "HTTP server and framework",
    "asyncio",
    "common/ (the contract)",
    "the stage's own code",
    "stage 3 (the batcher)",
    "stage 4 (cache, single-flight, admission)",
    "stage 5 (telemetry)",
    OTHER,
)


@dataclass(frozen=True)
class Without:
    """Stage 5 with a layer taken out: by a setting the server has, else by a patch that the
    profiled child applies before the app is imported (an experiment, not a setting to offer)."""

    label: str
    env: dict[str, str] = field(default_factory=dict)
    patches: tuple[str, ...] = ()


WITHOUT = {
    "watch": Without("the disconnect watch", patches=("watch",)),
    "cache": Without("the cache and single-flight (`CACHE_ENABLED=false`)", {"CACHE_ENABLED": "false"}),
    "metrics": Without("the counters and histograms", patches=("metrics",)),
    "log": Without("the request log line (`LOG_LEVEL=WARNING`)", {"LOG_LEVEL": "WARNING"}),
}
WITHOUT["all"] = Without(  # every one of them at once: their settings and patches together
    "all four",
    {k: v for layer in WITHOUT.values() for k, v in layer.env.items()},
    tuple(p for layer in WITHOUT.values() for p in layer.patches),
)
LAYERED = "stage5_metrics"  # the stage the layers are taken out of

# Called once per answered embedding request, and not a coroutine (a coroutine's every resume
# counts as a call): the request count.
ONCE_PER_REQUEST = ("common/api.py", "_result_headers")


# --- the profiled server (a child process) -----------------------------------------------
def serve_profiled(stage: str, out: Path, patches: Sequence[str] = ()) -> None:
    """``make stageN``'s server, counting the loop thread's calls between SIGUSR1 and SIGUSR2."""
    from common import serve
    from stage5_metrics.window import Window

    take_out(patches)
    # Stage 5's window reads the whole registry once a second, off the request path; counted,
    # it would add more calls to each request the fewer requests share a second. Nothing a
    # request does reads the window, so the profiled server runs without it.
    Window.start = lambda _window: None  # type: ignore[method-assign]
    profile = cProfile.Profile()

    def begin(*_: Any) -> None:
        profile.enable()

    def end(*_: Any) -> None:
        profile.disable()
        profile.dump_stats(out.with_suffix(".part"))
        out.with_suffix(".part").replace(out)  # whole or not there: the parent waits for it

    signal.signal(signal.SIGUSR1, begin)  # the handlers run on the main thread: the event loop's
    signal.signal(signal.SIGUSR2, end)
    serve.main([stage])


def take_out(patches: Sequence[str]) -> None:
    """Replace a layer with nothing, in this process, before uvicorn imports the app. A patch,
    not a setting: the watch and the counters are not optional in the server, and a switch that
    exists only for this experiment would be one more thing for a reader of stage 5 to follow."""
    if "watch" in patches:  # the work is awaited as it is: no task listens for a hang-up
        from stage4_cache_backpressure import app as stage4

        stage4.unless_client_leaves = lambda work, _request: work  # type: ignore[assignment]
    if "metrics" in patches:  # no counter or histogram is updated, per request or per batch
        from stage5_metrics.metrics import Metrics

        for name in ("observe_request", "observe_result", "observe_batch"):
            setattr(Metrics, name, lambda *_: None)


# --- reading a profile -------------------------------------------------------------------
def _from_root(filename: str) -> tuple[str, Path]:
    """Where a function's file lives (``packages``, ``repo``, ``stdlib`` or ``elsewhere``) and its
    path from there."""
    path = Path(filename)
    if "site-packages" in path.parts:
        return "packages", Path(*path.parts[path.parts.index("site-packages") + 1 :])
    for root, folder in (("repo", evidence.REPO), ("stdlib", Path(os.__file__).parent)):
        if path.is_relative_to(folder):
            return root, path.relative_to(folder)
    return "elsewhere", path


def where(filename: str) -> str:
    """The package or repository folder a function's file is in (``~`` for a C function)."""
    if filename.startswith("~"):
        return "~"
    root, path = _from_root(filename)
    return path.name if root == "elsewhere" else path.parts[0].removesuffix(".py")


def group_of(filename: str) -> str:
    return GROUPS.get(where(filename), OTHER)


def calls_by_group(stats: pstats.Stats) -> tuple[float, dict[str, float], dict[str, float]]:
    """Requests counted, calls per request by group, and by function (``file:function``)."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]  # pstats keeps them there
    requests = sum(
        v[1] for k, v in raw.items() if k[0].endswith(ONCE_PER_REQUEST[0]) and k[2] == ONCE_PER_REQUEST[1]
    )
    if not requests:
        raise RuntimeError("the profile counted no embedding request")
    groups: collections.Counter[str] = collections.Counter()
    functions: collections.Counter[str] = collections.Counter()
    for (filename, _line, name), (_prim, calls, _tt, _ct, callers) in raw.items():
        if filename.startswith("~"):  # a C function: it counts where its callers are
            for caller, counts in callers.items():
                groups[group_of(caller[0])] += counts[1]
                functions[f"{_short(caller[0])}: {name.strip('<>')}"] += counts[1]
        else:
            groups[group_of(filename)] += calls
            functions[f"{_short(filename)}:{name}"] += calls
    per = {g: c / requests for g, c in groups.items()}
    return requests, per, {f: c / requests for f, c in functions.items()}


def _short(filename: str) -> str:
    root, path = _from_root(filename)
    return "/".join(path.parts) if root in ("packages", "repo") else path.name


# --- measuring ---------------------------------------------------------------------------
def profile_stage(
    stage: str, args: argparse.Namespace, logs: Path, without: str | None = None
) -> dict[str, Any]:
    out = logs / f"{stage}{'-without-' + without if without else ''}.prof"
    out.unlink(missing_ok=True)
    layer = WITHOUT[without] if without else Without("")
    command = (sys.executable, "-m", "benchmarks.request_path", "--serve", stage, "--profile-to", str(out),
               *(("--take-out", ",".join(layer.patches)) if layer.patches else ()))  # fmt: skip
    bodies = bodies_for("sentence", 10_000, seed=700)
    with running_stage(stage, logs, layer.env, command=command) as server:
        settle(server.pid, server.url)
        wrk.run(server.url, bodies[::-1], 1, args.warmup)
        server.signal(signal.SIGUSR1)
        point = wrk.run(server.url, bodies, 1, args.duration)
        server.signal(signal.SIGUSR2)  # handled within uvicorn's 0.1 s tick
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    requests, groups, functions = calls_by_group(pstats.Stats(str(out)))
    return {
        "stage": stage,
        "requests": requests,
        "requests_per_s_profiled": point["requests_per_s"],
        "calls_per_request": round(sum(groups.values()), 1),
        "by_group": {g: round(groups.get(g, 0.0), 1) for g in ORDER},
        "functions": functions,  # every one, for the comparisons; the page keeps the top 200
    }


def loop_cpu(args: argparse.Namespace, logs: Path) -> dict[str, dict[str, float]]:
    """Each stage unprofiled at one connection, in turns: medians of the loop's CPU per request."""
    with ExitStack() as stack:
        servers = {s: stack.enter_context(running_stage(s, logs)) for s in args.stages}
        points = in_turns(servers, 1, args, seed=7099)
    keys = ("p50_ms", "loop_cpu_ms", "other_cpu_ms")
    return {
        s: {k: statistics.median(p[k] for p in points if p["stage"] == s) for k in keys} for s in args.stages
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    logs = evidence.OUT / "logs" / "request_path"
    logs.mkdir(parents=True, exist_ok=True)
    stages = []
    for stage in args.stages:
        print(f"{stage} under the profiler ...", flush=True)
        stages.append(profile_stage(stage, args, logs))
    cpu = loop_cpu(args, logs)
    for row in stages:
        row.update(cpu[row["stage"]])
    price = price_of_a_call(stages)
    full = next((r for r in stages if r["stage"] == LAYERED), None)
    layers = [] if full is None else [take_out_one(key, full, price, args, logs) for key in args.without]
    for before, after in itertools.pairwise(stages):
        extra = after["calls_per_request"] - before["calls_per_request"]
        after["extra_calls"] = round(extra, 1)
        after["added_functions"] = _most(after["functions"], before["functions"], 8)
    for row in stages:
        functions = row.pop("functions")
        row["top_functions"] = {
            f: round(c, 2) for f, c in sorted(functions.items(), key=lambda x: -x[1])[:200]
        }
    return {
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "rounds": args.rounds,
        "stages": list(args.stages),
        "results": stages,
        "price_us_per_call": None if price is None else round(price, 3),
        "without": layers,
    }


def take_out_one(
    key: str, full: dict[str, Any], price: float | None, args: argparse.Namespace, logs: Path
) -> dict[str, Any]:
    """Stage 5 counted again without one layer: how many fewer calls, and what they cost the loop."""
    print(f"{LAYERED} without {WITHOUT[key].label} under the profiler ...", flush=True)
    row = profile_stage(LAYERED, args, logs, without=key)
    fewer = full["calls_per_request"] - row["calls_per_request"]
    return {
        "without": key,
        "label": WITHOUT[key].label,
        "calls_per_request": row["calls_per_request"],
        "fewer_calls": round(fewer, 1),
        "loop_us_saved": None if price is None else round(fewer * price, 1),
        "by_group": row["by_group"],
        "gone_functions": _most(full["functions"], row["functions"], 8),
    }


def price_of_a_call(rows: Sequence[dict[str, Any]]) -> float | None:
    """Microseconds of the loop's CPU per Python call: the least-squares slope of the stages' loop
    CPU per request over their calls per request (None when it cannot be told: fewer than two
    stages, or a slope that is not positive)."""
    if len(rows) < 2:
        return None
    slope, _ = statistics.linear_regression(
        [r["calls_per_request"] for r in rows], [r["loop_cpu_ms"] * 1e3 for r in rows]
    )
    return slope if slope > 0 else None


def _most(more: dict[str, float], fewer: dict[str, float], n: int) -> dict[str, float]:
    """The ``n`` Python functions called most more often in ``more`` than in ``fewer``, per request."""
    extra = {f: c - fewer.get(f, 0.0) for f, c in more.items() if not _is_c(f)}
    return {f: round(c, 1) for f, c in sorted(extra.items(), key=lambda x: -x[1])[:n]}


def _is_c(function: str) -> bool:
    """A C function (counted under its caller's file, ``file: name``)."""
    return ": " in function


# --- the page ----------------------------------------------------------------------------
def markdown(result: dict[str, Any]) -> str:
    rows = result["results"]
    labels = [stage_label(r["stage"]) for r in rows]
    calls = table(
        ["Python calls per request", *labels],
        [
            *[[g, *[num(r["by_group"][g], 0) for r in rows]] for g in ORDER],
            ["**all**", *[f"**{num(r['calls_per_request'], 0)}**" for r in rows]],
        ],
    )
    priced = table(
        ["stage", "calls / request", "more than the stage before", "loop CPU ms / request",
         "other threads ms / request", "p50 ms"],
        [
            (
                stage_label(r["stage"]), num(r["calls_per_request"], 0), num(r.get("extra_calls"), 0),
                num(r["loop_cpu_ms"], 2), num(r["other_cpu_ms"], 2), num(r["p50_ms"], 2),
            )
            for r in rows
        ],
        align="lrrrrr",
    )  # fmt: skip
    added = [(stage_label(r["stage"]), _listed(r["added_functions"], 5)) for r in rows[1:]]
    note = (
        f"One connection, one new sentence per request; calls counted on the event loop's thread"
        f" under cProfile for {result['duration_s']:g} s, the loop's CPU measured without it"
        f" (median of {result['rounds']} rounds taken in turns)."
    )
    sections = {
        "calls": calls,
        "priced": priced,
        "added": table(["stage", "what it adds most, calls per request"], added, align="ll"),
    }
    if result.get("without"):
        price = result["price_us_per_call"]
        sections["without"] = table(
            [f"{stage_label(LAYERED)} without", "calls / request", f"fewer than {stage_label(LAYERED)}",
             "loop µs a request, at " + (f"{num(price, 2)} µs a call" if price else "(no price)"),
             "what goes most, calls per request"],
            [(w["label"], *(num(w[k], 0) for k in ("calls_per_request", "fewer_calls", "loop_us_saved")),
              _listed(w["gone_functions"], 3)) for w in result["without"]],
            align="lrrrl",
        )  # fmt: skip
    return page(result["stamp"], sections, note) + "\n"


def _listed(functions: dict[str, float], n: int) -> str:
    return ", ".join(f"`{_dotted(f)}` {c:.0f}" for f, c in list(functions.items())[:n])


def _dotted(function: str) -> str:
    """``prometheus_client/values.py:inc`` -> ``prometheus_client.values.inc``."""
    path, _, name = function.partition(":")
    return f"{path.removesuffix('.py').replace('/', '.')}.{name}"


def headline(result: dict[str, Any]) -> dict[str, float]:
    return {f"{stage_label(r['stage'])} calls per request": r["calls_per_request"] for r in result["results"]}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, help="Seconds measured per point (default 6).")
    parser.add_argument("--warmup", type=float, help="Seconds of load before each point (default 2).")
    parser.add_argument("--rounds", type=int, help="Rounds of the unprofiled loop-CPU points (default 5).")
    parser.add_argument("--stages", nargs="+", default=list(STAGES))
    parser.add_argument(
        "--without", nargs="*", choices=list(WITHOUT), default=list(WITHOUT),
        help="Stage 5's layers to take out, one at a time (default: each, then all four).",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, help="Folder for request_path.json and .md.")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the child: a profiled server
    parser.add_argument("--profile-to", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--take-out", default="", help=argparse.SUPPRESS)
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.serve:
        serve_profiled(args.serve, args.profile_to, [p for p in args.take_out.split(",") if p])
        return
    run = evidence.start("benchmarks.request_path", args, argv)
    args.duration = args.duration or (2.0 if args.quick else 6.0)
    args.warmup = args.warmup or (0.5 if args.quick else 2.0)
    args.rounds = args.rounds or (1 if args.quick else 5)
    result = {"stamp": {}, **measure(args)}
    result["stamp"] = run.stamp()
    evidence.publish(run, args.out, "request_path", result, markdown, headline)


if __name__ == "__main__":
    main()
