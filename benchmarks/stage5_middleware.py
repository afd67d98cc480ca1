"""Stage 5's per-request cost, part by part: the middleware kind, the counters, the log line.

    python -m benchmarks.stage5_middleware         # about 3 minutes; out/results/stage5_middleware.*
    python -m benchmarks.stage5_middleware --quick # seconds, to see that it runs

Issue 13, item 7: a departure from FastAPI's idiom stays only where it buys at least 5 % on a
stage 5 workload with cache hits. Stage 5 ships a pure ASGI middleware (``TelemetryMiddleware``);
the idiom is FastAPI's ``@app.middleware("http")`` (Starlette's ``BaseHTTPMiddleware``) doing the
same bookkeeping (``idiom_app`` below). Measured three ways:

1. ``calls``: each per-request call on its own (timeit): the Prometheus updates, and the
   request line through the ``QueueHandler`` against a plain ``StreamHandler``;
2. ``in_process``: stage 4, stage 5 and its variants in one process, one memory-cache hit at a
   time through ASGI, in alternating blocks, in the process's CPU time (every thread);
3. ``sockets``: stage 4, stage 5, its idiom variant, stage 5 writing its request lines on the
   event loop, stage 5 with the standard ``QueueListener`` (a wake-up per line) and stage 5 with
   LOG_LEVEL=WARNING (no request lines), under uvicorn side by side,
   32 closed-loop clients sending cached texts, in turns (ABCDEF FEDCBA): requests/s and server
   CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Awaitable, Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import orjson
import psutil
from starlette.types import ASGIApp

from loadtests import evidence
from loadtests.httpload import post_requests, run_load
from loadtests.procs import REPO, free_port, server_env, wait_http
from loadtests.tables import num, page, table

LOGS = evidence.OUT / "logs" / "stage5_middleware"
PER_LINE = "stage 5, the standard QueueListener (a wake-up per line)"
TEXTS = [f"a cached sentence number {i} for the middleware measurement" for i in range(300)]


def idiom_app() -> Any:
    """Stage 5 as ``build_app`` makes it, with FastAPI's ``@app.middleware("http")`` doing the same
    bookkeeping as ``TelemetryMiddleware`` (for ``uvicorn --factory``)."""
    from fastapi import Request, Response

    from common.api import create_app
    from common.settings import get_settings
    from stage3_batching.app import add_batcher_routes
    from stage4_cache_backpressure.app import add_cache_routes
    from stage5_metrics.app import MetricsBackend
    from stage5_metrics.dashboard import add_dashboard_routes
    from stage5_metrics.logs import RequestRecord, configure_logging
    from stage5_metrics.metrics import Metrics
    from stage5_metrics.telemetry import _request_id, finish
    from stage5_metrics.window import Window

    settings = get_settings()
    configure_logging(settings)
    metrics = Metrics()
    window = Window(metrics)
    app = create_app(
        "stage5 with @app.middleware",
        lambda e, s: MetricsBackend(e, s, metrics, window, app),
        settings,
        calls_at_once=lambda s: s.batch_concurrency,
    )
    add_batcher_routes(app)
    add_cache_routes(app)
    add_dashboard_routes(app, metrics, window)

    @app.middleware("http")
    async def telemetry(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        started = time.perf_counter()
        record = request.state.telemetry = RequestRecord(_request_id(request.headers.get("x-request-id")))
        status = 499
        try:
            response = await call_next(request)
            status = response.status_code
            response.headers["x-request-id"] = record.request_id
            return response
        except Exception:
            status = 500
            raise
        finally:
            finish(metrics, request.scope, record, status, time.perf_counter() - started)

    return app


def direct_log_app() -> Any:
    """Stage 5 with its request lines formatted and written on the event loop: no QueueHandler."""
    from stage5_metrics.app import build_app

    app = build_app()
    ours = logging.getLogger("embedserve")
    ours.handlers = [h.target for h in ours.handlers]  # type: ignore[attr-defined]  # the queue's own StreamHandler, used directly
    return app


def per_line_listener_app() -> Any:
    """Stage 5 with the standard library's ``QueueListener``, which wakes for every line (the
    shipped ``GatheringListener`` lets lines gather between wake-ups)."""
    from logging.handlers import QueueListener

    from stage5_metrics.app import build_app
    from stage5_metrics.logs import _Queued

    ours = logging.getLogger("embedserve")  # configure_logging keeps a queue it finds there
    ours.addHandler(_Queued(logging.StreamHandler(sys.stderr), listener=QueueListener))
    return build_app()


# --- 1. each call on its own ------------------------------------------------------------------
def calls(number: int) -> dict[str, float]:
    """Microseconds per call, best of five runs."""
    from common.settings import Settings
    from stage5_metrics.logs import RequestRecord, configure_logging, log_request
    from stage5_metrics.metrics import Metrics

    configure_logging(Settings())  # as the server does: JSON lines to stderr, through the queue
    metrics = Metrics()
    record = RequestRecord("b99065a216cb5ab50000000000000001", texts=1, tokens=12, cache_hits=1)

    def us(fn: Callable[[], Any]) -> float:
        return round(min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6, 3)

    out = {
        "prometheus: observe_request (counter + histogram)": us(
            lambda: metrics.observe_request("/v1/embed", 200, 0.0004)
        ),
        "prometheus: observe_result (2 counters, a histogram, a gauge)": us(
            lambda: metrics.observe_result(1, 12, None, 0.001)
        ),
        "request line, QueueHandler (the event loop's part)": us(
            lambda: log_request(logging.INFO, "POST", "/v1/embed", 200, record, 0.4)
        ),
    }
    ours = logging.getLogger("embedserve")
    queued = list(ours.handlers)
    ours.handlers = [h.target for h in queued]  # type: ignore[attr-defined]  # the queue's own handler, on this thread
    out["request line, plain StreamHandler (formatted and written here)"] = us(
        lambda: log_request(logging.INFO, "POST", "/v1/embed", 200, record, 0.4)
    )
    ours.handlers = queued
    return out


# --- 2. in process ----------------------------------------------------------------------------
async def in_process(blocks: int, per_block: int) -> dict[str, Any]:
    from benchmarks.stage5_asgi import _lifespan, _request
    from stage4_cache_backpressure.app import app as stage4
    from stage5_metrics.app import build_app

    apps: dict[str, ASGIApp] = {
        "stage 4": stage4,
        "stage 5, pure ASGI middleware (shipped)": build_app(),
        "stage 5, @app.middleware": idiom_app(),
        "stage 5, request lines written on the loop": build_app(),  # handlers swapped for its blocks
    }
    ours = logging.getLogger("embedserve")
    queued, direct = list(ours.handlers), [h.target for h in ours.handlers]  # type: ignore[attr-defined]
    running = [await _lifespan(app) for app in apps.values()]
    for app in apps.values():  # the first call computes, every later one is a memory-cache hit
        assert await _request(app) == 200
    times: dict[str, list[float]] = {name: [] for name in apps}
    for block in range(blocks):
        for name in list(apps) if block % 2 == 0 else list(apps)[::-1]:
            ours.handlers = direct if "on the loop" in name else queued
            started = time.process_time()
            for _ in range(per_block):
                assert await _request(apps[name]) == 200
            times[name].append((time.process_time() - started) / per_block * 1e6)
            ours.handlers = queued
    for task, inbox in running:
        await inbox.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(task, 30)
    us = {name: round(statistics.median(t), 1) for name, t in times.items()}
    pure, idiom = us["stage 5, pure ASGI middleware (shipped)"], us["stage 5, @app.middleware"]
    return {
        "blocks": blocks,
        "requests_per_block": per_block,
        "cpu_us_per_request": us,
        "idiom_over_pure": round(idiom / pure, 4),
        "stage5_over_stage4": round(pure / us["stage 4"], 4),
    }


# --- 3. over sockets --------------------------------------------------------------------------
@contextmanager
def _uvicorn(target: str, env: dict[str, str], log: Path) -> Any:
    """``target`` under uvicorn as ``common.serve`` runs a stage (access log off), ready."""
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", target, "--port", str(port), "--no-access-log"]
    if not target.endswith(":app"):
        command.append("--factory")
    with log.open("ab") as sink:
        process = subprocess.Popen(
            command, cwd=REPO, env=server_env("127.0.0.1", port, env), stdout=sink, stderr=sink
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", process)
        yield process, port
    finally:
        process.terminate()
        process.wait(30)


def sockets(rounds: int, seconds: float, clients: int) -> dict[str, Any]:
    targets = {  # name: (uvicorn target, environment)
        "stage 4": ("stage4_cache_backpressure.app:app", {}),
        "stage 5, pure ASGI middleware (shipped)": ("stage5_metrics.app:build_app", {}),
        "stage 5, @app.middleware": ("benchmarks.stage5_middleware:idiom_app", {}),
        "stage 5, request lines written on the loop": ("benchmarks.stage5_middleware:direct_log_app", {}),
        PER_LINE: ("benchmarks.stage5_middleware:per_line_listener_app", {}),
        "stage 5, LOG_LEVEL=WARNING (no request lines)": (
            "stage5_metrics.app:build_app",
            {"LOG_LEVEL": "WARNING"},
        ),
    }
    requests = post_requests("/v1/embed", [orjson.dumps({"inputs": [t]}) for t in TEXTS])
    points: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    logs = LOGS
    logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        servers = {
            name: stack.enter_context(_uvicorn(target, env, logs / f"server-{i}.log"))
            for i, (name, (target, env)) in enumerate(targets.items())
        }
        for _, port in servers.values():  # every text once: from here on all cache hits
            run_load("127.0.0.1", port, requests, 4, 1.0, warmup=0)
        for round_ in range(rounds):
            for name in list(targets) if round_ % 2 == 0 else list(targets)[::-1]:  # ABCDEF FEDCBA
                process, port = servers[name]
                server = psutil.Process(process.pid)
                cpu = sum(server.cpu_times()[:2])
                point = run_load("127.0.0.1", port, requests, clients, seconds, warmup=0.5)
                answered = point["requests_per_s"] * seconds
                used = sum(server.cpu_times()[:2]) - cpu
                point["server_cpu_us_per_request"] = round(used / answered * 1e6, 1)
                points[name].append(point)
                print(name, json.dumps(point), flush=True)
    summary = {
        name: {
            "requests_per_s": statistics.median(p["requests_per_s"] for p in ps),
            "server_cpu_us_per_request": statistics.median(p["server_cpu_us_per_request"] for p in ps),
        }
        for name, ps in points.items()
    }
    stage4, pure, idiom, direct, per_line, quiet = (summary[n] for n in targets)
    return {
        "clients": clients,
        "seconds": seconds,
        "rounds": rounds,
        "points": points,
        "median": summary,
        "idiom_over_pure_requests_per_s": round(idiom["requests_per_s"] / pure["requests_per_s"], 4),
        "idiom_over_pure_cpu_per_request": round(
            idiom["server_cpu_us_per_request"] / pure["server_cpu_us_per_request"], 4
        ),
        "stage5_over_stage4_requests_per_s": round(pure["requests_per_s"] / stage4["requests_per_s"], 4),
        "request_lines_cpu_us_per_request": {
            "QueueHandler, lines gathered (shipped)": round(
                pure["server_cpu_us_per_request"] - quiet["server_cpu_us_per_request"], 1
            ),
            "written on the loop": round(
                direct["server_cpu_us_per_request"] - quiet["server_cpu_us_per_request"], 1
            ),
            "QueueHandler, a wake-up per line": round(
                per_line["server_cpu_us_per_request"] - quiet["server_cpu_us_per_request"], 1
            ),
        },
        "gathering_over_per_line_requests_per_s": round(
            pure["requests_per_s"] / per_line["requests_per_s"], 4
        ),
    }


def markdown(result: dict[str, Any]) -> str:
    """stage5_middleware.md: one table a way of measuring, and the answer to the idiom question."""
    calls = table(["one call", "µs"], [(k, num(v, 2)) for k, v in result["calls_us"].items()])
    cpu = result["in_process"]["cpu_us_per_request"]
    in_process = table(["app (one memory-cache hit through ASGI)", "CPU µs a request"],
                       [(k, num(v, 1)) for k, v in cpu.items()])  # fmt: skip
    sockets_ = result["sockets"]
    median = sockets_["median"]
    sockets = table(
        ["server (32 clients, cached texts)", "req/s", "server CPU µs a request"],
        [(k, num(v["requests_per_s"], 0), num(v["server_cpu_us_per_request"], 1)) for k, v in median.items()],
    )
    ratios = table(
        ["@app.middleware against the pure ASGI middleware", "ratio"],
        [
            ("CPU a request, in process", f"{result['in_process']['idiom_over_pure']:.2f}x"),
            ("req/s over sockets", f"{sockets_['idiom_over_pure_requests_per_s']:.2f}x"),
            ("server CPU a request over sockets", f"{sockets_['idiom_over_pure_cpu_per_request']:.2f}x"),
        ],
    )
    lines = sockets_["request_lines_cpu_us_per_request"]
    listener = table(
        ["the request lines, over sockets", "server CPU µs a request"],
        [*[(k, num(v, 1)) for k, v in lines.items()],
         ("req/s, lines gathered against a wake-up per line",
          f"{sockets_.get('gathering_over_per_line_requests_per_s', 0):.2f}x")],
    )  # fmt: skip
    note = (
        f"In process: {result['in_process']['blocks']} alternating blocks of"
        f" {result['in_process']['requests_per_block']} requests. Over sockets: {result['sockets']['rounds']}"
        f" rounds of {result['sockets']['seconds']:g} s, {result['sockets']['clients']} closed-loop clients,"
        " the servers in turns."
    )
    return (
        page(
            result["stamp"],
            {
                "calls": calls,
                "in_process": in_process,
                "sockets": sockets,
                "middleware": ratios,
                "listener": listener,
            },
            note,
        )
        + "\n"
    )


def headline(result: dict[str, Any]) -> dict[str, float]:
    return {
        "idiom / pure, CPU in process": result["in_process"]["idiom_over_pure"],
        "idiom / pure, req/s over sockets": result["sockets"]["idiom_over_pure_requests_per_s"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="Folder for stage5_middleware.json and .md.")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.stage5_middleware", args, argv)
    out = sys.stdout
    sys.stderr = tempfile.TemporaryFile("w")  # noqa: SIM115 -- the request lines' sink, as a container's log
    result: dict[str, Any] = {"stamp": {}}
    result["calls_us"] = calls(2_000 if args.quick else 20_000)
    print(json.dumps(result["calls_us"], indent=1), file=out, flush=True)
    blocks, per_block = (4, 100) if args.quick else (20, 500)
    result["in_process"] = asyncio.run(in_process(blocks, per_block))
    print(json.dumps(result["in_process"], indent=1), file=out, flush=True)
    sys.stderr = sys.__stderr__
    rounds, seconds = (2, 2.0) if args.quick else (4, 10.0)
    result["sockets"] = sockets(rounds, seconds, clients=32)
    result["stamp"] = run.stamp()
    evidence.publish(run, args.out, "stage5_middleware", result, markdown, headline)


if __name__ == "__main__":
    main()
