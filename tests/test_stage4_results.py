"""The stage 4 results the docs include are what `make results ONLY=stage4` wrote, and the command runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.stage4 import S3, S4, markdown

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def _result() -> dict:
    return json.loads((RESULTS / "stage4.json").read_text())


def test_the_tables_are_rendered_from_the_committed_json() -> None:
    assert (RESULTS / "stage4.md").read_text() == markdown(_result()), "rerun `make results ONLY=stage4`"


def test_the_distance_rows_are_the_ones_the_chapter_reads() -> None:
    """Per-command and pooled, plain and TLS, near and far; the lesson's hit slower than no cache."""
    distance = _result()["distance"]
    rows = distance["rows"]
    assert all(set(row) == {"client", "tls", "rtt_ms", "hit_ms", "miss_ms", "req_s"} for row in rows)
    kinds = {(c, tls, rtt) for c in ("per-command", "pooled") for tls in (False, True) for rtt in (0.0, 30.0)}
    assert {(row["client"], row["tls"], row["rtt_ms"]) for row in rows} == kinds
    far = {row["client"]: row for row in rows if row["tls"] and row["rtt_ms"] >= 20}
    assert far["per-command"]["hit_ms"] >= 2 * far["pooled"]["hit_ms"]
    assert far["per-command"]["hit_ms"] > distance["no_cache_ms"]  # the cache slower than no cache
    assert distance["memory_tier"]["hit_ms"] < far["pooled"]["hit_ms"]  # the in-process tier buys the trip


def test_the_results_record_the_machine_and_every_measurement() -> None:
    result = _result()
    assert {"cpu_model", "logical_cores", "memory_gib"} <= set(result["stamp"]["machine"])
    bound = result["distance"]["bound"]
    assert bound["model"]["timeout_ms"] == result["distance"]["no_cache_ms"]  # the bound at the model's cost
    for stage in (S3, S4):
        assert sum(s["n"] for s in result["overload"][stage]["by_status"].values()) == 300
    flood = result["flood"]
    assert [row["delay_ms"] for row in flood["by_delay"]] == [0.0, flood["default_delay_ms"], 200.0]
    for row in flood["by_delay"]:  # the polite clients are refused less often than the ones that resend
        assert row["honour"]["refused_per_s"] < row["resend"]["refused_per_s"]
        assert row["honour"]["ok_per_s"] > 0 and row["resend"]["ok_per_s"] > 0


def test_the_bench_command_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.stage4", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "stage4.json" in done.stdout and "--record" in done.stdout


def test_the_layers_run_every_stage_in_turns_and_name_where_the_time_goes(tmp_path: Path) -> None:
    """`make results ONLY=layers`, one short round: every stage measured and profiled, each over the one
    before in the same round, and the functions named are the repository's."""
    from benchmarks import layers

    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.layers", "--quick", "--rounds", "1", "--top", "3",
         "--out", str(tmp_path)],
        cwd=RESULTS.parent.parent, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "layers.json").read_text())
    assert set(result["runs"]) == set(layers.STAGES) and all(
        len(r) == 1 and r[0] > 0 for r in result["runs"].values()
    )
    for before, stage in zip(layers.STAGES, layers.STAGES[1:], strict=False):
        assert result["summary"][stage]["rounds_us"] == [result["runs"][stage][0] - result["runs"][before][0]]
    # each piece switched off in a round of its own, its cost that round's difference
    for stage in layers.PIECES:
        off = result["without"][stage]
        assert len(off) == 1 and off[0] > 0
        assert result["summary"][stage]["piece_rounds_us"] == [result["runs"][stage][0] - off[0]]
    # the collector's share of each round is counted, and no more than the round itself
    assert all(
        0 <= g[0] <= r[0] for g, r in zip(result["gc_us"].values(), result["runs"].values(), strict=True)
    )
    for stage in layers.STAGES:
        named = result["where"][stage]
        assert len(named) == 3 and all(w["us"] > 0 and not w["function"].startswith("/") for w in named)
    assert (tmp_path / "layers.md").read_text() == layers.markdown(result)


def test_the_layers_page_is_rendered_from_the_committed_json() -> None:
    from benchmarks import layers

    assert (RESULTS / "layers.md").read_text() == layers.markdown(
        json.loads((RESULTS / "layers.json").read_text())
    )
