"""Stage 3's measurements: the batch-size sweep, the window by load, and what each refinement
changes (its targets against stage 2 and the engine come from ``make compare``'s run).

    python -m benchmarks.stage3            # about 4 minutes; run it on a quiet machine
    python -m benchmarks.stage3 --quick    # about a minute, to see that it works
    python -m benchmarks.stage3 --record   # written to docs/results/stage3.{json,md}

One run, one machine:

* ``call_overhead``: what one more model call costs in padded tokens: k calls of one row against
  one call of k rows, CPU time, one thread a call as a slot runs.
* ``plateau``: the engine alone, mixed-length texts in batches of 1 to 32, in arrival order and
  sorted by length: CPU ms a text, the reason the sweep's curve flattens where it does.
* ``servers``: stage 1, 2 and 3 servers, all running at once and taking turns under Locust
  (``loadtests.load.locust``, one new sentence per request), in rounds: stage 3 with MAX_BATCH_SIZE
  1 to 32 beside stages 1 and 2 at 32 and 128 connections (the sweep: ``batch_sweep`` and
  ``baselines``); stage 3 with windows for its MEDIUM and HIGH tiers at 8, 32 and 128 connections
  (the windows). A point's figures are their medians over the rounds.
* ``classifier``: the refined batcher with the real engine (no HTTP), closed-loop clients that step
  from 1 to 64 and back (``STEPS``), under the depth rule (the default) and the rate rule
  (BATCH_TIER_RULE=rate), in turns, with windows set (``RULE_WINDOWS``) so a tier changes what a
  batch does: how long each rule takes to see the step, the lone requests that waited a window
  for nothing, and the batches that went at once while 64 clients waited.
* ``refinements``: 256 mixed texts queued at once, straight into the batcher (no HTTP): the
  textbook ``Batcher``, then the refinements added one at a time in the chapter's order. What the
  batcher decides is counted with a stand-in model (the same on every machine; one text makes it
  raise), its speed with the real engine. Then the length buckets at several prices of a call
  (CALL_OVERHEAD_TOKENS), in turns: the measurement behind its default.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from benchmarks.compare import CEILING_SEED, rounds_word, unanimous
from common import corpus
from common.batch_stats import BatchRecord
from common.engine import Engine, TokenizedText
from common.settings import Settings
from loadtests import evidence
from loadtests.evidence import save_figure
from loadtests.load import bodies_for, locust, settle
from loadtests.procs import running_stage
from loadtests.tables import num, page, table
from stage3_batching.batcher import Batcher, Model
from stage3_batching.refined import refined

S1, S2, S3 = "stage1_naive", "stage2_threadpool", "stage3_batching"
SWEEP, SWEPT = (32, 128), (1, 2, 4, 8, 16)  # the sweep's loads, and its MAX_BATCH_SIZE (the default too)
# name: (stage, settings, connections). "MEDIUM / HIGH" are the tiers' windows in ms; 0 / 0 is the default.
SERVERS = {
    "stage 1": (S1, {}, SWEEP),
    "stage 2": (S2, {}, SWEEP),
    "0 / 0": (S3, {}, (8, *SWEEP)),
    **{f"batch {b}": (S3, {"MAX_BATCH_SIZE": str(b)}, SWEEP) for b in SWEPT},
    "0 / 2": (S3, {"BATCH_WINDOW_HIGH_MS": "2"}, (8, 32, 128)),
    "2 / 2": (S3, {"BATCH_WINDOW_MS": "2", "BATCH_WINDOW_HIGH_MS": "2"}, (8, 32, 128)),
    "50 / 50": (S3, {"BATCH_WINDOW_MS": "50", "BATCH_WINDOW_HIGH_MS": "50"}, (8, 32, 128)),
}
TIERS = ("low", "medium", "high")
MEDIANS = ("requests_per_s", "p50_ms", "p99_ms", "average_batch_size", "load_generator_cpu")  # a point's
REFINEMENTS = ("tiers", "grouping", "buckets", "isolation")  # the chapter's order
NAMES = dict(
    zip(REFINEMENTS, ("load tiers", "length grouping", "length buckets", "failure isolation"), strict=True)
)
PRICES = (4, 8, 16, 32, 64)  # CALL_OVERHEAD_TOKENS tried
BAD_ID = 10**9  # a token id no tokenizer makes: the stand-in model raises on it
LONE_WINDOW_MS = 5.0  # the window the "lone wait" column runs under
PAYS = 1.10  # a setting other than the default pays when it gains 10% or more (the house rule)
STEPS = ((1, 3.0), (64, 3.0), (1, 3.0))  # the classifier's load: (clients, seconds), in this order
RULE_WINDOWS = {"batch_window_ms": 2.0, "batch_window_high_ms": 5.0}  # a MEDIUM and a HIGH batch wait


# --- the engine alone ------------------------------------------------------------------------
def call_overhead(k: int = 16, length: int = 24, repeats: int = 7) -> dict[str, float]:
    """What one more model call costs: k rows as k calls of one row against one call of k rows.

    One length, so no padding: only the number of calls differs. CPU time (all threads of this
    process), not wall time: it is what a saturated server runs out of."""
    settings = Settings()
    engine = Engine.from_settings(settings, calls_at_once=settings.batch_concurrency)  # a slot's threads
    engine.warmup()
    ids = [np.arange(1000, 1000 + length) for _ in range(k)]

    def cpu(fn: Callable[[], object]) -> float:
        start = time.process_time()
        fn()
        return time.process_time() - start

    joint = min(cpu(lambda: engine.run(ids)) for _ in range(repeats))
    apart = min(cpu(lambda: [engine.run([row]) for row in ids]) for _ in range(repeats))
    fixed, per_token = (apart - joint) / (k - 1), joint / (k * length)
    return {"k": k, "length": length, "fixed_ms": fixed * 1e3, "per_token_ms": per_token * 1e3,
            "tokens": fixed / per_token, "alone_ms": apart / k * 1e3,
            "in_batch_ms": joint / k * 1e3}  # fmt: skip


# --- the servers -----------------------------------------------------------------------------
def batcher_metrics(url: str) -> dict[str, Any] | None:
    response = httpx.get(f"{url}/v1/batcher/metrics", timeout=5.0)
    return dict(response.json()) if response.status_code == 200 else None  # stage 2 has none


def servers(seconds: float, rounds: int, logs: Path) -> list[dict[str, Any]]:
    """Every server of ``SERVERS`` at once; each round visits every (server, connections) in turn."""
    bodies = bodies_for("sentence", 20_000, seed=CEILING_SEED)  # the ceiling's sentences come first
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with ExitStack() as stack:
        up = {
            name: stack.enter_context(running_stage(stage, logs, env))
            for name, (stage, env, _) in SERVERS.items()
        }
        for server in up.values():  # a first load, on other texts: every server warm
            locust(server.url, bodies[::-1], 8, 1)
        for r in range(rounds):
            for name, (_, _, loads) in SERVERS.items():
                for n in loads:
                    settle(up[name].pid, up[name].url)
                    before = batcher_metrics(up[name].url)
                    point = locust(up[name].url, bodies, n, seconds, pid=up[name].pid)
                    if (after := batcher_metrics(up[name].url)) and before:
                        batches = after["batches"] - before["batches"]
                        point["average_batch_size"] = (after["texts"] - before["texts"]) / max(1, batches)
                        point["tiers"] = {t: after["tiers"][t] - before["tiers"][t] for t in TIERS}
                    print(orjson.dumps({"round": r, "server": name, **point}).decode(), flush=True)
                    runs.setdefault((name, n), []).append(point)
    out = []
    for (name, n), ps in runs.items():
        middle = {k: statistics.median(p[k] for p in ps) for k in MEDIANS if ps[0].get(k) is not None}
        out.append({
            "server": name, "connections": n, **middle,  # each figure its median over the rounds
            "tiers": {t: sum(p["tiers"][t] for p in ps) for t in TIERS} if "tiers" in ps[0] else None,
            "errors": sum(p["socket_errors"] + round(p["non_2xx_per_s"] * p["window_s"]) for p in ps),
            "rounds_requests_per_s": [p["requests_per_s"] for p in ps],
        })  # fmt: skip
    return out


def plateau(n: int = 256, passes: int = 3) -> list[dict[str, Any]]:
    """CPU and wall ms a text of the engine alone (tokenize, model, normalize; one call at a time,
    a slot's threads) over ``n`` of the sweep's sentences in batches of 1 to 32: as they come, and
    sorted by length first (what length grouping does to a queue); the best of ``passes``, the
    orders in turns. The batch where the cost stops falling is the plateau."""
    settings = Settings()
    engine = Engine.from_settings(settings, calls_at_once=settings.batch_concurrency)
    texts = corpus.texts(n, seed=CEILING_SEED, kind="sentence")
    orders = {"as_they_come": texts, "sorted": sorted(texts, key=len)}
    for b in (1, settings.max_batch_size):  # every shape once before the clock runs
        engine.embed(texts[:b])
    sizes = (*SWEPT, settings.max_batch_size)
    best: dict[str, float] = {}
    for _, b, (name, order) in itertools.product(range(passes), sizes, orders.items()):
        cpu, wall = time.process_time(), time.perf_counter()
        for i in range(0, n, b):
            engine.embed(order[i : i + b])
        took = {"cpu_ms": time.process_time() - cpu, "wall_ms": time.perf_counter() - wall}
        for what, seconds in took.items():
            key = f"{b} {name}_{what}"
            best[key] = min(best.get(key, math.inf), seconds * 1e3 / n)
    return [
        {"batch": b, **{k.split()[1]: v for k, v in best.items() if k.split()[0] == str(b)}} for b in sizes
    ]


def sweep(result: dict[str, Any]) -> dict[str, Any]:
    """The sweep's rows out of the servers' points: stage 3 by MAX_BATCH_SIZE, stages 1 and 2 beside
    it, and a batch of one against stage 2 in every round (``batch_of_one``)."""
    points = {(p["server"], p["connections"]): p for p in result["servers"]}
    named = {**{f"batch {b}": b for b in SWEPT}, "0 / 0": Settings().max_batch_size}
    keep = {"req_s": "requests_per_s", "p50_ms": "p50_ms", "p99_ms": "p99_ms"}  # a row's name: the point's
    rows = [{"max_batch_size": b, "connections": n, **{k: points[name, n][v] for k, v in keep.items()},
             "mean_batch": points[name, n].get("average_batch_size"),
             "rounds": points[name, n]["rounds_requests_per_s"]}
            for name, b in sorted(named.items(), key=lambda x: x[1]) for n in SWEEP]  # fmt: skip
    baselines = [{"stage": name, "connections": n, **{k: points[name, n][v] for k, v in keep.items()},
                  "rounds": points[name, n]["rounds_requests_per_s"]}
                 for name in ("stage 1", "stage 2") for n in SWEEP]  # fmt: skip
    one = {}
    for n in SWEEP:
        mine, theirs = points["batch 1", n], points["stage 2", n]
        pairs = zip(mine["rounds_requests_per_s"], theirs["rounds_requests_per_s"], strict=True)
        rounds = [round(a / b, 3) for a, b in pairs]
        one[str(n)] = {"ratio": mine["requests_per_s"] / theirs["requests_per_s"], "rounds": rounds,
                       "verdict": rounds_word(rounds)}  # fmt: skip
    return {"batch_sweep": rows, "baselines": baselines, "batch_of_one": one}


def sweep_figure(result: dict[str, Any], folder: Path) -> Path:
    """batch_sweep.png: requests/s and p99 against MAX_BATCH_SIZE, stages 1 and 2 as lines across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for n, colour in zip(SWEEP, ("tab:blue", "tab:orange"), strict=True):
        rows = [r for r in result["batch_sweep"] if r["connections"] == n]
        sizes = [r["max_batch_size"] for r in rows]
        for ax, key in zip(axes, ("req_s", "p99_ms"), strict=True):
            ax.plot(sizes, [r[key] for r in rows], "o-", color=colour, label=f"stage 3, {n} connections")
            for base, style in (("stage 1", ":"), ("stage 2", "--")):
                b = next(x for x in result["baselines"] if (x["stage"], x["connections"]) == (base, n))
                ax.axhline(
                    b[key], color=colour, linestyle=style, linewidth=1, label=f"{base}, {n} connections"
                )
    for ax, label in zip(axes, ("requests a second", "p99 latency, ms"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["max_batch_size"] for r in result["batch_sweep"] if r["connections"] == SWEEP[0]])
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("MAX_BATCH_SIZE")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    axes[1].legend(fontsize=7)
    fig.suptitle("Stage 3 by its batch limit, beside stages 1 and 2 (one new sentence a request)")
    fig.tight_layout()
    return save_figure(fig, folder / "batch_sweep.png", result["stamp"])


# --- queue depth against request rate ---------------------------------------------------------
async def step_load(rule: str, engine: Engine, tokens: list[TokenizedText]) -> dict[str, Any]:
    """``STEPS`` of closed-loop clients through the refined batcher under ``rule``: each batch's
    tier, size and wait, and when each step began."""
    records: list[tuple[float, BatchRecord]] = []
    settings = Settings(batch_tier_rule=rule, **RULE_WINDOWS)  # type: ignore[arg-type]
    batcher = refined(engine.run, settings, on_batch=lambda r: records.append((r.started, r)))
    await batcher.start()
    texts, steps = itertools.cycle(tokens), []

    async def client(until: float) -> None:
        while time.perf_counter() < until:
            await batcher.submit([next(texts)])

    for clients, seconds in STEPS:
        steps.append(time.perf_counter())
        await asyncio.gather(*(client(steps[-1] + seconds) for _ in range(clients)))
    await batcher.close()
    return {"steps": steps, "records": records}


def rule_figures(run: dict[str, Any]) -> dict[str, Any]:
    """What a rule did at the step: how long until it saw 64 clients (a HIGH batch) and until it saw
    one again (a LOW batch); the batches of one client that waited a window for nothing; the
    batches of 64 clients that went at once (LOW) rather than wait to fill."""
    (_, up, down), records = run["steps"], run["records"]
    phase = {
        "one": [r for t, r in records if t < up or t >= down],
        "many": [r for t, r in records if up <= t < down],
    }
    first = {what: next((t - at for t, r in records if t >= at and r.tier == tier), None)
             for what, at, tier in (("up", up, "high"), ("down", down, "low"))}  # fmt: skip
    lone = [r for r in phase["one"] if r.tier != "low"]
    missed = [r for r in phase["many"] if r.tier == "low"]
    return {
        "react_up_ms": None if first["up"] is None else first["up"] * 1e3,
        "react_down_ms": None if first["down"] is None else first["down"] * 1e3,
        "lone_batches": len(phase["one"]),
        "lone_waited": len(lone),
        "lone_waited_ms": float(np.mean([np.mean(r.queue_ms) for r in lone])) if lone else 0.0,
        "busy_batches": len(phase["many"]),
        "busy_went_at_once": len(missed),
        "busy_mean_batch": float(np.mean([r.size for r in phase["many"]])) if phase["many"] else None,
    }


async def classifier(rounds: int) -> dict[str, Any]:
    """The depth rule and the rate rule in turns, ``rounds`` times each: the median of each figure."""
    settings = Settings()
    engine = Engine.from_settings(settings, calls_at_once=settings.batch_concurrency)
    engine.warmup()
    tokens = engine.tokenize(corpus.texts(2000, seed=CEILING_SEED, kind="sentence"))
    runs: dict[str, list[dict[str, Any]]] = {"depth": [], "rate": []}
    for _, rule in itertools.product(range(rounds), runs):
        runs[rule].append(rule_figures(await step_load(rule, engine, tokens)))
        print(orjson.dumps({"rule": rule, **runs[rule][-1]}).decode(), flush=True)
    rows = []
    for rule, got in runs.items():
        row: dict[str, Any] = {"rule": rule, "rounds": got}
        for key in got[0]:
            measured = [g[key] for g in got if g[key] is not None]
            row[key] = statistics.median(measured) if measured else None
        rows.append(row)
    s = Settings()
    return {"steps": [list(x) for x in STEPS], "windows_ms": RULE_WINDOWS, "rows": rows,
            "thresholds": {"depth": [s.batch_low_threshold, s.batch_high_threshold],
                           "rate": [s.batch_rate_low, s.batch_rate_high]}}  # fmt: skip


# --- the batcher alone -----------------------------------------------------------------------
def _stand_in(ids: list[np.ndarray]) -> np.ndarray:
    if any(row[-1] == BAD_ID for row in ids):
        raise ValueError("bad text")
    return np.zeros((len(ids), 384), np.float32)


def batcher_with(*refinements: str) -> Callable[[Model, Settings], Batcher]:
    """The textbook batcher with ``refinements`` (``refined`` with the others left out)."""
    return partial(refined, **{r: r in refinements for r in REFINEMENTS}) if refinements else Batcher


async def burst(kind: Callable[[Model, Settings], Batcher], model: Model, tokens: list[TokenizedText],
                settings: Settings) -> dict[str, Any]:  # fmt: skip
    """Every text of ``tokens`` submitted at once, one per request: what the batcher did."""
    batcher = kind(model, settings)
    await batcher.start()
    start, cpu = time.perf_counter(), time.process_time()  # CPU: every thread of this process
    outcomes = await asyncio.gather(*(batcher.submit([t]) for t in tokens), return_exceptions=True)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    await batcher.close()
    s = batcher.stats
    return {"model_calls": s.calls, "padding_ratio": s.padding_ratio, "texts_per_s": len(tokens) / seconds,
            "cpu_ms": cpu * 1e3 / len(tokens),
            "failed_callers": sum(isinstance(o, BaseException) for o in outcomes)}  # fmt: skip


async def lone_wait_ms(kind: Callable[[Model, Settings], Batcher], tokens: list[TokenizedText]) -> float:
    """Mean queue wait of 20 requests sent one after another, under a LONE_WINDOW_MS window."""
    batcher = kind(_stand_in, Settings(batch_window_ms=LONE_WINDOW_MS))
    await batcher.start()
    waits = [(await batcher.submit([t])).queue_ms for t in tokens[:20]]
    await batcher.close()
    return float(np.mean(waits))


async def refinements(rounds: int, n: int = 256) -> dict[str, Any]:
    """The chapter's steps counted with the stand-in, then every step and price timed with the real
    engine in turns (``rounds`` rounds, the median kept), so a busy spell hits them all alike."""
    settings = Settings()
    engine = Engine.from_settings(settings, calls_at_once=settings.batch_concurrency)  # as the slots run it
    engine.warmup()
    tokens = engine.tokenize(corpus.texts(n, seed=77, kind="mixed"))
    bad = list(tokens)
    bad[100] = replace(bad[100], ids=np.append(bad[100].ids, BAD_ID))
    steps = {f"{i}. + {NAMES[REFINEMENTS[i - 1]]}" if i else "0. textbook": batcher_with(*REFINEMENTS[:i])
             for i in range(len(REFINEMENTS) + 1)}  # fmt: skip
    timed = {**{name: (kind, settings) for name, kind in steps.items()},
             **{p: (refined, Settings(call_overhead_tokens=p)) for p in PRICES}}  # fmt: skip
    runs: dict[str | int, list[dict[str, Any]]] = {key: [] for key in timed}
    for _ in range(rounds):
        for key, (kind, s) in timed.items():
            runs[key].append(await burst(kind, engine.run, tokens, s))
    rows, prices = [], []
    for key, (kind, s) in timed.items():
        timing = {k: statistics.median(r[k] for r in runs[key]) for k in ("texts_per_s", "cpu_ms")}
        timing["rounds_cpu_ms"] = [r["cpu_ms"] for r in runs[key]]  # round i: the same turn for every key
        row = {**await burst(kind, _stand_in, tokens, s), **timing}
        if isinstance(key, int):
            prices.append({"price": key, **row})
            continue
        failed = await burst(kind, _stand_in, bad, s)
        rows.append({"batcher": key, **row, "lone_wait_ms": await lone_wait_ms(kind, tokens),
                     "bad_text": {k: failed[k] for k in ("failed_callers", "model_calls")}})  # fmt: skip
        print(orjson.dumps(rows[-1]).decode(), flush=True)
    return {"texts": n, "rounds": rounds, "rows": rows, "prices": prices}


# --- the page --------------------------------------------------------------------------------
def _point(result: dict[str, Any], server: str, n: int) -> dict[str, Any]:
    return next(p for p in result["servers"] if p["server"] == server and p["connections"] == n)


def _prices_said(prices: list[dict[str, Any]], tokens: float, default: int) -> str:
    """The price nearest the measured one and each other price against the default (the medians'
    ratio, as the lab notes' table), judged in every round: a price saves 10% only if it does in
    every round."""
    at = {p["price"]: p for p in prices}
    rounds = {k: [x / y for x, y in zip(p["rounds_cpu_ms"], at[default]["rounds_cpu_ms"], strict=True)]
              for k, p in at.items()}  # fmt: skip
    nearest = min(at, key=lambda k: abs(k - tokens))
    saves = [k for k, r in rounds.items() if max(r) <= 1 / PAYS]
    each = "; ".join(f"{k}: {p['cpu_ms'] / at[default]['cpu_ms']:.2f}x ({min(rounds[k]):.2f}–"
                     f"{max(rounds[k]):.2f}x)" for k, p in at.items() if k != default)  # fmt: skip
    return (f"In the burst, CPU a text against the default (CALL_OVERHEAD_TOKENS={default}), each"
            f" round's range beside it: {each}; {nearest} is the figure tried nearest the measured price. "
            + (f"Priced at {', '.join(map(str, saves))}, the buckets save 10% or more in every round."
               if saves else "No price tried saves 10% or more on the default in every round."))  # fmt: skip


def _twins(ref: dict[str, Any], default: int) -> str:
    """The last row and the prices' default row run the same batcher: the column's own noise."""
    last, twin = ref["rows"][-1], next(p for p in ref["prices"] if p["price"] == default)
    return (
        f"The last row and the row priced at {default} in the lab notes' price table run the same"
        f" batcher with the same settings: {last['texts_per_s']:.0f} and {twin['texts_per_s']:.0f} texts/s,"
        f" {last['cpu_ms']:.2f} and {twin['cpu_ms']:.2f} CPU ms a text in this run, the noise of those"
        " two columns."
    )


def _windows(result: dict[str, Any]) -> list[str]:
    rows = []
    for n in (8, 32, 128):
        points = [
            _point(result, name, n)
            for name, (stage, _, loads) in SERVERS.items()
            if stage == S3 and n in loads and not name.startswith("batch ")  # the sweep has its own table
        ]
        default = _point(result, "0 / 0", n)["requests_per_s"]
        for p in points:
            share = sum(p["tiers"].values()) or 1
            rows.append((n, p["server"], num(p["requests_per_s"], 0), f"{p['requests_per_s'] / default:.2f}",
                         num(p["p50_ms"], 1), num(p["p99_ms"], 1), num(p["average_batch_size"], 1),
                         " / ".join(f"{100 * p['tiers'][t] / share:.0f}" for t in TIERS)))  # fmt: skip
    head = ["connections", "window ms, MEDIUM / HIGH", "req/s", "of 0 / 0", "p50 ms", "p99 ms", "avg batch",
            "batches % LOW / MEDIUM / HIGH"]  # fmt: skip
    return table(head, rows, align="rlrrrrrr")


def _rounds(result: dict[str, Any], server: str, base: str, n: int) -> list[float]:
    """``server`` over ``base`` at ``n`` connections, in each round (the same turn of the same round)."""
    a, b = (_point(result, x, n)["rounds_requests_per_s"] for x in (server, base))
    return [x / y for x, y in zip(a, b, strict=True)]


def _said(result: dict[str, Any], server: str, base: str, n: int) -> str:
    """The medians' ratio (as the windows' table has it), and each round's range."""
    rounds = _rounds(result, server, base, n)
    ratio = _point(result, server, n)["requests_per_s"] / _point(result, base, n)["requests_per_s"]
    return f"{ratio:.2f}x (rounds {min(rounds):.2f}–{max(rounds):.2f}x)"


def _defaults(result: dict[str, Any]) -> str:
    """Whether this run supports the default windows (none), judged in every round. A window no batch
    of its run waited under ran the default's code: "the same code", not a ratio."""
    windowed = {"0 / 2": ("high",), "2 / 2": ("medium", "high"), "50 / 50": ("medium", "high")}
    ratios: dict[str, dict[int, list[float] | None]] = {}
    for w, tiers in windowed.items():
        waited = {n: any(_point(result, w, n)["tiers"][t] for t in tiers) for n in (8, 32, 128)}
        ratios[w] = {n: _rounds(result, w, "0 / 0", n) if waited[n] else None for n in waited}
    # a window pays when it gains 10% in every round at some load and loses 10% in no round at any
    better = [w for w, r in ratios.items() if any(g and min(g) >= PAYS for g in r.values())
              and not any(g and min(g) <= 1 / PAYS for g in r.values())]  # fmt: skip
    tried = "; ".join(
        f"{w}: "
        + ", ".join("the same code" if g is None else _said(result, w, "0 / 0", n) for n, g in r.items())
        for w, r in ratios.items()
    )
    windows = (
        f"Each window against none (the default), in requests/s at 8, 32 and 128 connections: {tried}. "
        + (
            f"{', '.join(better)} gains 10% or more in every round at one load and loses 10% in no round:"
            " the measurement does not support the default."
            if better
            else "No window gains 10% or more in every round at one load without losing 10% in a round"
            " at another: as one setting for every load, the measurement supports the default."
        )
    )
    return windows


def _sweep_row(name: str, r: dict[str, Any]) -> tuple[Any, ...]:
    rounds = ", ".join(num(x, 0) for x in r["rounds"])
    return (name, r["connections"], num(r["req_s"], 0), num(r["p50_ms"], 1), num(r["p99_ms"], 1),
            num(r.get("mean_batch"), 1), rounds)  # fmt: skip


def _plateau_said(flat: list[dict[str, Any]], server_gain: float, server_gains: list[float]) -> str:
    """Where the engine's cost a text stops falling, what padding adds, and the server's gain beside it
    (its best limit over a limit of one, in each round)."""
    alone = min(flat[0]["as_they_come_cpu_ms"], flat[0]["sorted_cpu_ms"])  # a batch of one: either order
    low, last = min(flat, key=lambda r: r["sorted_cpu_ms"]), flat[-1]
    gain, padded = alone / low["sorted_cpu_ms"], last["as_they_come_cpu_ms"] / last["sorted_cpu_ms"]
    if min(server_gains) >= PAYS * gain:
        rest = (
            "the rest of the server's gain is the work around each call (a thread hand-off, the event"
            " loop's turns), paid once a batch instead of once a request."
        )
    elif max(server_gains) <= gain / PAYS:
        rest = "the server keeps less than the model saves."
    else:
        rest = "within 10% of each other, or not in every round: within noise."
    return (
        f"The engine one call at a time on the sweep's sentences, as a model slot calls it (tokenize, model"
        f" and normalize, on one slot's threads), in this run, each batch its best of the passes: a text"
        f" alone costs {alone:.2f} ms of CPU; sorted by length, a text cost the least in batches of"
        f" {low['batch']} ({low['sorted_cpu_ms']:.2f} ms,"
        f" {1 / gain:.2f}x). In arrival order a batch of {last['batch']} pads every row to its longest"
        f" sentence: {last['as_they_come_cpu_ms']:.2f} ms a text, {padded:.2f}x the sorted batch. The"
        f" server at {SWEEP[0]} connections gained {server_gain:.2f}x from its best batch limit over a limit"
        f" of one (rounds {min(server_gains):.2f}–{max(server_gains):.2f}x), the engine {gain:.2f}x: {rest}"
    )


def sweep_sections(result: dict[str, Any]) -> dict[str, list[str]]:
    """The sweep's table, a batch of one against stage 2, and the plateau with its reason."""
    sweep, bases = result["batch_sweep"], result["baselines"]
    rows = [_sweep_row(f"stage 3, MAX_BATCH_SIZE={r['max_batch_size']}", r) for r in sweep]
    rows = sorted(rows + [_sweep_row(b["stage"], b) for b in bases], key=lambda r: r[1])
    said = "; ".join(
        f"at {n} connections {o['ratio']:.2f}x (rounds {min(o['rounds']):.2f}–{max(o['rounds']):.2f}x):"
        f" {o['verdict']}"
        for n, o in result["batch_of_one"].items()
    )
    best = {n: max((r for r in sweep if r["connections"] == n), key=lambda r: r["req_s"]) for n in SWEEP}
    at_n = {n: [r for r in sweep if r["connections"] == n] for n in SWEEP}
    winners = {n: [max(at_n[n], key=lambda r: r["rounds"][i])["max_batch_size"]
                   for i in range(len(best[n]["rounds"]))] for n in SWEEP}  # fmt: skip
    first = {n: next(b for b in bases if (b["stage"], b["connections"]) == ("stage 1", n)) for n in SWEEP}

    def against_stage1(n: int, b: dict[str, Any]) -> str:  # the median's ratio, each round's, their word
        rounds = [x / y for x, y in zip(b["rounds"], first[n]["rounds"], strict=True)]
        return (f"{b['req_s'] / first[n]['req_s']:.2f}x stage 1, rounds {min(rounds):.2f}–{max(rounds):.2f}x:"
                f" {rounds_word(rounds)}")  # fmt: skip

    def named(n: int, b: dict[str, Any]) -> str:  # a best limit only where it wins every round
        if unanimous(winners[n]) is not None:
            return f"at {n} connections MAX_BATCH_SIZE={b['max_batch_size']}, best in every round"
        each = ", ".join(str(w) for w in winners[n])
        return (f"at {n} connections no limit is best in every round (each round's: {each}; within noise);"
                f" the best median, MAX_BATCH_SIZE={b['max_batch_size']}")  # fmt: skip

    peaks = "; ".join(
        f"{named(n, b)}, {b['req_s']:.0f} req/s"
        f" ({against_stage1(n, b)}; p99 from {first[n]['p99_ms']:.0f} to {b['p99_ms']:.0f} ms), in batches of"
        f" {b['mean_batch']:.1f} on average"
        for n, b in best.items()
    )
    one = next(r for r in sweep if (r["max_batch_size"], r["connections"]) == (1, SWEEP[0]))
    gains = [x / y for x, y in zip(best[SWEEP[0]]["rounds"], one["rounds"], strict=True)]  # best over 1
    gain = best[SWEEP[0]]["req_s"] / one["req_s"]  # the medians' ratio, as the sweep's table has them
    flat = result["plateau"]
    plateau = [
        (
            r["batch"],
            *(
                num(r[f"{order}_{what}_ms"], 2)
                for what in ("cpu", "wall")
                for order in ("as_they_come", "sorted")
            ),
        )
        for r in flat
    ]
    return {
        "sweep": table(
            ["server", "connections", "req/s", "p50 ms", "p99 ms", "mean batch", "req/s each round"],
            rows,
            "lrrrrrl",
        ),
        "sweep_best": [f"The batch limit: {peaks}."],
        "batch_of_one": [f"Stage 3 with MAX_BATCH_SIZE=1 against stage 2, in requests a second: {said}."],
        "plateau": table(["batch", "CPU ms a text, as they come", "sorted by length",
                          "wall ms a text, as they come", "sorted by length"], plateau, "rrrrr"),
        "plateau_verdict": [_plateau_said(flat, gain, gains)],
    }  # fmt: skip


def classifier_sections(c: dict[str, Any]) -> dict[str, list[str]]:
    """The two rules side by side, and which one this run favours, figure by figure."""
    rows = {r["rule"]: r for r in c["rows"]}
    low, high = c["thresholds"]["depth"]
    named = {
        "depth": f"depth: LOW under {low} texts queued, HIGH from {high}",
        "rate": "rate: LOW under {:g} texts served a second, HIGH from {:g}".format(*c["thresholds"]["rate"]),
    }
    table_rows = [(named[rule], num(r["react_up_ms"], 0), num(r["react_down_ms"], 0),
                   f"{r['lone_waited']:.0f} of {r['lone_batches']:.0f}", num(r["lone_waited_ms"], 2),
                   f"{r['busy_went_at_once']:.0f} of {r['busy_batches']:.0f}", num(r["busy_mean_batch"], 1))
                  for rule, r in rows.items()]  # fmt: skip
    figures = {"react_up_ms": "sees 64 clients sooner", "react_down_ms": "sees one client again sooner",
               "lone_waited": "holds fewer lone requests for nothing", "busy_went_at_once":
               "sends fewer batches off at once under load"}  # fmt: skip

    def winner(d: float | None, r: float | None) -> str:
        d, r = (math.inf if d is None else d), (math.inf if r is None else r)  # never: the worst
        return "depth" if d < r else "rate" if r < d else "neither"

    runs = list(zip(rows["depth"]["rounds"], rows["rate"]["rounds"], strict=True))
    wins = {key: unanimous(winner(d[key], r[key]) for d, r in runs) or "noise" for key in figures}
    every = "noise" not in wins.values()
    by_rule = {
        w: [figures[k] for k, x in wins.items() if x == w] for w in ("depth", "rate", "neither", "noise")
    }
    lead = {"depth": "the depth rule ", "rate": "the rate rule ", "neither": "neither rule ",
            "noise": "within noise (the runs disagree on which rule) for: "}  # fmt: skip
    said = "; ".join(lead[w] + (", ".join(f[:-1]) + " and " + f[-1] if len(f) > 1 else f[0])
                     for w, f in by_rule.items() if f)  # fmt: skip
    depth_wins = sum(w == "depth" for w in wins.values())
    (one, a), (many, b), _ = c["steps"]
    windows = c["windows_ms"]
    return {
        "classifier": table(["rule", "sees the step up, ms", "sees the step down, ms",
                             "lone batches that waited", "their wait, ms", "batches of 64 sent at once",
                             "mean batch, 64 clients"], table_rows, "lrrrrrr"),
        "classifier_verdict": [
            f"{one} client for {a:g} s, {many} for {b:g} s, then {one} again, windows of"
            f" {windows['batch_window_ms']:g} ms (MEDIUM) and {windows['batch_window_high_ms']:g} ms"
            f" (HIGH), {len(rows['depth']['rounds'])} runs each, a figure to a rule only where every run"
            f" agrees: {said}. The depth rule is ahead on {depth_wins} of {len(wins)}"
            + (", in every run." if every else ".")],
    }  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    call, ref = result["call_overhead"], result["refinements"]
    default = Settings().call_overhead_tokens
    at_default = next(p["cpu_ms"] for p in ref["prices"] if p["price"] == default)
    windows = _defaults(result)
    sections = {
        "windows": _windows(result),
        "refinements": [*table(
            ["batcher", "model calls", "padding", "CPU ms a text", "texts/s", "failed by 1 bad text",
             "calls with it", "lone wait ms"],
            [(r["batcher"], r["model_calls"], f"{r['padding_ratio']:.0%}", num(r["cpu_ms"], 2),
              num(r["texts_per_s"], 0), r["bad_text"]["failed_callers"], r["bad_text"]["model_calls"],
              num(r["lone_wait_ms"], 2)) for r in ref["rows"]]), "", _twins(ref, default)],
        "prices": table(["CALL_OVERHEAD_TOKENS", "model calls", "padding", "CPU ms a text", "of the default",
                         "texts/s"],
                        [(p["price"], p["model_calls"], f"{p['padding_ratio']:.0%}", num(p["cpu_ms"], 2),
                          f"{p['cpu_ms'] / at_default:.2f}", num(p["texts_per_s"], 0))
                         for p in ref["prices"]]),
        "price": [f"One more model call costs {call['fixed_ms']:.2f} ms of CPU in stage 3's run, as much as"
                  f" **{call['tokens']:.0f} padded tokens** ({call['k']} rows of {call['length']} tokens as"
                  f" {call['k']} calls against one). {_prices_said(ref['prices'], call['tokens'], default)}"],
        "windows_verdict": [windows],
        **sweep_sections(result),
        **classifier_sections(result["classifier"]),
    }  # fmt: skip
    note = (
        f"{result['seconds']:g} s per server point, {result['rounds']} round(s) in turns, the median"
        f" shown. The batcher alone: {ref['texts']} mixed texts, {ref['rounds']} round(s) in turns; its lone"
        f" wait: 20 requests one after another under a {LONE_WINDOW_MS:g} ms window."
    )
    return page(result["stamp"], sections, note)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per server point")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the servers and of the prices")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.stage3", args, argv)
    seconds, rounds = (1.0, 1) if args.quick else (args.seconds, args.rounds)
    result: dict[str, Any] = {"stamp": {}, "seconds": seconds, "rounds": rounds}
    result["call_overhead"] = call_overhead()
    result["plateau"] = plateau(64, 1) if args.quick else plateau()
    result["classifier"] = asyncio.run(classifier(1 if args.quick else 3))
    result["refinements"] = asyncio.run(refinements(rounds + 1))  # a burst is short: a round more
    result["servers"] = servers(seconds, rounds, run.logs("stage3"))
    result |= sweep(result)
    result["stamp"] = run.stamp()
    evidence.publish(run, "stage3", result, markdown)
    print(f"wrote {sweep_figure(result, run.img_dir)}")


if __name__ == "__main__":
    main()
