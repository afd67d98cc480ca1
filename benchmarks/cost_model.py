"""The cost model: what one request costs, part by part, and what that predicts for every stage.

    python -m benchmarks.cost_model            # about 2 minutes
    python -m benchmarks.cost_model --quick    # about 30 s, to see that it works
    python -m benchmarks.cost_model --record   # written to docs/results/cost_model.*
    make results ONLY=cost-model                      # the same (QUICK=1, RECORD=1)

The constants, each measured on its own on this machine, on 12-20 word sentences (the texts of
the load tests):

* ``model_ms``: one text through the model, batch 1, one ONNX Runtime thread (CPU time): what
  a stage 2 worker or a stage 3 slot spends per call; ``model_ms_all_threads``: the same call
  with ONNX Runtime's default threads (wall time), the way stage 0's script and stage 1 call it;
* ``call_overhead_ms``: what one more call costs, from k calls of one row against one call of
  k rows of the same length (no padding), and the same in padded tokens
  (``call_overhead_tokens``, the unit of CALL_OVERHEAD_TOKENS); ``per_text_in_batch_ms``: a
  text's share of one call of k real sentences (padded to the longest, as a batch is);
* ``tokenize_ms``: one text through the tokenizer; ``hop_ms``: one hand-off to a worker thread
  and back (``run_in_executor`` of a function that does nothing);
* ``http``: the server with the real API contract and no model (``benchmarks/null_backend``)
  over sockets at 1 and 32 connections of ``wrk`` (as ``make results ONLY=layers`` loads the stages):
  requests/s, and the server's and the load generator's CPU per request (it runs on the same
  cores, as in every load test here).

From them, ``predict`` gives each stage's requests/s at 1 and 32 connections (formulas in its
docstring), and the page puts the prediction beside what ``layers.json`` and ``compare.json``
measured, read from the same results folder (run this after them: ``make results`` does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from benchmarks.stage3 import bodies_for
from common import corpus
from common.engine import Engine
from common.serve import STAGES  # every server stage, in order
from common.settings import Settings
from loadtests import evidence, load
from loadtests.load import process_cpu, settle
from loadtests.procs import running_stage
from loadtests.tables import num, page, stage_label, table

NULL_STAGE = "benchmarks.null_backend"
CONNECTIONS = (1, 32)
BATCH_K = 16  # rows in the one-call-of-k measurements


# --- the constants -----------------------------------------------------------------------
def _per_call(fn: Callable[[], object], n: int, rounds: int, clock: Callable[[], float]) -> float:
    """Milliseconds per call of ``fn``: the median of ``rounds`` rounds of ``n`` calls."""
    per_round = []
    for _ in range(rounds):
        start = clock()
        for _ in range(n):
            fn()
        per_round.append((clock() - start) / n * 1e3)
    return statistics.median(per_round)


def model_constants(settings: Settings, texts: list[str], rounds: int, n: int) -> dict[str, float]:
    one = Engine(settings.model_dir, variant=settings.model_variant, intra_threads=1)
    default = Engine.from_settings(settings)  # one call at a time: ONNX Runtime's default threads
    for engine in (one, default):
        engine.warmup()
    ids = [t.ids for t in one.tokenize(texts)]
    cycle = iter(range(10**9))

    def one_text(engine: Engine) -> Callable[[], object]:
        return lambda: engine.run([ids[next(cycle) % len(ids)]])

    same = [ids[0]] * BATCH_K  # k rows of one length: no padding, only the calls differ
    chunks = [ids[i : i + BATCH_K] for i in range(0, len(ids) - BATCH_K + 1, BATCH_K)]
    chunk = iter(range(10**9))
    apart = _per_call(lambda: [one.run([row]) for row in same], 3, rounds, time.process_time)
    joint = _per_call(lambda: one.run(same), 3, rounds, time.process_time)
    per_token = joint / (BATCH_K * len(same[0]))
    overhead = (apart - joint) / (BATCH_K - 1)
    return {
        "model_ms": _per_call(one_text(one), n, rounds, time.process_time),
        "model_ms_all_threads": _per_call(one_text(default), n, rounds, time.perf_counter),
        "call_overhead_ms": overhead,
        "per_text_in_batch_ms": _per_call(
            lambda: one.run(chunks[next(chunk) % len(chunks)]), 3, rounds, time.process_time
        )
        / BATCH_K,
        # One sentence, alone and as one of k copies (one length: no padding), and one more
        # call's price in padded tokens: what the length buckets weigh (CALL_OVERHEAD_TOKENS).
        "same_row_tokens": len(same[0]),
        "same_row_alone_ms": apart / BATCH_K,
        "same_row_in_batch_ms": joint / BATCH_K,
        "call_overhead_tokens": overhead / per_token,
        "tokenize_ms": _per_call(
            lambda: one.tokenize([texts[next(cycle) % len(texts)]]), n * 4, rounds, time.process_time
        ),
        "hop_ms": _hop_ms(n * 4, rounds),
    }


def _hop_ms(n: int, rounds: int) -> float:
    """CPU milliseconds of one ``run_in_executor`` round trip of a function that does nothing."""
    pool = ThreadPoolExecutor(max_workers=1)

    async def hops() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(n):
            await loop.run_in_executor(pool, int)

    per_round = []
    for _ in range(rounds):
        start = time.process_time()
        asyncio.run(hops())
        per_round.append((time.process_time() - start) / n * 1e3)
    pool.shutdown()
    return statistics.median(per_round)


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (each ``wrk`` run, once it has exited)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def http_constants(seconds: float, warmup: float, logs: Path) -> dict[str, dict[str, float]]:
    """The null backend over sockets under ``wrk`` (as ``make results ONLY=layers`` loads the stages):
    requests/s, and the server's and the load generator's CPU ms per request."""
    bodies = bodies_for("sentence", 20_000, seed=4242)
    measured_s = max(1, math.ceil(seconds))  # wrk runs whole seconds
    out = {}
    with running_stage(NULL_STAGE, logs) as server:
        for connections in CONNECTIONS:
            settle(server.pid, server.url)
            load.wrk(server.url, bodies[::-1], connections, warmup)  # warm-up on other texts
            process = psutil.Process(server.pid)
            cpu, client = process_cpu(process), _children_cpu()
            point = load.wrk(server.url, bodies, connections, measured_s)
            served = point["requests_per_s"] * measured_s
            out[str(connections)] = {
                "requests_per_s": point["requests_per_s"],
                "p50_ms": point["p50_ms"],
                "server_cpu_ms": (process_cpu(process) - cpu) * 1e3 / served,
                "client_cpu_ms": (_children_cpu() - client) * 1e3 / served,
            }
            print(json.dumps({"connections": connections, **out[str(connections)]}), flush=True)
    return out


# --- the prediction ----------------------------------------------------------------------
def predict(c: dict[str, Any], cores: int) -> dict[str, dict[str, float]]:
    """Requests/s of each stage at 1 and 32 connections, one new sentence per request.

    One connection: nothing overlaps, so a request takes the null backend's round trip
    (``1000 / http[1].requests_per_s`` ms: client, HTTP, contract, tokenizer) plus the model call:
    with every thread in stage 1, with one thread and a hop to the worker from stage 2 on.

    32 connections: the cores are the limit. A request needs the event loop's work ``h`` (server
    CPU per request of the null backend), the client's ``g`` and the model's ``m``; the cores give
    ``1000 * cores / (h + g + m)`` requests/s, and the event loop, one thread, at most
    ``1000 / h``. Stage 1 runs the model on the loop itself: ``1000 / (h + model_ms_all_threads)``.
    Stage 2: ``m = model_ms`` plus a hop. Stages 3-5 at best share every call's overhead among a
    batch: ``m = per_text_in_batch_ms``. What stages 4 and 5 add (a cache lookup, metrics) is not
    in the model: the difference to the measurement is that cost.
    """
    http1, http32 = c["http"]["1"], c["http"]["32"]
    round_trip = 1e3 / http1["requests_per_s"]
    h, g = http32["server_cpu_ms"], http32["client_cpu_ms"]
    threaded = round_trip + c["model_ms"] + c["hop_ms"]
    out = {"stage1_naive": {"1": 1e3 / (round_trip + c["model_ms_all_threads"]),
                            "32": 1e3 / (h + c["model_ms_all_threads"])},
           "stage2_threadpool": {"1": 1e3 / threaded,
                                 "32": min(1e3 / (h + c["hop_ms"]),
                                           1e3 * cores / (h + c["hop_ms"] + g + c["model_ms"]))}}  # fmt: skip
    batched = min(1e3 / h, 1e3 * cores / (h + g + c["per_text_in_batch_ms"]))
    for stage in STAGES[2:]:
        out[stage] = {"1": 1e3 / threaded, "32": batched}
    return out


def cores_until_the_loop_limits(c: dict[str, Any]) -> float:
    """Cores at which stage 3's event loop, not the cores, caps the requests/s (client elsewhere)."""
    h = c["http"]["32"]["server_cpu_ms"]
    return (h + c["per_text_in_batch_ms"]) / h


# --- what was measured beside it ---------------------------------------------------------
def _found(name: str, folder: Path) -> Path:
    """``folder/name`` when it is there (a reader's own run in out/), else the committed one."""
    return folder / name if (folder / name).is_file() else evidence.RESULTS / name


def measured(folder: Path) -> dict[str, Any]:
    """Requests/s at 1 and 32 connections from layers.json and compare.json (``_found``)."""
    out: dict[str, Any] = {}
    path = _found("layers.json", folder)
    if path.is_file():
        layers = json.loads(path.read_text())
        out["layers"] = {
            "from": evidence.provenance(layers.get("stamp") or {}),
            "engine_texts_per_s": (layers.get("ceiling") or {}).get("texts_per_s"),
            "rps": {
                stage: {n: layers["summary"][n][stage]["requests_per_s"] for n in ("1", "32")}
                for stage in layers["stages"]
                if all(n in layers["summary"] for n in ("1", "32"))
            },
        }
    path = _found("compare.json", folder)
    if path.is_file():
        compare = json.loads(path.read_text())
        rps: dict[str, dict[str, float]] = {}
        for point in compare["points"]:
            if point["profile"] in ("unique-1", "unique-32"):
                rps.setdefault(point["stage"], {})[str(point["users"])] = point["rps"]
        out["compare"] = {
            "from": evidence.provenance(compare.get("stamp") or {}),
            "engine_texts_per_s": ((compare.get("engine_ceiling") or {}).get("sentence") or {}).get(
                "texts_per_s"
            ),
            "rps": rps,
        }
    return out


# --- the results page --------------------------------------------------------------------
def markdown(result: dict[str, Any]) -> str:
    c, cores = result["constants"], result["cores"]
    http1, http32 = c["http"]["1"], c["http"]["32"]
    rows = [
        ("model, 1 text, 1 thread", num(c["model_ms"], 2), "CPU ms per call"),
        ("model, 1 text, default threads", num(c["model_ms_all_threads"], 2), "wall ms (stages 0, 1)"),
        ("overhead of one more call", num(c["call_overhead_ms"], 2), f"CPU ms ({BATCH_K} calls vs 1 call)"),
        (f"a text in a call of {BATCH_K}", num(c["per_text_in_batch_ms"], 2), "CPU ms per text, padded"),
        ("tokenize 1 text", num(c["tokenize_ms"], 3), "CPU ms"),
        ("hop to a thread and back", num(c["hop_ms"], 3), "CPU ms"),
        ("HTTP + contract, 1 connection", num(1e3 / http1["requests_per_s"], 2), "ms per round trip"),
        ("HTTP + contract, 32 connections", num(http32["server_cpu_ms"], 2), "server CPU ms per request"),
        ("load generator, 32 connections", num(http32["client_cpu_ms"], 2), "client CPU ms per request"),
    ]  # fmt: skip
    constants = table(["constant", "value", "unit"], rows, "lrl")
    meas = result["measured"]
    layers = meas.get("layers", {}).get("rps", {})
    compare = meas.get("compare", {}).get("rps", {})
    pred_rows = []
    for stage in STAGES:
        p, lay, com = result["prediction"][stage], layers.get(stage, {}), compare.get(stage, {})
        pred_rows.append((
            stage_label(stage),
            num(p["1"], 0), num(lay.get("1"), 0), num(com.get("1"), 0),
            num(p["32"], 0), num(lay.get("32"), 0), num(com.get("32"), 0),
        ))  # fmt: skip
    prediction = table(
        ["stage", "1 conn: predicted", "layers", "compare", "32 conn: predicted", "layers", "compare"],
        pred_rows,
        "lrrrrrr",
    )
    sources = [
        f"`{name}.json`: commit `{str(m['from'].get('commit'))[:7]}`, {str(m['from'].get('date'))[:10]}"
        + (" (QUICK)" if m["from"].get("quick") else "")
        + (f", the engine alone {m['engine_texts_per_s']:.0f} texts/s" if m.get("engine_texts_per_s") else "")
        for name, m in meas.items()
    ]
    prediction += [
        "",
        "Predicted from the constants above; measured (req/s, one new sentence per request) by "
        + ("; ".join(sources) if sources else "nothing yet: run `make results ONLY=layers,compare` first")
        + ". `layers` loads the stages with `wrk`, as the constants were measured; `compare` uses"
        " Locust, which spends more CPU per request on the same cores. Two runs on machines of"
        " different speed show it in the engine's figure: compare a column with its own run's.",
    ]
    alone, batched = c["model_ms"], c["per_text_in_batch_ms"]
    share = 100 * (alone - batched) / alone
    saving = [
        f"A text costs the model {alone:.2f} ms alone and {batched:.2f} ms as one of {BATCH_K} sentences in"
        + (
            f" one call: batching saves {alone - batched:.2f} ms a text ({share:.0f} % of the model's time)."
            if alone >= batched
            else f" one call: in this run a batch cost {batched - alone:.2f} ms a text more"
            f" ({-share:.0f} % of the model's time), the padding to its longest sentence outweighing"
            " the calls it saved."
        )
        + f" One more call costs {c['call_overhead_ms']:.2f} ms when the rows have one length, no padding:"
        " the most a batch can save a text."
    ]
    if "same_row_in_batch_ms" in c:  # (results recorded before these figures were measured lack them)
        solo, joint = c["same_row_alone_ms"], c["same_row_in_batch_ms"]
        saving += [
            "",
            f"Without padding, batching does pay: one sentence of {c['same_row_tokens']} tokens costs"
            f" {solo:.2f} ms alone and {joint:.2f} ms as one of {BATCH_K} copies in one call"
            f" ({100 * (solo - joint) / solo:.0f} % less). In padded tokens, one more call costs as much as"
            f" {c['call_overhead_tokens']:.0f} (one thread per call, as the batcher's slots run); the length"
            f" buckets price it at CALL_OVERHEAD_TOKENS ({Settings().call_overhead_tokens} by default).",
        ]
    h = http32["server_cpu_ms"]
    loop = [
        f"Stage 3's event loop, one thread, spends {h:.2f} ms of CPU a request: it can carry at most"
        f" {1e3 / h:,.0f} requests/s, a rate the cores reach with about {cores_until_the_loop_limits(c):.0f}"
        f" cores (the load generator elsewhere). This machine has {cores}."
    ]
    return page(
        result["stamp"], {"constants": constants, "prediction": prediction, "batching": saving, "loop": loop}
    ) + "\n"  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="Folder for cost_model.json and .md.")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.cost_model", args, argv)
    settings = Settings()
    cores = len(psutil.Process().cpu_affinity() or []) or psutil.cpu_count() or 1
    texts = corpus.texts(256, seed=31, kind="sentence")
    rounds, n = (3, 100) if args.quick else (7, 400)
    constants: dict[str, Any] = model_constants(settings, texts, rounds, n)
    print(json.dumps(constants), flush=True)
    seconds, warmup = (2.0, 0.5) if args.quick else (10.0, 2.0)
    constants["http"] = http_constants(seconds, warmup, run.logs("cost_model"))
    out = args.out or run.results_dir
    result = {
        "stamp": {},
        "text_kind": "sentence",
        "cores": cores,
        "batch_k": BATCH_K,
        "constants": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in constants.items()},
        "prediction": {
            stage: {n: round(rps, 1) for n, rps in by_n.items()}
            for stage, by_n in predict(constants, cores).items()
        },
        "measured": measured(out),
        "cores_until_the_loop_limits": round(cores_until_the_loop_limits(constants), 2),
    }
    result["stamp"] = run.stamp()
    evidence.publish(run, "cost_model", result, markdown, out)


if __name__ == "__main__":
    main()
