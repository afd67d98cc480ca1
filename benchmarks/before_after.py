"""Before and after a change: two commits' servers under the same load, taking turns.

    python -m benchmarks.before_after                     # BEFORE against this checkout, ~45 min
    python -m benchmarks.before_after --before 8f0f03d    # any commit (a worktree under out/)
    python -m benchmarks.before_after --quick             # seconds per point, to see that it works
    make before-after                                     # the same (QUICK=1, RECORD=1, ARGS=...)

Two runs of ``make compare`` an hour apart measure the machine's drift as much as the change
(on a shared 2-core machine the engine alone moved by a fifth between two such runs). Here each
stage of the two commits runs the same Locust profiles as ``make compare``, in turns: A B in
the first round, B A in the second, and so on, so that a drift hits both alike and neither
always goes first. The commit before is checked out into a git worktree (its own code, this venv and
model); the load generator is this checkout's, the same for both.

Per stage and profile: the median requests/s of each commit over the rounds, the ratio after /
before, and each round's ratio (their spread is the noise a single ratio carries). A point is
flagged when it loses more than 5 % in every round (the layout's promise was that no stage
loses more than 5 %); a median under 0.95 that one round contradicts is the machine's noise.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks import compare
from common.serve import STAGES
from loadtests import evidence
from loadtests.harness import COMPARE_ENV, COMPARE_WITHOUT
from loadtests.tables import num, page, stage_label, table

# The last commit before the stage folders were re-laid out (issue 13): what "before" means here.
BEFORE = "8f0f03d"
LOSS = 0.95  # a ratio under this is a loss worth a look


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=evidence.REPO, capture_output=True, text=True, check=True)
    return done.stdout.strip()


@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """``rev`` checked out beside this repository (under out/), with this checkout's model."""
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = evidence.OUT / "before_after" / sha[:12]
    if path.exists():
        _git("worktree", "remove", "--force", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    _git("worktree", "add", "--detach", str(path), sha)
    try:
        (path / "models").symlink_to(evidence.REPO / "models", target_is_directory=True)
        yield path
    finally:
        _git("worktree", "remove", "--force", str(path))
        shutil.rmtree(path, ignore_errors=True)


def _stages(tree: Path, wanted: Sequence[str]) -> list[str]:
    return [s for s in wanted if (tree / s / "app.py").is_file() and (evidence.REPO / s / "app.py").is_file()]


def measure(args: argparse.Namespace, before: Path) -> list[dict[str, Any]]:
    trees = {"before": before, "after": evidence.REPO}
    profiles = compare.select_profiles(args.profiles, None)
    points: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
        for stage in args.stages:
            for side in order:
                print(f"round {round_ + 1}/{args.rounds}: {stage}, {side}", flush=True)
                for point in compare.run_stage(stage, profiles, args, trees[side], label=side):
                    points.append({**point, "side": side, "round": round_})
    return points


def summarize(
    points: list[dict[str, Any]], stages: Sequence[str], profiles: Sequence[str]
) -> list[dict[str, Any]]:
    rows = []
    for stage in stages:
        for profile in profiles:
            mine = [p for p in points if p["stage"] == stage and p["profile"] == profile]
            if not mine:
                continue
            side = {s: [p for p in mine if p["side"] == s] for s in ("before", "after")}
            rps = {s: statistics.median(p["rps"] for p in side[s]) for s in side}
            p99 = {s: statistics.median(p["p99_ms"] for p in side[s]) for s in side}
            by_round = {(p["side"], p["round"]): p["rps"] for p in mine}
            rounds = [
                _ratio(by_round["after", r], by_round["before", r])
                for r in sorted({p["round"] for p in mine})
            ]
            ratio = _ratio(rps["after"], rps["before"])
            rows.append({
                "stage": stage, "profile": profile, "before_rps": rps["before"], "after_rps": rps["after"],
                "ratio": ratio, "round_ratios": rounds, "before_p99_ms": p99["before"],
                "after_p99_ms": p99["after"],
                # a loss in every round, not a median dragged down by one noisy round
                "loses": bool(rounds) and all(r is not None and r < LOSS for r in rounds),
            })  # fmt: skip
    return rows


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def markdown(result: dict[str, Any]) -> str:
    rows = [
        (
            stage_label(r["stage"]), r["profile"], num(r["before_rps"], 0), num(r["after_rps"], 0),
            f"{r['ratio']:.2f}×" if r["ratio"] is not None else "–",
            ", ".join(f"{x:.2f}" for x in r["round_ratios"] if x is not None),
            num(r["before_p99_ms"], 0), num(r["after_p99_ms"], 0), "**yes**" if r["loses"] else "",
        )
        for r in result["summary"]
    ]  # fmt: skip
    headers = ["stage", "profile", "before req/s", "after req/s", "after / before", "each round",
               "before p99 ms", "after p99 ms", "loses > 5 % in every round"]  # fmt: skip
    losses = [r for r in result["summary"] if r["loses"]]
    p = result["parameters"]
    note = (
        f"Before: commit `{p['before'][:7]}`; after: commit `{str(result['stamp'].get('commit'))[:7]}`."
        f" Every stage and profile of `make compare`, {p['duration_s']:g} s a point, {p['rounds']} rounds"
        " taken in turns (A B, B A, ...), medians."
    )
    verdict = [
        f"{len(losses)} of {len(result['summary'])} points lose more than 5 % in every round"
        f" (after / before under {LOSS})"
        + (": " + "; ".join(f"{stage_label(r['stage'])} {r['profile']}" for r in losses) if losses else ".")
    ]
    return (
        page(
            result["stamp"],
            {"ratios": table(headers, rows, "llrrrlrrl"), "verdict": verdict},
            note,
        )
        + "\n"
    )


def headline(result: dict[str, Any]) -> dict[str, float]:
    return {
        f"{stage_label(r['stage'])} {r['profile']}: after / before": r["ratio"]
        for r in result["summary"]
        if r["ratio"] is not None and r["profile"] == "unique-32"
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", default=BEFORE, help=f"The commit to compare with (default {BEFORE}).")
    parser.add_argument("--stages", nargs="+", default=list(STAGES))
    parser.add_argument("--profiles", help="Comma-separated profile names (default: all of make compare's).")
    parser.add_argument("--duration", type=float, help="Seconds per point (default 6, quick 2).")
    parser.add_argument("--warmup", type=float, help="Seconds of warm-up per start (default 3, quick 1).")
    parser.add_argument("--rounds", type=int, help="Rounds, each commit once per stage (default 3, quick 1).")
    parser.add_argument("--out", type=Path, help="Folder for before_after.json and .md.")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.before_after", args, argv)
    args.duration = args.duration or (2.0 if args.quick else 6.0)
    args.warmup = args.warmup if args.warmup is not None else (1.0 if args.quick else 3.0)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.stop_timeout, args.host, args.port, args.seed = 10.0, "127.0.0.1", 0, 1
    args.raw = evidence.OUT / "before_after" / "raw"
    with worktree(args.before) as before:
        args.stages = _stages(before, args.stages)
        before_sha = _git("-C", str(before), "rev-parse", "HEAD")
        points = measure(args, before)
    names = [p.name for p in compare.select_profiles(args.profiles, None)]
    result = {
        "stamp": run.stamp(COMPARE_ENV, COMPARE_WITHOUT),
        "parameters": {
            "before": before_sha,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "rounds": args.rounds,
            "stages": args.stages,
            "profiles": names,
            "server_env": COMPARE_ENV,
        },
        "points": points,
        "summary": summarize(points, args.stages, names),
    }
    evidence.publish(run, args.out, "before_after", result, markdown, headline)


if __name__ == "__main__":
    main()
