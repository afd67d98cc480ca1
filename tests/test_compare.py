"""`make compare`: every stage against the one before, in turns; in its quick form, and its verdicts.

Timings on a shared 2-core machine are noise, so these tests check completeness and that every
word of a verdict agrees with the ratio printed beside it, never speed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from benchmarks import compare
from tests.conftest import REPO


def test_a_verdict_word_agrees_with_its_ratio_as_printed() -> None:
    """Faster only above 1.05x and slower only below 0.95x, as the two decimals beside the word read."""
    ratios = (1.2, 1.056, 1.054, 1.0, 0.946, 0.944, None)  # printed 1.20, 1.06, 1.05, 1.00, 0.95, 0.94
    assert [compare.word(r) for r in ratios] == [
        "faster", "faster", "about the same", "about the same", "about the same", "slower", "not measured",
    ]  # fmt: skip
    rows = [("a", 1.3, [1.2, 1.4]), ("b", 1.0, [1.0, 0.99]), ("c", 1.01, [0.9, 1.1]), ("d", 0.5, [0.5, 0.6])]
    sentence = compare.verdict("Stage 2 against stage 1", rows)
    assert sentence == (
        "Stage 2 against stage 1: faster on a (1.30×); about the same on b (1.00×);"
        " within noise on c (1.01×, rounds 0.90–1.10×); slower on d (0.50×)."
    )


def test_a_direction_is_said_only_when_every_round_says_it() -> None:
    assert compare.rounds_word([1.2, 1.3, 1.1]) == "faster"
    assert compare.rounds_word([0.8, 0.9, 0.94]) == "slower"
    assert compare.rounds_word([1.2, 1.3, 1.0]) == "within noise"  # two faster, one the same
    assert compare.rounds_word([0.9, 1.1]) == "within noise"
    assert compare.rounds_word([1.0, 1.04, 0.96]) == "about the same"


def test_compare_takes_the_median_round_and_each_stage_over_the_one_before() -> None:
    stages = ["stage1_naive", "stage2_threadpool"]
    points = [
        {"stage": s, "profile": "unique-32", "round": r, "requests_per_s": rps * (1 + r / 100),
         "p50_ms": 10.0, "p99_ms": None, "non_2xx_per_s": 0.0, "cpu_ms": 5.0,
         "load_generator": "locust"}
        for r in range(3) for s, rps in zip(stages, (100.0, 150.0), strict=True)
    ]  # fmt: skip
    row = compare.summarize(points, stages, ["unique-32"])["unique-32"]
    assert row["stage2_threadpool"]["requests_per_s"] == 151.5  # the median round
    assert row["stage2_threadpool"]["over_previous"] == 1.5 and "over_previous" not in row["stage1_naive"]
    assert (
        row["stage2_threadpool"]["rounds"] == [1.5, 1.5, 1.5]
        and row["stage2_threadpool"]["verdict"] == "faster"
    )
    assert row["stage1_naive"]["p99_ms"] is None  # no answer had a latency: not a zero


def test_a_target_is_met_or_missed_only_when_every_round_is() -> None:
    """Stage 3's targets from compare's points: each round's ratio against the target."""
    rps = {
        ("stage2_threadpool", "unique-32"): (100.0, 100.0),
        ("stage3_batching", "unique-32"): (130.0, 120.0),
        ("stage2_threadpool", "unique-1"): (50.0, 50.0),
        ("stage3_batching", "unique-1"): (50.0, 50.0),
    }
    p50 = {"unique-1": {"stage2_threadpool": 10.0, "stage3_batching": 11.0}}
    points = [{"stage": s, "profile": pr, "round": r, "requests_per_s": each[r], "load_generator": "locust",
               "p50_ms": p50.get(pr, {}).get(s, 100.0), "p99_ms": 200.0 if s == "stage3_batching" else 100.0}
              for (s, pr), each in rps.items() for r in (0, 1)]  # fmt: skip
    stages = ("stage2_threadpool", "stage3_batching")
    summary = {pr: {s: compare.medians([p for p in points if (p["stage"], p["profile"]) == (s, pr)])
                    for s in stages} for pr in ("unique-1", "unique-32")}  # fmt: skip
    got = {t["key"]: t for t in compare.stage3_targets(points, summary, ceiling=160.0)}
    assert got["engine"]["rounds"] == [0.812, 0.75] and got["engine"]["verdict"] == "within noise"  # 0.80
    assert got["rps"]["rounds"] == [1.3, 1.2] and got["rps"]["verdict"] == "within noise"  # 1.25: one round
    assert got["p99"]["verdict"] == "missed" and got["p50"]["verdict"] == "met"  # 2.0x; 1.1x under 1.2
    committed = json.loads((REPO / "docs" / "results" / "compare.json").read_text())
    for t in committed["targets"]:  # the recorded verdicts are what the rounds say
        inside = [r >= t["target"] if t["bound"] == "at least" else r <= t["target"] for r in t["rounds"]]
        assert t["verdict"] == ("met" if all(inside) else "missed" if not any(inside) else "within noise")


def _verdict_words(sentence: str) -> dict[str, str]:
    """A verdict ("X: faster on a (1.2×) and b (1.1×); slower on c (0.8×).") as {load: word}."""
    words = {}
    for part in sentence.split(": ", 1)[1].rstrip(".").split("; "):
        word, loads = part.split(" on ", 1)
        for load_ in re.sub(r" \([^)]*\)", "", loads).replace(" and ", ", ").split(", "):
            words[load_] = word
    return words


def test_quick_compare_writes_every_section_and_words_that_agree_with_the_ratios(tmp_path: Path) -> None:
    """`make compare QUICK=1`, shortened to two stages: stage 1 (no bound) and stage 4 (a bound that
    refuses the overload with 503, counted apart from the answers); Locust loads every point, wrk
    unique-32 as well."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", "--quick", "--stages", "1,4", "--profiles",
         "unique-1,unique-32,overload-128", "--wrk-profiles", "unique-32", "--ceiling-seconds", "0.05",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "compare.json").read_text())
    stages = ["stage1_naive", "stage4_cache_backpressure"]
    assert result["stages"] == stages and result["stamp"]["quick"] is True
    assert result["stamp"]["load_generator"] == "locust"
    assert result["stamp"]["settings"]["changed"] == {"MAX_QUEUE": 256}  # CACHE_URL left out
    assert result["ceiling"]["sentence"]["texts_per_s"] > 0
    assert sorted((p["stage"], p["profile"], p["load_generator"]) for p in result["points"]) == sorted(
        [(s, p, "locust") for s in stages for p in ("unique-1", "unique-32", "overload-128")]
        + [(s, "unique-32", "wrk") for s in stages]
    )
    for p in result["points"]:
        assert p["load_generator_cpu"] > 0, p  # the tool's own cores, beside every point
        if p["profile"] != "overload-128":
            assert p["requests_per_s"] > 0 and p["cpu_ms"] > 0 and 0 < p["p50_ms"] <= p["p99_ms"], p
    overload = {p["stage"]: p for p in result["points"] if p["profile"] == "overload-128"}
    assert overload["stage1_naive"]["non_2xx_per_s"] == 0  # no bound: everything waits
    assert overload["stage4_cache_backpressure"]["non_2xx_per_s"] > 0  # refused at once, not throughput

    md = (tmp_path / "compare.md").read_text()
    for name in ("machine", "ceiling", "stage1", "stage4", "all", "load-generator", "agreement"):
        assert f"[start:{name}]" in md and f"[end:{name}]" in md, name
    wrk = result["wrk"]["unique-32"]["stage4_cache_backpressure"]
    assert wrk["rounds"] and wrk["verdict"] == compare.rounds_word(wrk["rounds"])
    agreement = md.split("[start:agreement]")[1].split("[end:agreement]")[0]
    assert f"{wrk['over_previous']:.2f}×" in agreement and "their verdicts agree on" in agreement
    section = md.split("[start:stage4]")[1].split("<!--")[0]
    sentence = next(line for line in section.splitlines() if line.startswith("Stage 4 against stage 1"))
    said = _verdict_words(sentence)
    for load_, row in result["summary"].items():
        r, rounds = (
            row["stage4_cache_backpressure"]["over_previous"],
            row["stage4_cache_backpressure"]["rounds"],
        )
        assert said[load_] == row["stage4_cache_backpressure"]["verdict"] == compare.rounds_word(rounds)
        assert r is None or f"{load_} ({r:.2f}×" in sentence
    stage1 = md.split("[start:stage1]")[1].split("[end:stage1]")[0]
    one = next(line for line in stage1.splitlines() if line.startswith("Stage 1 at 32 connections against 1"))
    rounds = [p for p in result["points"] if p["stage"] == "stage1_naive" and p["load_generator"] == "locust"]
    rps = {(p["profile"], p["round"]): p["requests_per_s"] for p in rounds}
    each = [compare.ratio(rps[("unique-32", r)], rps[("unique-1", r)]) for r in sorted({r for _, r in rps})]
    assert f": {compare.rounds_word(each)} on unique-32 over unique-1" in one  # every round's word


def test_compare_against_a_commit_takes_turns(tmp_path: Path) -> None:
    """`make compare AGAINST=HEAD`, short: both commits' stage 1 at once, two rounds in turns."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", "--against", "HEAD", "--quick", "--rounds", "2",
         "--stages", "1", "--profiles", "unique-1", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    result = json.loads((tmp_path / "before_after.json").read_text())
    (row,) = result["summary"]
    assert done.returncode == (1 if row["loses"] else 0), done.stdout + done.stderr  # the guard's status
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    assert result["parameters"]["before"] == head.strip() and result["parameters"]["rounds"] == 2
    turns = [(p["round"], p["side"]) for p in result["points"]]
    assert turns == [(0, "before"), (0, "after"), (1, "after"), (1, "before")]  # A B, then B A
    assert row["stage"] == "stage1_naive" and row["ratio"] > 0 and len(row["round_ratios"]) == 2
    assert row["loses"] == all(r < 0.95 for r in row["round_ratios"])
    md = (tmp_path / "before_after.md").read_text()
    assert "[start:ratios]" in md and f"{int(row['loses'])} of 1 points lose" in md
