"""`make bench-request-path`: the Python calls a lone request costs each stage, counted for real."""

from __future__ import annotations

import cProfile
import json
import logging
import os
import pstats
from pathlib import Path

import prometheus_client
import pytest

from benchmarks import request_path
from benchmarks.request_path import OTHER, calls_by_group, group_of, main, markdown, price_of_a_call, where
from common import api
from common.api import EmbedResult

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def test_a_function_counts_where_its_file_is() -> None:
    assert where(prometheus_client.__file__) == "prometheus_client"
    assert where(api.__file__) == "common" and group_of(api.__file__) == "common/ (the contract)"
    assert where(logging.__file__) == "logging" and group_of(logging.__file__) == "stage 5 (telemetry)"
    assert where(os.__file__) == "os" and group_of(os.__file__) == OTHER
    assert where("~") == "~"


def test_a_profile_is_counted_per_request_and_c_calls_go_to_their_caller(tmp_path: Path) -> None:
    """Three 'requests' (the function counted once per answer), each with a C call (len)."""
    result = EmbedResult([[0.0]], [3], [False], 1.0)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(3):
        api._result_headers(result, 0.0)
    profile.disable()
    profile.dump_stats(tmp_path / "p.prof")
    requests, groups, functions = calls_by_group(pstats.Stats(str(tmp_path / "p.prof")))
    assert requests == 3
    assert groups["common/ (the contract)"] >= 1  # _result_headers itself, and the C calls it makes
    assert functions["common/api.py:_result_headers"] == 1
    assert any(f.startswith("common/api.py: ") for f in functions)  # a C function, under its caller


def test_a_profile_without_a_request_is_refused(tmp_path: Path) -> None:
    profile = cProfile.Profile()
    profile.enable()
    sum([1, 2])
    profile.disable()
    profile.dump_stats(tmp_path / "p.prof")
    with pytest.raises(RuntimeError, match="no embedding request"):
        calls_by_group(pstats.Stats(str(tmp_path / "p.prof")))


def test_a_call_is_priced_by_the_slope_of_the_loops_cpu_over_the_calls() -> None:
    rows = [{"calls_per_request": c, "loop_cpu_ms": 0.2 + c * 1.5e-3} for c in (400, 530, 700, 890)]
    assert price_of_a_call(rows) == pytest.approx(1.5)  # µs a call; the 0.2 ms every request pays is not
    assert price_of_a_call(rows[:1]) is None  # one stage: no slope
    falling = [{"calls_per_request": c, "loop_cpu_ms": 1.0 - c * 1e-4} for c in (400, 900)]
    assert price_of_a_call(falling) is None  # noise larger than the calls: no price, not a negative one


def test_the_page_is_rendered_from_the_committed_json() -> None:
    result = json.loads((RESULTS / "request_path.json").read_text())
    assert (RESULTS / "request_path.md").read_text() == markdown(result), "rerun `make bench-request-path`"
    rows = {r["stage"]: r for r in result["results"]}
    assert rows["stage5_metrics"]["by_group"]["stage 5 (telemetry)"] > 0
    assert rows["stage2_threadpool"]["by_group"]["stage 5 (telemetry)"] < 1  # a stray log line at most


def test_a_short_run_counts_real_servers(tmp_path: Path) -> None:
    """Stages 2 and 5 under the profiler and then in turns: stage 5 makes more calls, in its own
    code among them, and every figure of the page is there."""
    main(["--quick", "--duration", "1", "--warmup", "0.5", "--stages", "stage2_threadpool", "stage5_metrics",
          "--without", "--out", str(tmp_path)])  # fmt: skip
    result = json.loads((tmp_path / "request_path.json").read_text())
    two, five = result["results"]
    assert two["requests"] > 20 and five["requests"] > 20
    assert five["calls_per_request"] > two["calls_per_request"] > 100
    assert five["by_group"]["stage 5 (telemetry)"] > 20 and two["by_group"]["stage 5 (telemetry)"] < 1
    assert sum(five["by_group"].values()) == pytest.approx(five["calls_per_request"], abs=1)
    assert five["extra_calls"] == pytest.approx(five["calls_per_request"] - two["calls_per_request"], abs=0.2)
    assert two["loop_cpu_ms"] > 0 and five["p50_ms"] > 0
    assert any(f.startswith("prometheus_client") for f in five["added_functions"])
    page = (tmp_path / "request_path.md").read_text()
    assert page == markdown(result) and "[start:calls]" in page and "[start:added]" in page
    assert "[start:without]" not in page and result["without"] == []  # none taken out: no such table
    assert not list(Path(request_path.__file__).parent.glob("*.prof"))  # the profiles stay in out/


def test_taking_a_layer_out_of_stage_5_removes_its_calls(tmp_path: Path) -> None:
    """Stage 5 counted again without the disconnect watch, then without the counters: each time
    the calls of that layer's own code are gone, and the batcher's are untouched."""
    main(["--quick", "--duration", "1", "--warmup", "0.5", "--stages", "stage3_batching", "stage5_metrics",
          "--without", "watch", "metrics", "--out", str(tmp_path)])  # fmt: skip
    result = json.loads((tmp_path / "request_path.json").read_text())
    five = result["results"][1]
    watch, metrics = result["without"]
    assert [watch["without"], metrics["without"]] == ["watch", "metrics"]
    stage4, stage5 = "stage 4 (cache, single-flight, admission)", "stage 5 (telemetry)"
    # the watch lives in stage 4's folder (unless_client_leaves, _client_gone, hang_up) and in asyncio
    assert five["by_group"][stage4] - watch["by_group"][stage4] >= 3
    assert five["by_group"]["asyncio"] - watch["by_group"]["asyncio"] >= 3
    assert watch["by_group"][stage5] == pytest.approx(five["by_group"][stage5], abs=3)  # the counters stay
    # the counters are prometheus_client's, filed under stage 5's telemetry; the cache still runs
    assert five["by_group"][stage5] - metrics["by_group"][stage5] >= 20
    assert metrics["by_group"][stage4] == pytest.approx(five["by_group"][stage4], abs=3)
    for row in (watch, metrics):  # nothing of the batcher goes with either layer
        assert row["by_group"]["stage 3 (the batcher)"] == pytest.approx(
            five["by_group"]["stage 3 (the batcher)"], abs=3
        )
        assert row["fewer_calls"] == pytest.approx(
            five["calls_per_request"] - row["calls_per_request"], abs=0.2
        )
    assert all(f.startswith("prometheus_client/") for f in list(metrics["gone_functions"])[:3])
    assert "common/api.py:_result_headers" not in metrics["gone_functions"]  # once a request, in both runs
