"""`make compare`: every stage against the one before, in its quick form (being rewritten)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import layers
from benchmarks.compare import add_ratios
from common.serve import available_stages
from tests.conftest import REPO

TEST_PROFILES = ("unique-8", "repeated-32", "mixed-32", "waves-32", "overload-128")


def test_ratios_compare_each_stage_with_the_one_before() -> None:
    profiles = [Profile("p", "UniqueTextUser", 8), Profile("o", "OverloadUser", 8, texts_per_request=4)]
    points = [
        {"stage": "stage1_naive", "profile": "p", "rps": 10.0},
        {"stage": "stage1_naive", "profile": "o", "rps": 5.0},
        {"stage": "stage2_threadpool", "profile": "p", "rps": 15.0},
        {"stage": "stage2_threadpool", "profile": "o", "rps": 0.0},
    ]
    out = add_ratios(points, profiles, {"sentence": {"texts_per_s": 40.0}})
    assert [p["ratio_to_previous"] for p in out] == [None, None, 1.5, 0.0]
    assert [p["previous_stage"] for p in out] == [None, None, "stage1_naive", "stage1_naive"]
    assert out[2]["fraction_of_ceiling"] == pytest.approx(15 / 40)
    assert out[1]["ceiling_rps"] == 10.0  # 40 texts/s, 4 texts per request


def test_quick_compare_writes_complete_results(tmp_path: Path) -> None:
    """`make compare QUICK=1`, shortened: every stage, every chosen profile, every figure."""
    stages = available_stages()
    command = [
        sys.executable, "-m", "benchmarks.compare", "--quick", "--duration", "2", "--warmup", "0.5",
        "--ceiling-seconds", "0.2", "--users", "8",
        "--out", str(tmp_path), "--img", str(tmp_path / "img"), "--raw", str(tmp_path / "raw"),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr

    result = json.loads((tmp_path / "compare.json").read_text())
    assert result["stages"] == stages
    stamp = result["stamp"]
    assert stamp["quick"] is True and stamp["date"] and stamp["wall_s"] > 0
    assert {"cpu_model", "logical_cores", "memory_gib"} <= set(stamp["machine"])
    assert stamp["machine"]["versions"]["locust"] != "missing"
    assert stamp["settings"]["changed"] == {"MAX_QUEUE": 256}  # COMPARE_ENV, CACHE_URL left out
    assert all(result["engine_ceiling"][kind]["texts_per_s"] > 0 for kind in ("sentence", "mixed"))
    assert [p["name"] for p in result["profiles"]] == list(TEST_PROFILES)
    points = {(p["stage"], p["profile"]): p for p in result["points"]}
    assert set(points) == {(s, name) for s in stages for name in TEST_PROFILES}
    for (stage, name), p in points.items():
        where = f"{stage} {name}"
        assert p["requests"] > 0 and p["successes"] > 0 and p["rps"] > 0, where
        assert 0 < p["p50_ms"] <= p["p95_ms"] <= p["p99_ms"] <= p["max_ms"] * 1.1, where
        assert p["failures"]["other"] == 0, (where, p["errors"])
        assert p["loadgen_cores"] > 0 and p["server_cores"] > 0, where
        assert p["fraction_of_ceiling"] > 0, where
        assert (p["ratio_to_previous"] is None) == (stage == stages[0]), where
    # Before backpressure (stage 4) nothing answers 503, however deep the queue.
    early = {"stage1_naive", "stage2_threadpool", "stage3_batching"}
    assert all(p["failures"]["503"] == 0 for p in points.values() if p["stage"] in early)

    md = (tmp_path / "compare.md").read_text()
    for name in ("machine", "ceiling", *TEST_PROFILES):
        assert f"[start:{name}]" in md and f"[end:{name}]" in md, name
    table_rows = [line for line in md.splitlines() if line.startswith("| ") and "req/s" not in line]
    assert len(table_rows) >= len(stages) * len(TEST_PROFILES)
    for png in ("compare_throughput.png", "compare_p99.png"):
        data = (tmp_path / "img" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, png


def test_compare_reports_a_stage_that_fails_and_exits_nonzero(tmp_path: Path) -> None:
    """A stage that cannot start (its port is taken) is recorded as failed; the files are still written."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.compare", "--quick", "--stages", "1", "--port", str(port),
             "--profiles", "unique-1", "--ceiling-seconds", "0.1", "--out", str(tmp_path),
             "--img", str(tmp_path / "img"), "--raw", str(tmp_path / "raw")],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    result = json.loads((tmp_path / "compare.json").read_text())
    assert list(result["failed_stages"]) == ["stage1_naive"] and result["points"] == []
    assert "**stage1_naive failed**" in (tmp_path / "compare.md").read_text()


def test_compare_against_a_commit_takes_turns(tmp_path: Path) -> None:
    """`make compare AGAINST=HEAD`, short: both commits' stage 1, two rounds in turns, the ratios."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", "--against", "HEAD", "--quick", "--rounds", "2",
         "--stages", "1", "--profiles", "unique-1", "--duration", "1", "--warmup", "0.5",
         "--out", str(tmp_path), "--raw", str(tmp_path / "raw")],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "before_after.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    assert result["parameters"]["before"] == head.strip() and result["parameters"]["rounds"] == 2
    turns = [(p["round"], p["side"]) for p in result["points"]]
    assert turns == [(0, "before"), (0, "after"), (1, "after"), (1, "before")]  # A B, then B A
    (row,) = result["summary"]
    assert row["stage"] == "stage1_naive" and row["ratio"] > 0 and len(row["round_ratios"]) == 2
    assert "[start:ratios]" in (tmp_path / "before_after.md").read_text()


def test_layers_compares_each_stage_with_the_one_before() -> None:
    stages = ["stage1_naive", "stage2_threadpool", "stage3_batching"]
    points = [
        {"connections": n, "stage": s, "round": r, "requests_per_s": rps * (1 + r / 100), "p50_ms": 10.0,
         "p99_ms": 20.0, "server_cores": 1.0, "cpu_ms": cpu, "loop_cpu_ms": 1.0, "socket_errors": 0,
         "non_2xx_per_s": 0.0}
        for n in (1, 32) for r in range(3)
        for s, rps, cpu in zip(stages, (100.0, 150.0, 180.0), (6.0, 5.0, 4.5), strict=True)
    ]  # fmt: skip
    summary = layers.summarize(points, stages, [1, 32], ceiling=200.0)
    three = summary["32"]["stage3_batching"]
    assert three["requests_per_s"] == 181.8  # the median round
    assert three["over_previous"] == round(181.8 / 151.5, 4) and three["cpu_ms_added"] == -0.5
    assert "over_previous" not in summary["1"]["stage1_naive"]
    result = {"stamp": {"machine": {}}, "stages": stages, "summary": summary, "duration_s": 8,
              "rounds": 3, "ceiling": {"texts_per_s": 200.0, "best_batch": 8, "best_calls_at_once": 2,
                                       "one_text_cpu_ms": 4.0}}  # fmt: skip
    page = layers.markdown(result)
    for section in ("stage2", "stage3", "all", "detail"):
        assert f"[start:{section}]" in page
    assert "3 / 2" in page
    assert "1.20×" in page  # stage 3 over stage 2 at both loads
