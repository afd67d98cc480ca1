"""Stage 5's cost per request without the network: both apps in one process, driven through ASGI.

    python -m benchmarks.stage5_asgi      # prints JSON; `make stage5-overhead` runs it too

Throughput over sockets moves by more than a few percent whenever anything else runs on the
machine. Here stage 4's and stage 5's apps run in one process, one cached request at a time,
in alternating blocks, timed in the process's own CPU time (``time.process_time``, which also
counts the tokenizer's worker threads), so other programs on the machine hardly count and both
apps see the same conditions; the difference is what stage 5's middleware, backend subclass,
counters and request log add to one request (the window samples once a second, not per request).
Request lines go to a temporary file, as they would to a container's log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from starlette.types import ASGIApp, Message

_BODY = b'{"inputs": ["a sentence the cache will answer after the first time"]}'


def _scope() -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/embed",
        "raw_path": b"/v1/embed",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(_BODY)).encode())],
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
        "state": {},
    }


async def _request(app: ASGIApp) -> int:
    sent_body = False
    status = 0
    never = asyncio.Event()

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": _BODY, "more_body": False}
        await never.wait()  # the client stays connected
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(_scope(), receive, send)
    return status


async def _lifespan(app: ASGIApp) -> tuple[asyncio.Task[None], asyncio.Queue[Message]]:
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    outbox: asyncio.Queue[Message] = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    task: asyncio.Task[None] = asyncio.ensure_future(app(scope, inbox.get, outbox.put))
    started = await outbox.get()
    if started["type"] != "lifespan.startup.complete":
        raise RuntimeError(f"app did not start: {started}")
    return task, inbox


async def _stage5_without(part: str) -> tuple[ASGIApp, Callable[[bool], None]]:
    """Stage 5 (started) and a switch that turns one of its parts off and on (measurement only)."""
    from stage5_metrics.app import build_app

    app = build_app()
    _started.append(await _lifespan(app))
    if part == "request log":  # the logger is the process's: off only while this app's blocks run
        requests = logging.getLogger("embedserve.requests")

        def switch(off: bool) -> None:
            requests.setLevel(logging.WARNING if off else logging.NOTSET)

        return app, switch
    metrics = app.state.backend.metrics  # "metrics": the per-request counters and histograms
    saved = metrics.observe_request, metrics.observe_result

    def switch_metrics(off: bool) -> None:
        if off:
            metrics.observe_request = metrics.observe_result = lambda *args: None
        else:
            metrics.observe_request, metrics.observe_result = saved

    return app, switch_metrics


PARTS = ("request log", "metrics")
_started: list[tuple[asyncio.Task[None], asyncio.Queue[Message]]] = []


async def measure(blocks: int, per_block: int) -> dict[str, Any]:
    from stage4_cache_backpressure.app import app as stage4
    from stage5_metrics.app import app as stage5

    apps: dict[str, ASGIApp] = {"stage4_cache_backpressure": stage4, "stage5_metrics": stage5}
    running = [await _lifespan(app) for app in apps.values()]
    switches: dict[str, Callable[[bool], None]] = {}
    for part in PARTS:
        apps[f"stage5 without {part}"], switches[f"stage5 without {part}"] = await _stage5_without(part)
    running += _started
    for app in apps.values():  # the first call computes, every later one is a memory-cache hit
        assert await _request(app) == 200
    times: dict[str, list[float]] = {name: [] for name in apps}
    for block in range(blocks):
        order = list(apps) if block % 2 == 0 else list(apps)[::-1]
        for name in order:
            switch = switches.get(name, lambda off: None)
            switch(True)
            started = time.process_time()  # this process's CPU time, every thread
            for _ in range(per_block):
                await _request(apps[name])
            times[name].append((time.process_time() - started) / per_block * 1e6)
            switch(False)
    for task, inbox in running:
        await inbox.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(task, 30)
    us = {name: statistics.median(t) for name, t in times.items()}
    s4, s5 = us["stage4_cache_backpressure"], us["stage5_metrics"]
    return {
        "blocks": blocks,
        "requests_per_block": per_block,
        "us_per_request": {name: round(v, 2) for name, v in us.items()},
        "added_us_per_request": round(s5 - s4, 2),
        "stage5_over_stage4": round(s5 / s4, 4),
        # what switching one part off saves, per request
        "parts_us": {part: round(s5 - us[f"stage5 without {part}"], 2) for part in PARTS},
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--per-block", type=int, default=500)
    args = parser.parse_args(argv)
    out = sys.stdout
    sys.stderr = tempfile.TemporaryFile("w")  # noqa: SIM115 -- the log sink lives as long as the process
    result = asyncio.run(measure(args.blocks, args.per_block))
    print(json.dumps(result), file=out)


if __name__ == "__main__":
    main()
