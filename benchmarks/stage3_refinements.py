"""What each stage 3 refinement changes, through the batcher alone: no HTTP, no real model calls.

    python -m benchmarks.stage3_refinements            # a few seconds
    python -m benchmarks.stage3_refinements --record   # docs/results/stage3_refinements.{json,md}

The textbook ``Batcher`` first, then the refinements added one at a time in the chapter's order
(load tiers, length grouping, length buckets, failure isolation), then each on its own on top of
the textbook batcher. Three fixed scenarios, each with the default settings except where named:

* ``burst``: 256 mixed texts (stage 0's corpus, the real tokenizer), one per request, queued at
  once. Batches, model calls, padding ratio, and the work the model is asked for in padded
  tokens (padded tokens + calls x CALL_OVERHEAD_TOKENS, the cost the length buckets minimize).
* ``bad text``: the same burst with one text that makes the model raise: how many callers get
  an error, and how many model calls the batcher makes.
* ``lone``: 20 requests one after another with BATCH_WINDOW_MS=5: how long each waits in the queue.

The model is a stand-in that returns zeros (raising on the bad text), so the figures count what
the batcher decides, not how fast a CPU runs it; they are the same on every machine. Throughput
is measured with the real engine, on a quiet machine, by ``benchmarks.stage3``.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np

from common import corpus
from common.engine import Engine, TokenizedText
from common.settings import Settings
from loadtests import evidence
from loadtests.tables import num, page, table
from stage3_batching.batcher import Batcher
from stage3_batching.refined import RefinedBatcher

# RefinedBatcher's switch for each refinement, and the name the results file has always used
CHAPTER_ORDER = ("tiers", "grouping", "buckets", "isolation")
NAMES = {"tiers": "load tiers", "grouping": "length grouping", "buckets": "length buckets",
         "isolation": "failure isolation"}  # fmt: skip
CLASS_NAMES = {"tiers": "LoadTiers", "grouping": "GroupByLength", "buckets": "LengthBuckets",
               "isolation": "IsolateFailures"}  # fmt: skip
BAD_ID = 10**9  # a token id no tokenizer makes: the stand-in model raises on it
BAD_TEXT = 100  # which text of the burst is the bad one
DIM = 384


def compose(*refinements: str) -> Callable[..., Batcher]:
    """The textbook batcher with ``refinements`` (in the order the chapter adds them)."""
    switches = {name: name in refinements for name in (*CHAPTER_ORDER, "busy_slots")}
    return partial(RefinedBatcher, **switches) if refinements else Batcher


def _model(ids: list[np.ndarray]) -> np.ndarray:
    if any(row[-1] == BAD_ID for row in ids):
        raise ValueError("bad text")
    return np.zeros((len(ids), DIM), np.float32)


async def _burst(
    kind: Callable[..., Batcher], tokens: list[TokenizedText], settings: Settings
) -> dict[str, Any]:
    batcher = kind(_model, settings)
    await batcher.start()
    outcomes = await asyncio.gather(*(batcher.submit([t]) for t in tokens), return_exceptions=True)
    await batcher.close()
    s = batcher.stats
    return {
        "batches": s.batches,
        "model_calls": s.calls,
        "padding_ratio": s.padding_ratio,
        "padded_tokens": s.padded_tokens,
        "work_tokens": s.padded_tokens + s.calls * settings.call_overhead_tokens,
        "failed_callers": sum(isinstance(o, BaseException) for o in outcomes),
    }


async def _lone(kind: Callable[..., Batcher], tokens: list[TokenizedText], settings: Settings) -> float:
    batcher = kind(_model, settings.model_copy(update={"batch_window_ms": 5.0}))
    await batcher.start()
    waits = [(await batcher.submit([t])).queue_ms for t in tokens[:20]]
    await batcher.close()
    return float(np.mean(waits))


async def measure(n: int = 256) -> dict[str, Any]:
    settings = Settings()
    tokens = Engine.from_settings(settings).tokenize(corpus.texts(n, seed=77, kind="mixed"))
    bad = list(tokens)
    bad[BAD_TEXT] = replace(bad[BAD_TEXT], ids=np.append(bad[BAD_TEXT].ids, BAD_ID))
    rows = []
    steps = [CHAPTER_ORDER[:i] for i in range(len(CHAPTER_ORDER) + 1)] + [(r,) for r in CHAPTER_ORDER]
    for i, refinements in enumerate(steps):
        kind = compose(*refinements)
        if i <= len(CHAPTER_ORDER):  # the chapter's steps: each adds one to the row above
            name = f"{i}. + {NAMES[refinements[-1]]}" if refinements else "0. textbook"
        else:
            name = f"textbook + {NAMES[refinements[0]]} only"
        burst = await _burst(kind, tokens, settings)
        failed = await _burst(kind, bad, settings)
        rows.append({
            "batcher": name,
            "refinements": [CLASS_NAMES[r] for r in refinements],
            "burst": burst,
            "bad_text": {"failed_callers": failed["failed_callers"], "model_calls": failed["model_calls"]},
            "lone_wait_ms": await _lone(kind, tokens, settings),
        })  # fmt: skip
    return {"texts": n, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    body = table(
        ["batcher", "batches", "model calls", "padding", "work, tokens", "failed by 1 bad text",
         "calls with it", "lone wait ms"],
        [
            (r["batcher"], b["batches"], b["model_calls"], num(100 * b["padding_ratio"], 0, "%"),
             num(b["work_tokens"], 0), r["bad_text"]["failed_callers"], r["bad_text"]["model_calls"],
             num(r["lone_wait_ms"], 2))
            for r in result["rows"]
            for b in [r["burst"]]
        ],
    )  # fmt: skip
    note = (
        f"{result['texts']} mixed texts, one per request, queued at once; a stand-in model (figures"
        " count what the batcher decides, not CPU time). Rows 1-4 add one refinement each to the row"
        " above; the last four add one alone to the textbook batcher."
    )
    return page(result["stamp"], {"refinements": body}, note)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    evidence.add_arguments(parser)  # --quick for `make results QUICK=1`: this run is short already
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.stage3_refinements", args, argv)
    run.quick = False  # the figures count the batcher's decisions: a QUICK run finds the same ones
    result = {"stamp": {}, **asyncio.run(measure())}
    result["stamp"] = run.stamp()
    out = run.results_dir
    evidence.write_json(out / "stage3_refinements.json", result)
    evidence.write_text(out / "stage3_refinements.md", markdown(result))
    print(markdown(result))
    print(f"wrote {out / 'stage3_refinements.json'} and {out / 'stage3_refinements.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
