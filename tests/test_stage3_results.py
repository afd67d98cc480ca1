"""The stage 3 numbers in the docs are what `make results ONLY=stage3` wrote, and its parts measure."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.stage3 import (
    PRICES,
    REFINEMENTS,
    SERVERS,
    batcher_metrics,
    batcher_with,
    bodies_for,
    burst,
    call_overhead,
    markdown,
    verdict,
)
from common.engine import Engine
from common.settings import Settings
from loadtests.load import wrk

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"


def _result() -> dict:  # type: ignore[type-arg]
    return dict(json.loads((RESULTS / "stage3.json").read_text()))


def test_the_page_is_rendered_from_the_committed_json() -> None:
    result = _result()
    assert (RESULTS / "stage3.md").read_text() == markdown(result), "rerun `make results ONLY=stage3`"
    assert result["verdict"] == json.loads(json.dumps(verdict(result)))


def test_the_results_hold_every_server_point_and_every_step() -> None:
    result = _result()
    assert {"cpu_model", "logical_cores", "memory_gib"} <= set(result["stamp"]["machine"])
    assert {(p["server"], p["connections"]) for p in result["servers"]} == {
        (name, n) for name, (_, _, loads) in SERVERS.items() for n in loads
    }
    assert all(p["requests_per_s"] > 0 for p in result["servers"])
    # wrk counts an answer slower than its 2 s timeout as an error: 128 connections on a shared
    # machine get there; fewer must not.
    assert all(p["errors"] == 0 for p in result["servers"] if p["connections"] < 128)
    rows = result["refinements"]["rows"]
    assert len(rows) == len(REFINEMENTS) + 1 and rows[0]["batcher"] == "0. textbook"
    assert [p["price"] for p in result["refinements"]["prices"]] == list(PRICES)
    padding = [r["padding_ratio"] for r in rows]  # grouping (row 2) and buckets (row 3) cut it
    assert padding[2] < padding[1] and padding[3] < padding[2]


def test_every_results_section_the_chapters_include_exists() -> None:
    chapter = "".join((REPO / "docs" / page).read_text() for page in ("stage3.md", "lab/stage3.md"))
    results = (RESULTS / "stage3.md").read_text()
    wanted = re.findall(r'--8<-- "docs/results/stage3\.md:(\w+)"', chapter)
    assert wanted
    for name in wanted:
        assert f"[start:{name}]" in results and f"[end:{name}]" in results, name


def test_each_refinement_changes_what_its_chapter_says_through_the_real_engine(engine: Engine) -> None:
    """The burst with the real engine: grouping and buckets cut the padding, and an out-of-range
    token id (the engine raises on it) fails every caller of its call without isolation, one with."""
    settings = Settings(batch_concurrency=2)
    tokens = engine.tokenize([f"{'word ' * (1 + i % 40)}{i}" for i in range(64)])

    def run(*refinements: str, bad: bool = False) -> dict:  # type: ignore[type-arg]
        texts = list(tokens)
        if bad:
            texts[10] = replace(texts[10], ids=np.append(texts[10].ids[:-1], 10**9))
        return asyncio.run(burst(batcher_with(*refinements), engine.run, texts, settings))

    textbook, grouped, split = run(), run("tiers", "grouping"), run("tiers", "grouping", "buckets")
    assert textbook["padding_ratio"] > grouped["padding_ratio"] > split["padding_ratio"]
    assert split["model_calls"] > grouped["model_calls"]
    assert textbook["failed_callers"] == 0 and textbook["cpu_ms"] > 0
    assert run(bad=True)["failed_callers"] > 1
    assert run(*REFINEMENTS, bad=True)["failed_callers"] == 1


def test_one_more_call_costs_a_positive_price_in_padded_tokens() -> None:
    call = call_overhead(k=8, repeats=3)
    assert call["tokens"] > 0 and call["fixed_ms"] > 0
    assert call["in_batch_ms"] < call["alone_ms"]  # one length, no padding: a batch saves the calls


def test_the_metrics_read_around_a_load_count_its_batches(server_factory) -> None:  # type: ignore[no-untyped-def]
    with server_factory("stage3_batching", {}) as srv:
        before = batcher_metrics(srv.url)
        point = wrk(srv.url, bodies_for("sentence", 500, seed=5), 4, 1.0)
        after = batcher_metrics(srv.url)
    assert before is not None and after is not None
    assert point["socket_errors"] == 0 and point["requests_per_s"] > 0
    served, batches = after["texts"] - before["texts"], after["batches"] - before["batches"]
    assert served >= point["requests_per_s"]  # wrk counts the answers within its second
    assert 1 <= served / batches <= 4  # four connections: never more than four texts queued
