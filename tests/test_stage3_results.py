"""The stage 3 numbers in the docs are what `make results ONLY=stage3` wrote, and its driver measures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from benchmarks.stage3 import WINDOWS, batch_delta, bodies_for, load, markdown, summarize

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"


def _result() -> dict:  # type: ignore[type-arg]
    return dict(json.loads((RESULTS / "stage3_sweep.json").read_text()))


def test_the_tables_are_rendered_from_the_committed_json() -> None:
    result = _result()
    assert (RESULTS / "stage3.md").read_text() == markdown(result), "rerun `make results ONLY=stage3`"
    assert result["summary"] == json.loads(json.dumps(summarize(result)))


def test_the_results_record_the_machine_and_every_sweep() -> None:
    result = _result()
    assert {"cpu_model", "logical_cores", "memory_gib"} <= set(result["stamp"]["machine"])
    assert {"before", "after"} <= set(result["load_average"])
    assert [p["max_batch_size"] for p in result["batch_size"]] == [1, 4, 8, 16, 32, 64]
    assert {(p["stage"], p["clients"]) for p in result["targets"]} == {
        (s, c) for s in ("stage2_threadpool", "stage3_batching") for c in (1, 32)
    }
    assert all(p["errors"] == 0 and p["requests_per_s"] > 0 for key in ("targets", "batch_size",
               "mixed", "variant") for p in result[key])  # fmt: skip
    # wrk counts an answer slower than its 2 s timeout as an error: 128 connections on a shared
    # machine get there; fewer must not.
    windows = result["windows"]["points"]
    assert all(p["requests_per_s"] > 0 for p in windows)
    assert all(p["errors"] == 0 for p in windows if p["clients"] < 128)
    assert {(r["clients"], r["medium_ms"], r["high_ms"]) for r in result["windows"]["summary"]} == {
        (n, *w) for n in (8, 32, 128) for w in WINDOWS
    }
    burst = {(b["group_by_length"], b["split_by_length"]): b["padding_ratio"] for b in result["burst"]}
    assert burst[(True, False)] < burst[(False, False)] and burst[(True, True)] < burst[(True, False)]


def test_every_results_section_the_chapter_includes_exists() -> None:
    chapter = "".join((REPO / "docs" / page).read_text() for page in ("stage3.md", "lab/stage3.md"))
    results = (RESULTS / "stage3.md").read_text()
    wanted = re.findall(r'--8<-- "docs/results/stage3\.md:(\w+)"', chapter)
    assert wanted
    for name in wanted:
        assert f"[start:{name}]" in results and f"[end:{name}]" in results, name


def test_the_driver_measures_a_real_server(server_factory) -> None:  # type: ignore[no-untyped-def]
    with server_factory("stage3_batching", {}) as srv:
        before = httpx.get(f"{srv.url}/v1/batcher/metrics").json()
        point = load(srv.url, bodies_for("sentence", 500, seed=5), clients=4, seconds=1.0, warmup=0.2)
        after = httpx.get(f"{srv.url}/v1/batcher/metrics").json()
    assert point["errors"] == 0 and point["requests_per_s"] > 0
    assert point["p50_ms"] <= point["p99_ms"]
    served = after["texts"] - before["texts"]
    assert served >= point["requests_per_s"] * 1.0  # warm-up requests are served too
    delta = batch_delta(before, after)
    assert 1 <= delta["average_batch_size"] <= 4  # four clients: never more than four texts queued
