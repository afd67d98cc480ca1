"""What stage 4's and stage 5's layers cost a request, apart from the model and the network.

    python -m benchmarks.layers            # about a minute
    python -m benchmarks.layers --record   # docs/results/layers.{json,md}

Throughput under a load generator varies by 10 to 20 % a round on two shared cores, as much as
a layer costs, so ``make compare`` can say "within noise" and no more. Here stages 3, 4 and 5 run
in one process, their apps as the servers build them, the model answering at once with zeros
(the tokenizer still runs), driven through httpx's ``ASGITransport`` by ``CLIENTS`` clients: no
sockets, no HTTP parsing, nothing else on the event loop. The figure is the event loop's own CPU
a request (``time.thread_time`` of the thread that runs it, the clients' share included, the same
for every stage), the stages in turns, ``--rounds`` rounds; then one more round of each under
cProfile, for where a layer's time goes: the functions of the repository with the most own time.
Python's garbage collector runs inside whatever function allocates when a collection is due, and
its work grows with the objects a stage keeps (stage 4's cache): its time is counted apart in
every round (``gc.callbacks``), and the profiled round runs with the collector off, so a function's
own time is its own. A profile's own times carry the profiler's cost of every call; what a piece of a
layer costs is measured the other way too: switched off, as its setting does in a server (stage 4's
cache, stage 5's request line), in rounds of their own in the same turns, on texts of their own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import itertools
import logging
import os
import pstats
import statistics
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from fastapi import FastAPI

from common.engine import Engine
from loadtests import evidence
from loadtests.load import bodies_for
from loadtests.tables import num, page, stage_label, table

CLIENTS, REQUESTS = 32, 2000  # a round: REQUESTS one-text requests from CLIENTS clients at once
STAGES = ("stage3_batching", "stage4_cache_backpressure", "stage5_metrics")
REPO = str(Path(__file__).resolve().parent.parent)


def _cache_off(app: FastAPI, off: bool) -> None:
    app.state.backend.cache.enabled = not off  # what CACHE_ENABLED=false does to a request


def _request_line_off(app: FastAPI, off: bool) -> None:
    logging.getLogger("embedserve.requests").setLevel(logging.WARNING if off else logging.NOTSET)


# A piece of a stage's layer, switched off: its name, the setting that does the same, the switch.
PIECES = {
    "stage4_cache_backpressure": ("the cache steps", "CACHE_ENABLED=false", _cache_off),
    "stage5_metrics": ("the request's log line", "LOG_LEVEL=WARNING", _request_line_off),
}


def _instant(self: Engine, token_ids: Sequence[np.ndarray]) -> np.ndarray:
    """The model, answering at once: what is left of a request is the layers' own work."""
    return np.zeros((len(token_ids), self.dimensions), np.float32)


def build(stage: str) -> FastAPI:
    """The stage's app as ``make stageN`` builds it (stage 5 from its factory)."""
    if stage == "stage5_metrics":
        from stage5_metrics.app import create_app

        return create_app()
    module = __import__(f"{stage}.app", fromlist=["app"])
    return module.app  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def client_of(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://layers", timeout=60) as client:
            yield client


async def one_round(client: httpx.AsyncClient, bodies: list[bytes]) -> float:
    """Event-loop CPU microseconds a request over ``bodies``, sent by CLIENTS clients."""
    todo = iter(bodies)

    async def a_client() -> None:
        for body in todo:
            answer = await client.post(
                "/v1/embed", content=body, headers={"content-type": "application/json"}
            )
            if answer.status_code != 200:
                raise RuntimeError(f"{answer.status_code}: {answer.text[:200]}")

    started = time.thread_time()
    await asyncio.gather(*(a_client() for _ in range(CLIENTS)))
    return (time.thread_time() - started) * 1e6 / len(bodies)


@contextlib.contextmanager
def collecting() -> Iterator[list[float]]:
    """The event-loop thread's CPU seconds in garbage collection meanwhile: ``[seconds]``."""
    spent, began = [0.0], [0.0]

    def timed(phase: str, _: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.thread_time()
        else:
            spent[0] += time.thread_time() - began[0]

    gc.callbacks.append(timed)
    try:
        yield spent
    finally:
        gc.callbacks.remove(timed)


def where(profile: cProfile.Profile, requests: int, top: int) -> list[dict[str, Any]]:
    """The repository's functions with the most own time, in microseconds a request."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = [(f"{Path(file).relative_to(REPO)}:{line} {name}", own * 1e6 / requests)
            for (file, line, name), (_, _, own, _, _) in stats.items()
            if file.startswith(REPO) and "site-packages" not in file]  # fmt: skip
    rows.sort(key=lambda r: -r[1])
    return [{"function": f, "us": round(us, 1)} for f, us in rows[:top]]


async def measure(rounds: int, top: int) -> dict[str, Any]:
    Engine.run = _instant  # type: ignore[method-assign]
    async with contextlib.AsyncExitStack() as stack:
        apps = {s: build(s) for s in STAGES}
        clients = {s: await stack.enter_async_context(client_of(apps[s])) for s in STAGES}
        for s in STAGES:  # every path warm: imports, first batches, caches of code
            await one_round(clients[s], bodies_for("sentence", 300, 900))
        runs: dict[str, list[float]] = {s: [] for s in STAGES}
        collected: dict[str, list[float]] = {s: [] for s in STAGES}
        without: dict[str, list[float]] = {s: [] for s in PIECES}
        turns = [(s, False) for s in STAGES] + [(s, True) for s in PIECES]
        for r in range(rounds):
            # new texts each round, the same for every stage: all misses (a piece switched off
            # runs in its stage's app, so on texts of its own)
            bodies, own = (
                bodies_for("sentence", REQUESTS, 1000 + r),
                bodies_for("sentence", REQUESTS, 3000 + r),
            )
            for s, off in turns if r % 2 == 0 else turns[::-1]:
                if off:
                    PIECES[s][2](apps[s], True)
                    without[s].append(round(await one_round(clients[s], own), 1))
                    PIECES[s][2](apps[s], False)
                    continue
                with collecting() as gc_s:
                    runs[s].append(round(await one_round(clients[s], bodies), 1))
                collected[s].append(round(gc_s[0] * 1e6 / REQUESTS, 1))
                print(f"round {r + 1}/{rounds} {s}: {runs[s][-1]} us a request", flush=True)
        profiles = {}
        for s in STAGES:
            profile = cProfile.Profile()
            gc.disable()  # a collection's time would land on whichever function allocated
            profile.enable()
            await one_round(clients[s], bodies_for("sentence", REQUESTS, 2000))
            profile.disable()
            gc.enable()
            profiles[s] = where(profile, REQUESTS, top)
    return {"runs": runs, "gc_us": collected, "without": without, "where": profiles}


def summarize(runs: dict[str, list[float]], without: dict[str, list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for before, stage in itertools.pairwise(STAGES):
        extra = [b - a for a, b in zip(runs[before], runs[stage], strict=True)]  # the same round
        out[stage] = {"over_previous_us": statistics.median(extra), "rounds_us": extra,
                      "share": statistics.median(extra) / statistics.median(runs[before])}  # fmt: skip
    for stage, off in without.items():
        cost = [a - b for a, b in zip(runs[stage], off, strict=True)]
        out[stage]["piece_us"], out[stage]["piece_rounds_us"] = statistics.median(cost), cost
    return out


def markdown(result: dict[str, Any]) -> str:
    runs, extra = result["runs"], result["summary"]
    rows = [(stage_label(s), num(statistics.median(runs[s]), 0), ", ".join(num(x, 0) for x in runs[s]),
             num(statistics.median(result["gc_us"][s]), 0), num(extra[s]["over_previous_us"], 0) if s in extra
             else "", f"{extra[s]['share']:+.0%}" if s in extra else "") for s in STAGES]  # fmt: skip

    def noise(r: list[float]) -> str:  # a direction only where every round has it
        return "" if min(r) > 0 or max(r) < 0 else ", within noise"

    said = "; ".join(
        f"{stage_label(s)} adds {extra[s]['over_previous_us']:.0f} µs a request to {stage_label(b)}'s"
        f"{noise(extra[s]['rounds_us'])} ({extra[s]['share']:+.0%}; rounds {min(extra[s]['rounds_us']):.0f}"
        f" to {max(extra[s]['rounds_us']):.0f} µs)"
        for b, s in itertools.pairwise(STAGES)
    )
    sections = {
        "layers": table(["stage", "event-loop CPU µs a request", "each round", "of it, garbage collection",
                         "added µs (median of the rounds')", "share"],
                        rows, "lrlrrr"),
        "layers_said": [f"With the model answering at once: {said}."],
    }  # fmt: skip
    pieces = [(f"{stage_label(s)}: {PIECES[s][0]}", f"`{PIECES[s][1]}`", num(extra[s]["piece_us"], 0),
               ", ".join(num(x, 0) for x in extra[s]["piece_rounds_us"]),
               f"{extra[s]['piece_us'] / extra[s]['over_previous_us']:.0%}") for s in PIECES]  # fmt: skip
    sections["pieces"] = table(["piece", "switched off by", "µs a request it costs", "each round",
                                "of the stage's layer"], pieces, "llrlr")  # fmt: skip

    def piece(s: str) -> str:
        cost, rounds = extra[s]["piece_us"], extra[s]["piece_rounds_us"]
        return (f"{PIECES[s][0]} cost {stage_label(s)} {cost:.0f} µs a request{noise(rounds)} (rounds"
                f" {min(rounds):.0f} to {max(rounds):.0f} µs), of the {extra[s]['over_previous_us']:.0f} µs"
                " its layer adds")  # fmt: skip

    sections["pieces_said"] = ["Switched off in rounds of their own: " + "; ".join(map(piece, PIECES)) + "."]
    for s in STAGES:
        sections[f"where-{s.split('_')[0]}"] = table(
            ["function (own time)", "µs a request"],
            [(f"`{w['function']}`", num(w["us"], 1)) for w in result["where"][s]],
            "lr",
        )
    note = (
        f"{result['requests']} one-sentence requests a round from {result['clients']} clients through"
        f" httpx's ASGITransport, the stages in turns, {result['rounds']} rounds; the model answers at once."
    )
    return page(result["stamp"], sections, note) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, help="rounds in turns (default 6; quick 2)")
    parser.add_argument("--top", type=int, default=8, help="functions shown for each stage")
    parser.add_argument("--out", type=Path, help="folder for the .json and .md (default: out/results)")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.layers", args, argv)
    rounds = args.rounds or (2 if args.quick else 6)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):  # stage 5's request lines
        got = asyncio.run(measure(rounds, args.top))
    result = {"stamp": run.stamp(), "clients": CLIENTS, "requests": REQUESTS, "rounds": rounds, **got,
              "summary": summarize(got["runs"], got["without"])}  # fmt: skip
    evidence.publish(run, "layers", result, markdown, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
