"""The stage 3 numbers in the docs are what `make results ONLY=stage3` wrote, and its parts measure."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.compare import rounds_word
from benchmarks.stage3 import (
    PRICES,
    REFINEMENTS,
    SERVERS,
    SWEEP,
    SWEPT,
    batcher_metrics,
    batcher_with,
    burst,
    call_overhead,
    classifier_sections,
    markdown,
    plateau,
    rule_figures,
)
from common.batch_stats import BatchRecord
from common.engine import Engine
from common.settings import Settings
from loadtests.load import bodies_for, locust

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"


def _result() -> dict:  # type: ignore[type-arg]
    return dict(json.loads((RESULTS / "stage3.json").read_text()))


def test_the_page_is_rendered_from_the_committed_json() -> None:
    result = _result()
    assert (RESULTS / "stage3.md").read_text() == markdown(result), "rerun `make results ONLY=stage3`"


def test_the_results_hold_every_server_point_and_every_step() -> None:
    result = _result()
    assert {"cpu_model", "logical_cores", "memory_gib"} <= set(result["stamp"]["machine"])
    assert {(p["server"], p["connections"]) for p in result["servers"]} == {
        (name, n) for name, (_, _, loads) in SERVERS.items() for n in loads
    }
    assert all(p["requests_per_s"] > 0 for p in result["servers"])
    assert all(p["errors"] == 0 for p in result["servers"])
    assert all(p["load_generator_cpu"] > 0 for p in result["servers"])  # Locust's own cores, every point
    rows = result["refinements"]["rows"]
    assert len(rows) == len(REFINEMENTS) + 1 and rows[0]["batcher"] == "0. textbook"
    assert [p["price"] for p in result["refinements"]["prices"]] == list(PRICES)
    padding = [r["padding_ratio"] for r in rows]  # grouping (row 2) and buckets (row 3) cut it
    assert padding[2] < padding[1] and padding[3] < padding[2]


def test_the_sweep_holds_every_batch_limit_beside_stages_1_and_2_and_its_verdicts_agree() -> None:
    result = _result()
    limits = sorted({*SWEPT, Settings().max_batch_size})
    assert [(r["max_batch_size"], r["connections"]) for r in result["batch_sweep"]] == [
        (b, n) for b in limits for n in SWEEP
    ]
    assert [(b["stage"], b["connections"]) for b in result["baselines"]] == [
        (s, n) for s in ("stage 1", "stage 2") for n in SWEEP
    ]
    for row in result["batch_sweep"] + result["baselines"]:
        assert len(row["rounds"]) == result["rounds"] and row["req_s"] == statistics.median(row["rounds"])
    for row in result["batch_sweep"]:
        assert row["mean_batch"] <= row["max_batch_size"] + 1e-9  # the limit holds
    for one in result["batch_of_one"].values():
        assert one["verdict"] == rounds_word(one["rounds"])
    assert [r["batch"] for r in result["plateau"]] == limits


def test_the_plateau_times_each_batch_size_in_both_orders() -> None:
    rows = plateau(n=16, passes=1)
    assert [r["batch"] for r in rows] == sorted({*SWEPT, Settings().max_batch_size})
    for r in rows:
        assert all(r[f"{o}_{w}_ms"] > 0 for o in ("as_they_come", "sorted") for w in ("cpu", "wall")), r


def _batch(tier: str, size: int, queue_ms: float = 0.0) -> BatchRecord:
    return BatchRecord(size, size, size, tier, [queue_ms] * size, 1.0, None)


def test_a_rule_is_judged_by_what_it_did_at_the_step() -> None:
    """One client (0-10 s), 64 (10-20 s), one again: the first HIGH batch after the step up, the
    first LOW after the step down, lone batches that waited, busy batches sent at once."""
    records = [(1.0, _batch("low", 1)), (2.0, _batch("medium", 1, 2.0)), (10.5, _batch("low", 4)),
               (11.0, _batch("high", 16)), (20.2, _batch("high", 1, 5.0)),
               (20.4, _batch("low", 1))]  # fmt: skip
    got = rule_figures({"steps": [0.0, 10.0, 20.0], "records": records})
    assert got["react_up_ms"] == 1000.0 and round(got["react_down_ms"]) == 400
    assert (got["lone_batches"], got["lone_waited"], got["lone_waited_ms"]) == (4, 2, 3.5)
    assert (got["busy_batches"], got["busy_went_at_once"], got["busy_mean_batch"]) == (2, 1, 10.0)


def test_the_rules_verdict_counts_the_figures_each_rule_wins() -> None:
    c = _result()["classifier"]
    rows = {r["rule"]: r for r in c["rows"]}
    assert set(rows) == {"depth", "rate"} and all(
        len(r["rounds"]) == len(rows["depth"]["rounds"]) for r in c["rows"]
    )
    said = classifier_sections(c)["classifier_verdict"][0]
    keys = ("react_up_ms", "react_down_ms", "lone_waited", "busy_went_at_once")
    worst = float("inf")
    ahead = sum((rows["depth"][k] if rows["depth"][k] is not None else worst)
                < (rows["rate"][k] if rows["rate"][k] is not None else worst) for k in keys)  # fmt: skip
    assert f"The depth rule is ahead on {ahead} of 4" in said


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
        point = locust(srv.url, bodies_for("sentence", 2000, seed=5), 4, 1.0)
        after = batcher_metrics(srv.url)
    assert before is not None and after is not None
    assert point["socket_errors"] == 0 and point["requests_per_s"] > 0
    served, batches = after["texts"] - before["texts"], after["batches"] - before["batches"]
    assert served >= point["requests_per_s"] * point["window_s"] - 1  # Locust counts within its window
    assert 1 <= served / batches <= 4  # four connections: never more than four texts queued
