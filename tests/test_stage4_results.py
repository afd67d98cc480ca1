"""The stage 4 results the docs include are what `make results ONLY=stage4` wrote, and the command runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.stage4 import S3, S4, markdown

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def test_the_tables_are_rendered_from_the_committed_json() -> None:
    result = json.loads((RESULTS / "stage4.json").read_text())
    assert (RESULTS / "stage4.md").read_text() == markdown(result), "rerun `make results ONLY=stage4`"


def test_the_results_record_the_machine_and_every_measurement() -> None:
    result = json.loads((RESULTS / "stage4.json").read_text())
    assert {"cpu_model", "logical_cores", "memory_gib"} <= set(result["stamp"]["machine"])
    assert {"memory_hit", "redis_hit", "miss_memory_server", "miss_redis_server"} <= set(result["tiers"])
    for stage in (S3, S4):
        assert result["repeated"][stage]["median_round"]["requests"] == 100
        assert sum(s["n"] for s in result["overload"][stage]["by_status"].values()) == 300
    assert result["repeated"][S4]["median_round"]["model_texts"] == 30  # each distinct text once
    flood = result["flood"]
    assert [row["delay_ms"] for row in flood["by_delay"]] == [0.0, 50.0, 200.0]
    for row in flood["by_delay"]:  # the polite clients are refused less often than the ones that resend
        assert row["honour"]["refused_per_s"] < row["resend"]["refused_per_s"]
        assert row["honour"]["ok_per_s"] > 0 and row["resend"]["ok_per_s"] > 0


def test_the_bench_command_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.stage4", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "stage4.json" in done.stdout and "--record" in done.stdout
