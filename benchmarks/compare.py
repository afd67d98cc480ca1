"""`make compare`: what each stage changes against the one before, in one run on one machine.

    python -m benchmarks.compare                     # about 5 minutes; run it on a quiet machine
    python -m benchmarks.compare --quick             # about a minute: does it all work?
    python -m benchmarks.compare --against 31e7b5d   # that commit's stages and this checkout's, in turns

Every server stage starts as ``make stageN`` starts it, all at once, and they take turns under the
same load from Locust (the Locust file's ``BodiesUser``; stage 1 2 3 4 5, then again; medians over
the rounds), so a drift of the shared machine hits every stage alike; each settles (idle again)
before its point. Every point records Locust's own CPU (``load_generator_cpu``). On the loads of
``--wrk-profiles`` wrk loads each server too, right after Locust, with texts of its own (what one
sent, a stage 4 cache would answer for the other): how far the two tools agree.
Every stage runs with MAX_QUEUE=256 and without CACHE_URL (a shared Redis would keep answers from
one run to the next).
``--against COMMIT``: that commit's stages (a git worktree under out/, this venv and model) and
this checkout's, all at once, in turns (A B, then B A); a point that loses more than 5 % in every
round is flagged and the command exits 1 (a median one round drags down is noise).
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson

from common import corpus
from common.engine import Engine
from common.serve import STAGES, resolve
from common.settings import Settings
from loadtests import evidence, load
from loadtests.procs import StageProcess, running_stage
from loadtests.tables import num, page, stage_label, table

CEILING_SEED = 7
CEILING_BATCHES = (1, 2, 4, 8, 16, 32, 64)
ENV, WITHOUT = {"MAX_QUEUE": "256"}, ("CACHE_URL",)
TOOL = "locust"  # the load generator of every table; wrk only beside it (--wrk-profiles)
FASTER, SLOWER = 1.05, 0.95  # between them a ratio is "about the same"; under SLOWER, a loss
RATE = 4000  # bodies a second of a point: more than any stage answers here, so no text comes twice
T = TypeVar("T")
Server = tuple[str, str, StageProcess]  # stage, side ("before", "after" or ""), the process


# --8<-- [start:profiles]
@dataclass(frozen=True)
class Profile:
    """``connections`` clients, each sending its next request the moment its answer comes."""

    name: str
    connections: int
    kind: str = "sentence"  # common.corpus texts: sentence, or mixed (queries, sentences, passages)
    texts: int = 1  # texts a request
    new: float = 1.0  # the share of requests with texts never sent before; the rest repeat one


PROFILES = (
    Profile("unique-1", 1),  # one client: a request's cost end to end, nothing to overlap
    Profile("unique-32", 32),
    Profile("unique-128", 128),
    Profile("repeated-32", 32, new=1 / 3),  # a third new, the rest repeats: what a cache sees
    Profile("mixed-32", 32, kind="mixed"),  # short queries and long passages together: padding
    Profile("overload-128", 128, texts=8),  # 1024 texts in flight: stages 4-5 refuse with 503
)
# --8<-- [end:profiles]


# --8<-- [start:ceiling]
def engine_ceiling(kinds: Sequence[str], seconds: float, layouts: Sequence[int] = (1, 2)) -> dict[str, Any]:
    """Texts per second of the engine alone (tokenize + model + normalize), at its best.

    Best over batch sizes and over layouts: one call at a time with the cores' threads, or
    ``n`` calls side by side from ``n`` threads with the cores shared out among them (what
    stage 2's WORKER_THREADS and the batcher's BATCH_CONCURRENCY do). On 2 cores two
    one-thread calls beat one two-thread call, so a ceiling that tried only one call at a
    time would be one the servers can pass.
    """
    out: dict[str, Any] = {}
    for kind in kinds:
        texts = corpus.texts(2048, seed=CEILING_SEED, kind=kind)
        rates: dict[tuple[int, int], float] = {}
        for calls in layouts:
            engine = Engine.from_settings(Settings(), calls_at_once=calls)  # the servers' threads
            engine.warmup()
            rates |= {(calls, b): _texts_per_s(engine, texts, b, calls, seconds) for b in CEILING_BATCHES}
        calls, batch = max(rates, key=lambda k: rates[k])
        out[kind] = {"texts_per_s": rates[calls, batch], "best_batch": batch, "best_calls_at_once": calls,
                     "by_batch": {str(b): rates[calls, b] for b in CEILING_BATCHES}}  # fmt: skip
    return out


def _texts_per_s(engine: Engine, texts: list[str], batch: int, calls: int, seconds: float) -> float:
    """``calls`` threads embedding batches of ``batch`` texts for ``seconds``; texts per second."""

    def work(worker: int) -> int:
        done, i = 0, worker * batch
        while time.perf_counter() < end or done == 0:
            at = i % (len(texts) - batch)
            engine.embed(texts[at : at + batch])
            done, i = done + batch, i + calls * batch
        return done

    end = (start := time.perf_counter()) + seconds
    with ThreadPoolExecutor(calls) as pool:
        done = sum(pool.map(work, range(calls)))
    return done / (time.perf_counter() - start)


# --8<-- [end:ceiling]


def bodies(profile: Profile, seed: int, count: int) -> list[bytes]:
    """``count`` request bodies, new texts for each seed; a repeat is a request from before it."""
    texts = corpus.texts(count * profile.texts, seed=seed, kind=profile.kind)
    requests = [texts[i : i + profile.texts] for i in range(0, len(texts), profile.texts)]
    rng = random.Random(seed)
    for i in range(1, count):
        if rng.random() >= profile.new:
            requests[i] = requests[rng.randrange(i)]
    return [orjson.dumps({"inputs": r}) for r in requests]


def measure(
    server: StageProcess, profile: Profile, requests: list[bytes], seconds: float, tool: str = TOOL
) -> dict[str, Any]:
    """One point; then the server settles, so that the next point, on any server, finds an idle machine."""
    point = load.LOAD_GENERATORS[tool](server.url, requests, profile.connections, seconds, pid=server.pid)
    answered, cpu = point["requests_per_s"] * point["window_s"], point.pop("server_cpu_s")
    load.settle(server.pid, server.url)
    silent = {"p50_ms": None, "p99_ms": None} if not answered + point["non_2xx_per_s"] else {}  # not 0 ms
    cpu_ms = round(1e3 * cpu / answered, 3) if answered and cpu is not None else None
    return {"load_generator": tool, **point, **silent, "cpu_ms": cpu_ms}


def start(stack: ExitStack, stages: Sequence[str], tree: Path, side: str = "") -> list[Server]:
    """Each stage of the checkout ``tree`` started as ``make stageN`` starts it (each warms its model
    up before it says it is ready; the first round finds every stage as cold as the others)."""
    logs = evidence.OUT / "logs" / "compare" / side
    run = [running_stage(s, logs, ENV, without=WITHOUT, tree=tree) for s in stages]
    return [(s, side, stack.enter_context(r)) for s, r in zip(stages, run, strict=True)]


def in_turns(
    servers: list[Server], profiles: list[Profile], rounds: int, seconds: float, wrk_too: Sequence[str] = ()
) -> list[Any]:
    """Every profile on every server in turns, ``rounds`` times: the same texts for every server in a
    round, new ones in the next. Two sides of a stage swap their order each round (A B, then B A).
    The profiles named in ``wrk_too`` are loaded by wrk as well, right after Locust, with texts of its own."""
    points = []
    for round_, profile in itertools.product(range(rounds), profiles):
        seed = 100 * (round_ + 1) + PROFILES.index(profile)
        tools = [TOOL, "wrk"] if profile.name in wrk_too else [TOOL]
        # each tool its own texts (the same for every server): what one sent, a cache would hand the other
        requests = {
            tool: bodies(profile, seed + 50 * i, RATE * math.ceil(seconds)) for i, tool in enumerate(tools)
        }
        for stage, group in itertools.groupby(servers, key=lambda s: s[0]):
            turn = list(group)
            for tool, (_, side, server) in itertools.product(tools, turn if round_ % 2 == 0 else turn[::-1]):
                p = measure(server, profile, requests[tool], seconds, tool)
                points.append({"stage": stage, "side": side, "round": round_, "profile": profile.name, **p})
                print(f"round {round_ + 1}/{rounds}, {profile.name}, {stage} {side}: {p}", flush=True)
    return points


def medians(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    keys = ("requests_per_s", "non_2xx_per_s", "p50_ms", "p99_ms", "cpu_ms", "load_generator_cpu")
    got = {k: [p[k] for p in points if p.get(k) is not None] for k in keys}
    return {k: statistics.median(v) if v else None for k, v in got.items()}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def word(r: float | None) -> str:
    """The word a ratio earns, judged as it is printed (two decimals)."""
    if r is None:
        return "not measured"
    return "faster" if round(r, 2) > FASTER else "slower" if round(r, 2) < SLOWER else "about the same"


def unanimous(said: Iterable[T]) -> T | None:
    """What every round says, when they all say the same; None when they disagree (within noise)."""
    once = set(said)
    return once.pop() if len(once) == 1 else None


def rounds_word(rounds: Sequence[float | None]) -> str:
    """The word every round earns: a direction (faster, slower) or "about the same" only when every
    round says it; rounds that disagree are "within noise"."""
    return unanimous(word(r) for r in rounds) or "within noise"


def verdict(first: str, rows: Sequence[tuple[str, float | None, Sequence[float | None]]]) -> str:
    """``first``, then each word with the loads that earn it, each with its median ratio (and, within
    noise, the rounds' range): one sentence. The word is every round's (``rounds_word``)."""
    by_word: dict[str, list[str]] = {}
    for name, r, rounds in rows:
        w = rounds_word(rounds) if rounds else word(r)
        measured = [x for x in rounds if x is not None]
        spread = f", rounds {min(measured):.2f}–{max(measured):.2f}×" if w == "within noise" else ""
        by_word.setdefault(w, []).append(f"{name} ({num(r, 2, '×')}{spread})")
    listed = {w: ", ".join(x[:-1]) + " and " + x[-1] if len(x) > 1 else x[0] for w, x in by_word.items()}
    return f"{first}: " + "; ".join(f"{w} on {x}" for w, x in listed.items()) + "."


# --- compare.json and compare.md -------------------------------------------------------
def summarize(
    points: list[dict[str, Any]], stages: Sequence[str], profiles: Sequence[str], tool: str = TOOL
) -> dict[str, Any]:
    """Medians over the rounds per load and stage, and each stage over the one before it: the
    median's ratio, each round's (``rounds``) and the word every round earns (``verdict``)."""
    out: dict[str, Any] = {}
    points = [p for p in points if p.get("load_generator") == tool]
    for profile in profiles:
        row = {s: medians([p for p in points if (p["stage"], p["profile"]) == (s, profile)]) for s in stages}
        rps = {(p["stage"], p["round"]): p["requests_per_s"] for p in points if p["profile"] == profile}
        for before, stage in itertools.pairwise(stages):
            row[stage]["over_previous"] = ratio(row[stage]["requests_per_s"], row[before]["requests_per_s"])
            rounds = sorted({r for s, r in rps if s == stage})
            row[stage]["rounds"] = [ratio(rps.get((stage, r)), rps.get((before, r))) for r in rounds]
            row[stage]["verdict"] = rounds_word(row[stage]["rounds"])
        out[profile] = row
    return out


# The ratios stage 3 is held to, from this run (what, its key, "at least" or "at most", the target):
TARGETS = (
    ("requests/s at 32 connections, against the engine alone", "engine", "at least", 0.80),
    ("requests/s at 32 connections, against stage 2", "rps", "at least", 1.25),
    ("p99 latency at 32 connections, against stage 2", "p99", "at most", 1.00),
    ("p50 latency at 1 connection, against stage 2", "p50", "at most", 1.20),
)


def stage3_targets(
    points: list[dict[str, Any]], summary: dict[str, Any], ceiling: float
) -> list[dict[str, Any]]:
    """Each target: the medians' ratio, every round's, and met (or missed) only if every round is."""
    s2, s3 = "stage2_threadpool", "stage3_batching"
    at = {(p["stage"], p["profile"], p["round"]): p for p in points if p.get("load_generator") == TOOL}

    def ratios(get: Callable[[str, str], dict[str, Any]]) -> dict[str, float | None]:
        one, many = "unique-1", "unique-32"
        return {"engine": ratio(get(s3, many)["requests_per_s"], ceiling),
                "rps": ratio(get(s3, many)["requests_per_s"], get(s2, many)["requests_per_s"]),
                "p99": ratio(get(s3, many)["p99_ms"], get(s2, many)["p99_ms"]),
                "p50": ratio(get(s3, one)["p50_ms"], get(s2, one)["p50_ms"])}  # fmt: skip

    medians = ratios(lambda stage, profile: summary[profile][stage])
    each = [ratios(lambda stage, profile, r=r: at[stage, profile, r]) for r in sorted({k[2] for k in at})]
    out = []
    for what, key, bound, target in TARGETS:
        rounds = [e[key] for e in each]
        met = unanimous(
            (r >= target if bound == "at least" else r <= target) for r in rounds if r is not None
        )
        said = {True: "met", False: "missed", None: "within noise"}[met]
        out.append({"what": what, "key": key, "bound": bound, "target": target, "measured": medians[key],
                    "rounds": rounds, "verdict": said})  # fmt: skip
    return out


def targets_sections(result: dict[str, Any]) -> dict[str, list[str]]:
    """Stage 3's targets, each with its rounds, and what the run measured beside each one not met."""
    if not result.get("targets"):
        return {"targets": ["Not measured: this run left out stage 2, stage 3, unique-1 or unique-32."],
                "why_missed": [""]}  # fmt: skip
    got = {t["key"]: t for t in result["targets"]}
    said = {"met": "met in every round.", "missed": "**missed** in every round.",
            "within noise": "met in some rounds, not all: within noise."}  # fmt: skip
    lines = []
    for t in result["targets"]:
        each = [r for r in t["rounds"] if r is not None]
        lines.append(
            f"- {t['what']}: **{t['measured']:.2f}x** (rounds {min(each):.2f}–{max(each):.2f}x),"
            f" where the target is {t['bound']} {t['target']:.2f}x: {said[t['verdict']]}"
        )
    s = result["summary"]
    s2, s3, s3_1, s2_1 = (s["unique-32"]["stage2_threadpool"], s["unique-32"]["stage3_batching"],
                          s["unique-1"]["stage3_batching"], s["unique-1"]["stage2_threadpool"])  # fmt: skip
    cores, ceiling = result["stamp"]["machine"]["logical_cores"], result["ceiling"]["sentence"]["texts_per_s"]
    engine_ms = 1e3 * cores / ceiling
    bound = 1e3 * cores / s3["cpu_ms"]  # requests a second the cores give at stage 3's CPU a request
    reasons = {
        "engine": f"Against the engine alone: stage 3 spent {num(s3['cpu_ms'], 2)} ms of CPU a request at 32"
        f" connections, the engine at its ceiling {engine_ms:.2f} ms of core time a text (the cores over its"
        f" texts a second). At its own cost the cores would serve {bound:.0f} requests a second,"
        f" {bound / ceiling:.2f}x the engine"
        + (
            ": the gap is the HTTP, the JSON and the event loop's share of each request, which no batch"
            " shares ([cost model](cost_model.md))."
            if bound < ceiling
            else ": its own work costs no more than the engine's."
        )
        + f" It served {s3['requests_per_s']:.0f}, {s3['requests_per_s'] / bound:.2f}x of that: the rest is"
        f" the cores it did not get, Locust's {s3['load_generator_cpu']:.2f} and the time they sat idle"
        " between batches.",
        "rps": f"Against stage 2 in requests a second: at 32 connections stage 3 spent {num(s3['cpu_ms'], 2)}"
        f" ms of CPU a request, stage 2 {num(s2['cpu_ms'], 2)}; with the cores busy, requests a second"
        " follow what a request costs. A batch shares the model call; a request's own work (HTTP, JSON,"
        " its tokenizer run) stays.",
        "p99": "The p99 against stage 2: a request waits for its whole batch, every row as long as the"
        " longest.",
        "p50": f"At one connection a request passes through the queue and the batcher's task, a hop stage 2"
        f" does not make: p50 {num(s3_1['p50_ms'], 1)} against {num(s2_1['p50_ms'], 1)} ms.",
    }
    met = sum(t["verdict"] == "met" for t in result["targets"])
    rest = [reasons[k] for k, t in got.items() if t["verdict"] != "met"]
    return {
        "targets": [
            f"Stage 3's targets, met in every round for {met} of {len(got)} in this run:",
            "",
            *lines,
            "",
            "Locust keeps a response time to the millisecond under 100 ms and to 10 ms up to a second, so a"
            " latency ratio moves in those steps (4 against 5 ms is 1.25x).",
        ],
        "why_missed": [" ".join(rest) if rest else "Every target is met in every round of this run."],
    }


def _tool(result: dict[str, Any]) -> str:
    """The load generator a results file was measured with (files from before Locust: wrk)."""
    return {"locust": "Locust", "wrk": "`wrk`"}[result["stamp"].get("load_generator", "wrk")]


def _pair(a: dict[str, Any], b: dict[str, Any], key: str, digits: int = 1) -> str:
    return f"{num(a[key], digits)} / {num(b[key], digits)}"


def markdown(result: dict[str, Any]) -> str:
    stages, summary, ceiling = result["stages"], result["summary"], result["ceiling"]
    n = {s: stage_label(s).removeprefix("stage ") for s in stages}
    best = ceiling.get("sentence") or next(iter(ceiling.values()))
    note = (f"Closed loop ({_tool(result)}), every stage running at once, measured in turns,"
            f" {result['duration_s']:g} s a point, medians over {result['rounds']} round(s). The engine"
            f" alone, no HTTP: {best['texts_per_s']:.0f} texts/s at its best (batch {best['best_batch']},"
            f" calls side by side: {best['best_calls_at_once']}).")  # fmt: skip
    sections = {"ceiling": table(["texts", "engine alone, texts/s", "best batch", "calls side by side"],
                                 [(k, num(c["texts_per_s"]), c["best_batch"], c["best_calls_at_once"])
                                  for k, c in ceiling.items()])}  # fmt: skip
    one = {p: row["stage1_naive"] for p, row in summary.items() if "stage1_naive" in row and "unique" in p}
    if one:  # what blocking costs: stage 1 alone, one connection and more
        sections["stage1"] = table(
            ["load", "req/s", "p50 ms, every answer", "p99 ms", "CPU ms a 2xx"],
            [(p, num(m["requests_per_s"]), num(m["p50_ms"]), num(m["p99_ms"]), num(m["cpu_ms"], 2))
             for p, m in one.items()])  # fmt: skip
    if "unique-1" in one and "unique-32" in one:
        a, b = one["unique-1"], one["unique-32"]
        rps = {(p["profile"], p["round"]): p["requests_per_s"] for p in result["points"]
               if p["stage"] == "stage1_naive" and p.get("load_generator", TOOL) == TOOL}  # fmt: skip
        rounds = [
            ratio(rps.get(("unique-32", r)), rps.get(("unique-1", r))) for r in sorted({r for _, r in rps})
        ]
        said = verdict(
            "Stage 1 at 32 connections against 1, in requests a second",
            [("unique-32 over unique-1", ratio(b["requests_per_s"], a["requests_per_s"]), rounds)],
        )
        sections["stage1"] += ["", f"{said[:-1]}, while a request's median time goes from"
                               f" {num(a['p50_ms'])} ms to {num(b['p50_ms'])} ms."]  # fmt: skip
    for before, stage in itertools.pairwise(stages):
        a, b, rows = n[before], n[stage], [(p, row[before], row[stage]) for p, row in summary.items()]
        sections[f"stage{b}"] = [*table(
            ["load", f"stage {a} req/s", f"stage {b} req/s", f"{b} / {a}",
             f"p50 ms (every answer), {a} / {b}", f"p99 ms, {a} / {b}", f"CPU ms a 2xx, {a} / {b}",
             f"not 2xx a second, {a} / {b}"],
            [(p, num(x["requests_per_s"]), num(y["requests_per_s"]), num(y["over_previous"], 2, "×"),
              _pair(x, y, "p50_ms"), _pair(x, y, "p99_ms"), _pair(x, y, "cpu_ms", 2),
              _pair(x, y, "non_2xx_per_s", 0)) for p, x, y in rows], "l" + "r" * 7),
            "", verdict(f"Stage {b} against stage {a}, in requests a second",
                        [(p, y["over_previous"], y.get("rounds", [])) for p, _, y in rows])]  # fmt: skip
    sections |= targets_sections(result)
    sections["agreement"] = agreement(result.get("wrk", {}), summary, stages)
    alone = {p["name"]: ceiling[p["kind"]]["texts_per_s"] / p["texts"] for p in result["profiles"]}
    sections["all"] = table(["load", *(f"stage {n[s]} req/s" for s in stages), "engine alone, req/s"],
                            [(p, *(num(row[s]["requests_per_s"]) for s in stages), num(alone[p]))
                             for p, row in summary.items()])  # fmt: skip
    sections["load-generator"] = table(["load", *(f"stage {n[s]}" for s in stages)],
                                       [(p, *(num(row[s]["load_generator_cpu"], 2) for s in stages))
                                        for p, row in summary.items()])  # fmt: skip
    return page(result["stamp"], sections, note) + "\n"


def agreement(wrk: dict[str, Any], locust: dict[str, Any], stages: Sequence[str]) -> list[str]:
    """Each stage over the one before as Locust and as wrk measured it, on the loads both ran."""
    rows, gaps, same = [], [], 0
    for profile, row in wrk.items():
        for before, stage in itertools.pairwise(stages):
            mine, theirs = locust[profile][stage], row[stage]
            name = f"{stage_label(stage)} / {stage_label(before).removeprefix('stage ')}"
            rows.append((profile, name, num(mine["over_previous"], 2, "×"), mine["verdict"],
                         num(theirs["over_previous"], 2, "×"), theirs["verdict"],
                         _pair(mine, theirs, "load_generator_cpu", 2)))  # fmt: skip
            if mine["over_previous"] is not None and theirs["over_previous"] is not None:
                gaps.append(abs(mine["over_previous"] - theirs["over_previous"]))
            same += mine["verdict"] == theirs["verdict"]
    if not rows:
        return ["Not measured: no load ran under wrk as well (--wrk-profiles)."]
    headers = ["load", "comparison", "Locust: ratio", "Locust: every round", "wrk: ratio", "wrk: every round",
               "load generator's cores, Locust / wrk"]  # fmt: skip
    said = (f"Locust's and wrk's median ratios differ by {max(gaps):.2f} at most (median"
            f" {statistics.median(gaps):.2f}); their verdicts agree on {same} of {len(rows)}"
            " comparisons.")  # fmt: skip
    return [*table(headers, rows, "llrlrlr"), "", said]


# --- --against: two commits in turns (before_after.json) -------------------------------
@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """``rev`` checked out beside this repository (under out/), with this checkout's model."""
    sha = evidence.git("rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    path = evidence.OUT / "against" / sha[:12]
    if path.exists():
        evidence.git("worktree", "remove", "--force", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    evidence.git("worktree", "add", "--detach", str(path), sha)
    try:
        (path / "models").symlink_to(evidence.REPO / "models", target_is_directory=True)
        yield path
    finally:
        evidence.git("worktree", "remove", "--force", str(path))


def against_rows(points: list[dict[str, Any]], stages: Sequence[str], profiles: Sequence[str]) -> list[Any]:
    """Per stage and load: each side's medians, after / before, each round's ratio, and a loss."""
    rows = []
    for stage, profile in itertools.product(stages, profiles):
        mine = [
            p for p in points if (p["stage"], p["profile"], p.get("load_generator")) == (stage, profile, TOOL)
        ]
        side = {s: medians([p for p in mine if p["side"] == s]) for s in ("before", "after")}
        rps = {(p["side"], p["round"]): p["requests_per_s"] for p in mine}
        rounds = [ratio(rps["after", r], rps["before", r]) for r in sorted({p["round"] for p in mine})]
        rows.append({"stage": stage, "profile": profile, **side, "round_ratios": rounds,
                     "ratio": ratio(side["after"]["requests_per_s"], side["before"]["requests_per_s"]),
                     "loses": all(r is not None and r < SLOWER for r in rounds)})  # fmt: skip
    return rows


def against_markdown(result: dict[str, Any]) -> str:
    rows = [(stage_label(r["stage"]), r["profile"], num(r["before"]["requests_per_s"]),
             num(r["after"]["requests_per_s"]), num(r["ratio"], 2, "×"), ", ".join(num(x, 2) for x in
             r["round_ratios"]), _pair(r["before"], r["after"], "p99_ms"), "**yes**" if r["loses"] else "")
            for r in result["summary"]]  # fmt: skip
    headers = ["stage", "load", "before req/s", "after req/s", "after / before", "each round",
               "p99 ms, before / after", "loses > 5 % in every round"]  # fmt: skip
    losses = [f"{stage_label(r['stage'])} {r['profile']}" for r in result["summary"] if r["loses"]]
    p = result["parameters"]
    note = (f"Before: commit `{p['before'][:7]}`; after: commit `{str(result['stamp'].get('commit'))[:7]}`;"
            f" both running at once, closed loop ({_tool(result)}), {p['duration_s']:g} s a point,"
            f" {p['rounds']} rounds taken in turns (A B, then B A), medians.")  # fmt: skip
    said = (f"{len(losses)} of {len(rows)} points lose more than 5 % in every round (after / before under"
            f" {SLOWER})" + (": " + "; ".join(losses) if losses else "."))  # fmt: skip
    return page(result["stamp"], {"ratios": table(headers, rows, "llrrrlrl"), "verdict": [said]}, note) + "\n"


def against(args: argparse.Namespace, run: evidence.Run) -> dict[str, Any]:
    """``args.against``'s stages and this checkout's, in turns: ``args.name``.json and .md."""
    with worktree(args.against) as tree, ExitStack() as stack:
        stages = [s for s in args.stages if (tree / s / "app.py").is_file()]
        servers = start(stack, stages, tree, "before") + start(stack, stages, evidence.REPO, "after")
        servers.sort(key=lambda s: (stages.index(s[0]), s[1] == "after"))
        points = in_turns(servers, args.profiles, args.rounds, args.duration)
        before = evidence.git("rev-parse", "HEAD", repo=tree).strip()
    names = [p.name for p in args.profiles]
    result = {"stamp": {**run.stamp(ENV, WITHOUT), "load_generator": TOOL}, "points": points,
              "parameters": {"before": before, "duration_s": args.duration, "rounds": args.rounds,
                             "stages": stages, "profiles": names},
              "summary": against_rows(points, stages, names)}  # fmt: skip
    evidence.publish(run, args.name, result, against_markdown, args.out)
    return result


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", metavar="COMMIT", help="that commit's stages and these, in turns")
    parser.add_argument(
        "--name", default="before_after", help="--against's results file (default: %(default)s)"
    )
    parser.add_argument("--stages", help="comma-separated, 1 to 5 (default: all)")
    parser.add_argument("--profiles", help=f"comma-separated, of {', '.join(p.name for p in PROFILES)}")
    parser.add_argument(
        "--wrk-profiles",
        help="profiles wrk loads as well, in the same turns (default: "
        "unique-32,unique-128; quick and --against: none)",
    )
    parser.add_argument("--rounds", type=int, help="rounds of turns (3, --against 2; quick 1)")
    parser.add_argument("--duration", type=float, help="seconds a point (2; quick 1)")
    parser.add_argument(
        "--ceiling-seconds", type=float, help="seconds a batch size, engine alone (1; quick 0.2)"
    )
    parser.add_argument("--out", type=Path, help="folder for the .json and .md (default: out/results)")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    args.stages = [resolve(s.strip()) for s in args.stages.split(",")] if args.stages else list(STAGES)
    names = args.profiles.split(",") if args.profiles else [p.name for p in PROFILES]
    if unknown := set(names) - {p.name for p in PROFILES}:
        parser.error(f"unknown profiles {sorted(unknown)}")
    args.profiles = [p for p in PROFILES if p.name in names]
    default = "" if args.quick or args.against else "unique-32,unique-128"
    args.wrk_profiles = [
        n for n in (default if args.wrk_profiles is None else args.wrk_profiles).split(",") if n
    ]
    args.rounds = args.rounds or (1 if args.quick else 2 if args.against else 3)
    args.duration = args.duration or (1.0 if args.quick else 2.0)
    args.ceiling_seconds = args.ceiling_seconds or (0.2 if args.quick else 1.0)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    run = evidence.start("benchmarks.compare", args, argv)
    if args.against:
        return 1 if any(r["loses"] for r in against(args, run)["summary"]) else 0
    with ExitStack() as stack:
        servers = start(stack, args.stages, evidence.REPO)
        points = in_turns(servers, args.profiles, args.rounds, args.duration, args.wrk_profiles)
    print("the engine alone ...", flush=True)
    ceiling = engine_ceiling(sorted({p.kind for p in args.profiles}), args.ceiling_seconds)
    names = [p.name for p in args.profiles]
    wrk = [n for n in names if n in args.wrk_profiles]
    result = {"stamp": {**run.stamp(ENV, WITHOUT), "load_generator": TOOL}, "duration_s": args.duration,
              "rounds": args.rounds, "stages": args.stages, "profiles": [asdict(p) for p in args.profiles],
              "ceiling": ceiling, "points": points, "summary": summarize(points, args.stages, names),
              "wrk": summarize(points, args.stages, wrk, tool="wrk")}  # fmt: skip
    needs = ({"stage2_threadpool", "stage3_batching"}, {"unique-1", "unique-32"})  # stage 3's targets'
    if needs[0] <= set(args.stages) and needs[1] <= set(names) and "sentence" in ceiling:
        result["targets"] = stage3_targets(points, result["summary"], ceiling["sentence"]["texts_per_s"])
    evidence.publish(run, "compare", result, markdown, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
