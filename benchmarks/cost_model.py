"""The cost model: what one request costs, part by part, what that predicts for stages 1 to 3, and
those stages measured in the same run beside the prediction.

    python -m benchmarks.cost_model            # about 2 minutes
    python -m benchmarks.cost_model --quick    # under a minute, to see that it works
    python -m benchmarks.cost_model --record   # written to docs/results/cost_model.{json,md}

The constants, in rounds taken in turns on 12-20 word sentences (the load tests' texts): the model
with one thread (stage 2's workers, stage 3's slots) and with every thread (stage 1), a text's
share of a padded call, tokenizing, a hop to a worker thread (one more call's price is stage 3's
measurement, ``benchmarks/stage3.py``); and the
HTTP side, the API contract without the model (``benchmarks/null_backend``) under ``wrk``, beside
stages 1-3 at the same loads: all four servers at once, in turns, so prediction and measurement
come from one run on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil

from common import corpus
from common.engine import Engine
from common.settings import Settings
from loadtests import evidence
from loadtests.load import bodies_for, process_cpu, settle, wrk
from loadtests.procs import running_stage
from loadtests.tables import num, page, stage_label, table

SERVERS = ("benchmarks.null_backend", "stage1_naive", "stage2_threadpool", "stage3_batching")
CONNECTIONS = (1, 32)
BATCH_K = 16  # sentences in the padded call


def constants(rounds: int, n: int) -> dict[str, Any]:
    """Each constant in ms, the median of ``rounds`` rounds taken in turns (a busy spell hits them all
    alike); the model alone and in calls of ``BATCH_K`` on the same ``4 * BATCH_K`` sentences."""
    settings, cpu = Settings(), time.process_time
    slot = Engine.from_settings(settings, calls_at_once=settings.worker_threads)  # stage 2's, stage 3's
    every = Engine.from_settings(settings)  # one call at a time, ONNX Runtime's default threads
    slot.warmup()
    every.warmup()
    texts = corpus.texts(4 * BATCH_K, seed=31, kind="sentence")
    ids = [t.ids for t in slot.tokenize(texts)]
    pool = ThreadPoolExecutor(1)

    async def hops() -> None:
        for _ in range(n):
            await asyncio.get_running_loop().run_in_executor(pool, int)

    calls = range(0, len(ids), BATCH_K)
    timed: dict[str, tuple[Callable[[], object], int, Callable[[], float]]] = {  # work, its count, clock
        "model_ms": (lambda: [slot.run([row]) for row in ids], len(ids), cpu),
        "model_ms_all_threads": (lambda: [every.run([row]) for row in ids], len(ids), time.perf_counter),
        "per_text_in_batch_ms": (lambda: [slot.run(ids[i : i + BATCH_K]) for i in calls], len(ids), cpu),
        "tokenize_ms": (lambda: [slot.tokenize([text]) for text in texts], len(texts), cpu),
        "hop_ms": (lambda: asyncio.run(hops()), n, cpu),
    }  # fmt: skip
    got: dict[str, list[float]] = {key: [] for key in timed}
    for _ in range(rounds):
        for key, (work, count, clock) in timed.items():
            start = clock()
            work()
            got[key].append((clock() - start) / count * 1e3)
    pairs = zip(got["per_text_in_batch_ms"], got["model_ms"], strict=True)  # in a call over alone, each round
    return {
        **{key: statistics.median(ms) for key, ms in got.items()},
        "batch_rounds": [b / a for b, a in pairs],
    }


def measure(seconds: float, rounds: int, logs: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Requests/s, p50, and the server's and wrk's CPU ms per request: every server and load in turns."""
    bodies = bodies_for("sentence", 20_000, seed=4242)
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    with ExitStack() as stack:
        up = {stage: stack.enter_context(running_stage(stage, logs)) for stage in SERVERS}
        for server in up.values():  # a first load, on other texts: every server warm
            wrk(server.url, bodies[::-1], 8, 1)
        for _ in range(rounds):
            for (stage, server), n in itertools.product(up.items(), CONNECTIONS):
                settle(server.pid, server.url)
                process = psutil.Process(server.pid)
                cpu, client = process_cpu(process), resource.getrusage(resource.RUSAGE_CHILDREN)
                point = wrk(server.url, bodies, n, seconds)
                usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # wrk's, once it has exited
                served = point["requests_per_s"] * math.ceil(seconds) or 1  # wrk runs whole seconds
                runs.setdefault((stage, n), []).append({
                    "requests_per_s": point["requests_per_s"], "p50_ms": point["p50_ms"],
                    "server_cpu_ms": (process_cpu(process) - cpu) * 1e3 / served,
                    "client_cpu_ms": (usage.ru_utime + usage.ru_stime - client.ru_utime - client.ru_stime)
                    * 1e3 / served})  # fmt: skip
                print(stage, n, runs[(stage, n)][-1], flush=True)
    median = {key: {k: statistics.median(p[k] for p in ps) for k in ps[0]} for key, ps in runs.items()}
    return {stage: {str(n): median[(stage, n)] for n in CONNECTIONS} for stage in SERVERS}


def predict(c: dict[str, Any], http: dict[str, dict[str, float]], cores: int) -> dict[str, dict[str, float]]:
    """Requests/s of stages 1-3 at 1 and 32 connections, one new sentence per request.

    One connection: nothing overlaps; a request takes the null backend's round trip plus a model
    call (stage 1: every thread; from stage 2 on: one thread and a hop). 32 connections: a request
    needs the event loop's ``h`` (the null backend's server CPU), wrk's ``g`` and the model's ``m``;
    the cores give ``cores / (h + g + m)``, the loop at most ``1 / h``. Stage 1 runs the model on
    the loop; stage 2 pays a call and a hop a request; stage 3 a text's share of a padded call.
    """
    trip, h, g = 1e3 / http["1"]["requests_per_s"], http["32"]["server_cpu_ms"], http["32"]["client_cpu_ms"]
    every, one, hop, shared = c["model_ms_all_threads"], c["model_ms"], c["hop_ms"], c["per_text_in_batch_ms"]
    return {
        "stage1_naive": {"1": 1e3 / (trip + every), "32": 1e3 / (h + every)},
        "stage2_threadpool": {"1": 1e3 / (trip + one + hop),
                              "32": min(1e3 / (h + hop), 1e3 * cores / (h + hop + g + one))},
        "stage3_batching": {"1": 1e3 / (trip + one + hop),
                            "32": min(1e3 / h, 1e3 * cores / (h + g + shared))},
    }  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    c, cores = result["constants"], result["cores"]
    null, pred, got = result["measured"][SERVERS[0]], result["prediction"], result["measured"]
    rows = [
        ("model, 1 text, one thread", num(c["model_ms"], 2), "CPU ms per call (stages 2, 3)"),
        ("model, 1 text, every thread", num(c["model_ms_all_threads"], 2), "wall ms per call (stage 1)"),
        (f"a text in a padded call of {BATCH_K}", num(c["per_text_in_batch_ms"], 2), "CPU ms per text"),
        ("tokenize 1 text", num(c["tokenize_ms"], 3), "CPU ms"),
        ("hop to a thread and back", num(c["hop_ms"], 3), "CPU ms"),
        ("HTTP + contract, 1 connection", num(1e3 / null["1"]["requests_per_s"], 2), "ms per round trip"),
        ("HTTP + contract, 32 connections", num(null["32"]["server_cpu_ms"], 2), "server CPU ms per request"),
        ("wrk, 32 connections", num(null["32"]["client_cpu_ms"], 2), "client CPU ms per request"),
    ]  # fmt: skip
    rps = {s: {n: got[s][n]["requests_per_s"] for n in ("1", "32")} for s in pred}
    head = [h for n in ("1", "32") for h in (f"{n} conn: predicted", "measured", "measured / predicted")]
    prediction = table(["stage", *head], [
        (stage_label(s), *(x for n in ("1", "32")
                           for x in (num(pred[s][n], 0), num(rps[s][n], 0), f"{rps[s][n] / pred[s][n]:.2f}")))
        for s in pred], "lrrrrrr")  # fmt: skip

    def ratio(a: str, b: str, n: str) -> str:
        return f"{pred[a][n] / pred[b][n]:.2f}x predicted, {rps[a][n] / rps[b][n]:.2f}x measured"

    s1, s2, s3 = SERVERS[1:]
    alone, batched, h = c["model_ms"], c["per_text_in_batch_ms"], null["32"]["server_cpu_ms"]
    each = c["batch_rounds"]
    sections = {
        "constants": table(["constant", "value", "unit"], rows, "lrl"),
        "prediction": prediction,
        "reading": [f"At one connection, stage 1 against stage 2: {ratio(s1, s2, '1')}. At 32 connections,"
                    f" stage 2 against stage 1: {ratio(s2, s1, '32')}; stage 3 against stage 2:"
                    f" {ratio(s3, s2, '32')}."],
        "batching": [f"In this run, on one thread, over {4 * BATCH_K} sentences (the median of {len(each)}"
                     f" rounds), a text costs the model {alone:.2f} ms of CPU alone and"
                     f" {batched:.2f} ms as one of {BATCH_K} sentences in one call, padded to the longest"
                     f" ({batched / alone:.2f}x; rounds {min(each):.2f}–{max(each):.2f}x)."],
        "loop": [f"The HTTP side alone (the contract with no model) spends {h:.2f} ms of CPU a request:"
                 f" one event loop can carry about"
                 f" {1e3 / h:,.0f} requests/s, a rate the cores reach with about"
                 f" {(h + batched) / h:.0f} cores (the load generator elsewhere). This machine has {cores}."],
    }  # fmt: skip
    note = (f"The constants: {len(each)} rounds in turns. The servers: {result['seconds']:g} s a point,"
            f" {result['rounds']} round(s).")  # fmt: skip
    return page(result["stamp"], sections, note)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.cost_model", args, argv)
    cores = len(psutil.Process().cpu_affinity() or []) or psutil.cpu_count() or 1
    rounds, n, seconds = (3, 50, 1.0) if args.quick else (5, 100, 3.0)
    result: dict[str, Any] = {"stamp": {}, "cores": cores, "seconds": seconds, "rounds": rounds // 2}
    result["constants"] = constants(rounds, n)
    result["measured"] = measure(seconds, rounds // 2, run.logs("cost_model"))
    result["prediction"] = predict(result["constants"], result["measured"][SERVERS[0]], cores)
    result["stamp"] = run.stamp()
    evidence.publish(run, "cost_model", result, markdown)


if __name__ == "__main__":
    main()
