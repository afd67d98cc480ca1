"""`make compare`: every server stage under the same Locust profiles, in one run, on one machine.

    python -m benchmarks.compare                    # 10 s per point, about 10 minutes (a quiet machine)
    python -m benchmarks.compare --quick            # a few seconds per point, about 4 minutes
    python -m benchmarks.compare --record           # the same, written to docs/results/ and docs/img/
    python -m benchmarks.compare --against 8f0f03d  # that commit's stages and this checkout's, in turns

For each stage that exists: start it with the command `make stageN` runs, warm it up, run every
profile in ``harness.PROFILES`` as one headless Locust process, stop it. Then measure the engine
alone on the same texts (the ceiling no server can beat without a cache). Absolute numbers
depend on the machine and on whatever else runs on it; ratios inside one run are the result.

``--against COMMIT`` (``make compare AGAINST=...``) answers another question: did a change make a
stage slower? Two runs of ``make compare`` an hour apart measure the machine's drift as much as
the change (on a shared 2-core machine the engine alone moved by a fifth between two such runs).
So each stage of the two commits runs the same profiles in turns: A B in the first round, B A in
the second, so that a drift hits both alike and neither always goes first. The other commit is
checked out into a git worktree under out/ (its own code, this venv and model); the load
generator is this checkout's. Per stage and profile: the median requests/s of each commit over
the rounds, the ratio after / before, and each round's ratio (their spread is the noise a single
ratio carries). A point is flagged when it loses more than 5 % in every round; a median under
0.95 that one round contradicts is the machine's noise.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from common import corpus
from common.engine import Engine
from common.serve import STAGES, available_stages, resolve
from common.settings import Settings
from loadtests import evidence, harness, load
from loadtests.evidence import save_figure
from loadtests.harness import COMPARE_ENV, COMPARE_WITHOUT, PROFILES, Profile
from loadtests.procs import free_port, running_stage
from loadtests.tables import num, page, stage_label, table

CEILING_SEED = 7
CEILING_BATCHES = (1, 2, 4, 8, 16, 32, 64)
# The last commit before the stage folders were re-laid out: what `make results` compares with.
AGAINST = "8f0f03d"
LOSS = 0.95  # after / before under this is a loss worth a look
STAGE_LABELS = {
    "stage1_naive": "1 naive",
    "stage2_threadpool": "2 thread pool",
    "stage3_batching": "3 batching",
    "stage4_cache_backpressure": "4 cache + backpressure",
    "stage5_metrics": "5 metrics",
}


# --8<-- [start:ceiling]
def engine_ceiling(kinds: Sequence[str], seconds: float, layouts: Sequence[int] = (1, 2)) -> dict[str, Any]:
    """Texts per second of the engine alone (tokenize + model + normalize), at its best.

    Best over batch sizes and over layouts: one call at a time with the cores' threads, or
    ``n`` calls side by side from ``n`` threads with the cores shared out among them (what
    stage 2's WORKER_THREADS and the batcher's BATCH_CONCURRENCY do). On 2 cores two
    one-thread calls beat one two-thread call, so a ceiling that tried only one call at a
    time would be one the servers can pass.
    """
    out: dict[str, Any] = {}
    for kind in kinds:
        texts = corpus.texts(2048, seed=CEILING_SEED, kind=kind)
        by_layout: dict[str, dict[str, float]] = {}
        for calls in layouts:
            engine = Engine.from_settings(Settings(), calls_at_once=calls)  # the servers' threads
            engine.warmup()
            by_layout[str(calls)] = {
                str(batch): _texts_per_s(engine, texts, batch, calls, seconds) for batch in CEILING_BATCHES
            }
        best_calls, best_batch = max(
            ((c, b) for c, rates in by_layout.items() for b in rates), key=lambda cb: by_layout[cb[0]][cb[1]]
        )
        out[kind] = {
            "texts_per_s": by_layout[best_calls][best_batch],
            "best_batch": int(best_batch),
            "best_calls_at_once": int(best_calls),
            "by_batch": by_layout[best_calls],
            "by_layout": by_layout,
        }
    return out


def _texts_per_s(engine: Engine, texts: list[str], batch: int, calls: int, seconds: float) -> float:
    """``calls`` threads embedding batches of ``batch`` texts for ``seconds``; texts per second."""
    done = [0] * calls

    def work(worker: int) -> None:
        i = worker * batch
        while time.perf_counter() < end or done[worker] == 0:
            start_at = i % len(texts)
            chunk = texts[start_at : start_at + batch] if start_at + batch <= len(texts) else texts[:batch]
            engine.embed(chunk)
            done[worker] += len(chunk)
            i += calls * batch

    start = time.perf_counter()
    end = start + seconds
    threads = [threading.Thread(target=work, args=(w,)) for w in range(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - start)


# --8<-- [end:ceiling]


def select_profiles(names: str | None, users: str | None) -> list[Profile]:
    chosen = list(PROFILES)
    if names:
        wanted = {n.strip() for n in names.split(",")}
        unknown = wanted - {p.name for p in PROFILES}
        if unknown:
            raise SystemExit(f"unknown profile(s) {sorted(unknown)}; known: {[p.name for p in PROFILES]}")
        chosen = [p for p in chosen if p.name in wanted]
    if users:
        # Fewer unique-text points (the test suite): keep the other profiles whole.
        keep = {int(u) for u in users.split(",")}
        chosen = [p for p in chosen if p.user_class != "UniqueTextUser" or p.users in keep]
    return chosen


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--against",
        metavar="COMMIT",
        help=f"Another commit's stages and these, in turns ({AGAINST}: the layout).",
    )
    parser.add_argument("--rounds", type=int, help="With --against: rounds, each commit once (2, quick 1).")
    parser.add_argument(
        "--duration", type=float, help="Seconds per point (10, quick 3; --against 6, quick 2)."
    )
    parser.add_argument(
        "--warmup", type=float, help="Seconds of warm-up per stage (5, quick 1; --against 3)."
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        help="Seconds Locust waits for requests in flight (30, quick 10; --against 10).",
    )
    parser.add_argument("--ceiling-seconds", type=float, help="Seconds per batch size for the ceiling.")
    parser.add_argument("--stages", help="Comma-separated stages (default: every stage that exists).")
    parser.add_argument("--profiles", help="Comma-separated profile names (default: all).")
    parser.add_argument("--users", help="Keep only these user counts of the unique-text profile, e.g. 8,32.")
    parser.add_argument(
        "--endpoint", choices=("/v1/embed", "/v1/embeddings"), default="/v1/embed", help="Route to load."
    )
    parser.add_argument("--seed", type=int, default=1, help="Base seed of the texts.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="Port for the servers (0: a free one).")
    parser.add_argument("--out", type=Path, help="Folder for compare.json and .md.")
    parser.add_argument("--img", type=Path, help="Folder for the PNGs (out/img, or docs/img with --record).")
    parser.add_argument(
        "--raw",
        type=Path,
        default=evidence.OUT / "compare",
        help="Locust's CSV/JSON and the server logs (git-ignored).",
    )
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    # The defaults the committed compare.json was measured with; --against has twice the points
    # (and every round again), so shorter ones: its question is a ratio, not a curve.
    long, quick = (
        ((6.0, 3.0, 10.0), (2.0, 1.0, 10.0)) if args.against else ((10.0, 5.0, 30.0), (3.0, 1.0, 10.0))
    )
    duration, warmup, stop_timeout = quick if args.quick else long
    args.duration = args.duration or duration
    args.warmup = args.warmup if args.warmup is not None else warmup
    args.stop_timeout = args.stop_timeout if args.stop_timeout is not None else stop_timeout
    # Two rounds is the fewest in which each commit goes first once.
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.ceiling_seconds = args.ceiling_seconds or (0.5 if args.quick else 3.0)
    return args


def run_stage(
    stage: str, profiles: list[Profile], args: argparse.Namespace, tree: Path = evidence.REPO, label: str = ""
) -> list[dict[str, Any]]:
    """Start ``stage`` (from the checkout ``tree``), warm it up, run every profile, stop it."""
    port = args.port or free_port()
    url = f"http://{args.host}:{port}"
    raw = args.raw / (f"{label}-{stage}" if label else stage)
    results = []
    t0 = time.monotonic()
    with running_stage(
        stage, raw, COMPARE_ENV, without=COMPARE_WITHOUT, port=port, host=args.host, tree=tree
    ) as server:
        print(f"{stage}: ready in {time.monotonic() - t0:.1f} s on {url}", flush=True)
        answered = harness.warm_up(url, args.warmup)
        print(f"{stage}: warm-up answered {answered} requests in {args.warmup:g} s", flush=True)
        for profile in profiles:
            settled = load.settle(server.pid, url)
            # The same seed for the same profile in every stage: each stage gets the same texts.
            point = harness.run_point(
                stage,
                url,
                profile,
                args.duration,
                raw / profile.name,
                args.seed * 100 + [p.name for p in PROFILES].index(profile.name),
                server.pid,
                args.stop_timeout,
            )
            point.extra["settle_s"] = round(settled, 2)
            results.append(point.as_dict())
            fails = point.failures
            print(
                f"{stage:>26} {profile.name:>13}: {point.rps:8.1f} req/s  p50 {point.p50_ms:7.0f} ms"
                f"  p99 {point.p99_ms:7.0f} ms  503 {fails['503']:5d}  other {fails['other']:4d}"
                f"  cores: server {point.server_cores:.2f} locust {point.loadgen_cores:.2f}"
                f" other {point.other_cores:.2f}",
                flush=True,
            )
    return results


# --- the report: compare.md and its two pictures -------------------------------------


def add_ratios(
    points: list[dict[str, Any]], profiles: Sequence[Profile], ceiling: dict[str, Any]
) -> list[dict[str, Any]]:
    """Per point: throughput over the previous stage's (same profile), and over the engine ceiling."""
    by_profile = {p.name: p for p in profiles}
    previous: dict[str, dict[str, Any]] = {}
    for point in points:  # in stage order
        profile = by_profile[point["profile"]]
        before = previous.get(point["profile"])
        point["ratio_to_previous"] = point["rps"] / before["rps"] if before and before["rps"] > 0 else None
        point["previous_stage"] = before["stage"] if before else None
        limit = ceiling[profile.text_kind]["texts_per_s"]
        point["ceiling_rps"] = limit / profile.texts_per_request
        point["fraction_of_ceiling"] = point["rps"] / point["ceiling_rps"] if limit > 0 else None
        previous[point["profile"]] = point
    return points


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def markdown(result: dict[str, Any]) -> str:
    """compare.md: the machine, the engine ceiling, one table per profile, the load generator's share."""
    params = result["parameters"]
    note = (
        f"{params['duration_s']:g} s per point after {params['warmup_s']:g} s of warm-up per stage;"
        " every stage with the same texts."
    )
    if result["skipped_stages"]:
        note += f" Skipped (not in this checkout): {', '.join(result['skipped_stages'])}."
    for stage, error in result.get("failed_stages", {}).items():
        note += f"\n\n**{stage} failed** and has no figures: {error}"
    sections: dict[str, list[str]] = {}
    sections["ceiling"] = table(
        ["texts", "engine alone, texts/s", "best batch", "calls side by side"],
        [
            (kind, num(c["texts_per_s"]), c["best_batch"], c.get("best_calls_at_once", 1))
            for kind, c in result["engine_ceiling"].items()
        ],
    )
    for profile in result["profiles"]:
        rows = [p for p in result["points"] if p["profile"] == profile["name"]]
        if not rows:
            continue
        extra = " ".join(profile["options"])
        sections[profile["name"]] = [
            f"`{profile['user_class']}`, {_n(profile['users'], 'user')},"
            f" {_n(profile['texts_per_request'], 'text')} per request,"
            f" {profile['text_kind']} texts{', ' + extra if extra else ''}.",
            "",
            *table(
                ["stage", "req/s", "p50 ms", "p99 ms", "failed: 503 / other", "× previous", "of ceiling",
                 "cores: server / Locust / other"],
                [
                    (STAGE_LABELS.get(p["stage"], p["stage"]), num(p["rps"]), num(p["p50_ms"], 0),
                     num(p["p99_ms"], 0), f"{p['failures']['503']} / {p['failures']['other']}",
                     num(p["ratio_to_previous"], 2, "×"), num(_pct(p["fraction_of_ceiling"]), 0, "%"),
                     f"{p['server_cores']:.2f} / {p['loadgen_cores']:.2f} / {p['other_cores']:.2f}")
                    for p in rows
                ],
            ),
        ]  # fmt: skip
    points = result["points"]
    if points:
        loadgen = [p["loadgen_cores"] for p in points]
        other = [p["other_cores"] for p in points]
        sections["loadgen"] = [
            f"The load generator (one Locust process) used {min(loadgen):.2f} to {max(loadgen):.2f}"
            f" cores per point (mean {sum(loadgen) / len(loadgen):.2f}); everything else on the"
            f" machine used {min(other):.2f} to {max(other):.2f} cores in the same windows.",
        ]
    return page(result["stamp"], sections, note)


def _pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


def plots(result: dict[str, Any], folder: Path) -> list[Path]:
    """Throughput and p99 per stage: unique texts by user count (left), the other profiles (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    stages = result["stages"]
    unique = [p for p in result["profiles"] if p["user_class"] == "UniqueTextUser"]
    others = [p["name"] for p in result["profiles"] if p["user_class"] != "UniqueTextUser"]
    written = []
    for key, label, name, log in (
        ("rps", "requests/s", "compare_throughput.png", False),
        ("p99_ms", "p99 latency (ms)", "compare_p99.png", True),
    ):
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=(1, 1.3))
        for stage in stages:
            xs = [p["users"] for p in unique]
            ys = [
                next((q[key] for q in points if q["stage"] == stage and q["profile"] == p["name"]), None)
                for p in unique
            ]
            pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
            if pairs:
                left.plot(*zip(*pairs, strict=True), marker="o", label=STAGE_LABELS.get(stage, stage))
        left.set_xscale("log", base=2)
        left.set_xticks([p["users"] for p in unique], [str(p["users"]) for p in unique])
        left.minorticks_off()
        left.set_xlabel("concurrent users (unique texts)")
        left.set_ylabel(label)
        if log:
            left.set_yscale("log")
        left.grid(alpha=0.3)
        width = 0.8 / max(len(stages), 1)
        for i, stage in enumerate(stages):
            ys = [
                next((q[key] for q in points if q["stage"] == stage and q["profile"] == n), 0.0)
                for n in others
            ]
            right.bar(
                [j + i * width for j in range(len(others))], ys, width, label=STAGE_LABELS.get(stage, stage)
            )
        right.set_xticks([j + 0.4 - width / 2 for j in range(len(others))], others, fontsize=8)
        right.set_ylabel(label)
        if log:
            right.set_yscale("log")
        right.grid(alpha=0.3, axis="y")
        for ax in (left, right):  # one legend, on the first panel that has anything in it
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
                break
        stamp = result["stamp"]
        tag = " (QUICK run)" if stamp.get("quick") else ""
        fig.suptitle(
            f"{label} per stage, {stamp['machine']['cpu_model']}, {stamp['date'][:10]}{tag}", fontsize=10
        )
        fig.tight_layout()
        written.append(save_figure(fig, folder / name, stamp))
        plt.close(fig)
    return written


# --- --against: two commits in turns (before_after.json) -------------------------------


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=evidence.REPO, capture_output=True, text=True, check=True)
    return done.stdout.strip()


@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """``rev`` checked out beside this repository (under out/), with this checkout's model."""
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = evidence.OUT / "against" / sha[:12]
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


def in_turns(args: argparse.Namespace, profiles: list[Profile], before: Path) -> list[dict[str, Any]]:
    trees = {"before": before, "after": evidence.REPO}
    points: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
        for stage in args.stages:
            for side in order:
                print(f"round {round_ + 1}/{args.rounds}: {stage}, {side}", flush=True)
                for point in run_stage(stage, profiles, args, trees[side], label=side):
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


def against_markdown(result: dict[str, Any]) -> str:
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


def against(
    args: argparse.Namespace, run: evidence.Run, profiles: list[Profile], wanted: Sequence[str]
) -> dict[str, Any]:
    """``args.against``'s stages and this checkout's, in turns: before_after.json and .md."""
    args.raw = args.raw / "against"
    with worktree(args.against) as before:
        args.stages = stages = _stages(before, wanted)
        before_sha = _git("-C", str(before), "rev-parse", "HEAD")
        points = in_turns(args, profiles, before)
    names = [p.name for p in profiles]
    result = {
        "stamp": run.stamp(COMPARE_ENV, COMPARE_WITHOUT),
        "parameters": {
            "before": before_sha,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "rounds": args.rounds,
            "stages": stages,
            "profiles": names,
            "server_env": COMPARE_ENV,
        },
        "points": points,
        "summary": summarize(points, stages, names),
    }
    evidence.publish(run, "before_after", result, against_markdown, args.out)
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    run = evidence.start("benchmarks.compare", args, argv)
    profiles = select_profiles(args.profiles, args.users)
    if args.endpoint != "/v1/embed":
        profiles = [replace(p, options=(*p.options, "--endpoint", args.endpoint)) for p in profiles]
    wanted = [resolve(s.strip()) for s in args.stages.split(",")] if args.stages else list(STAGES)
    if args.against:
        return against(args, run, profiles, wanted)
    present = set(available_stages())
    stages = [s for s in wanted if s in present]
    skipped = [s for s in wanted if s not in present]
    for s in skipped:
        print(f"{s}: skipped, it does not exist in this checkout yet", flush=True)

    points: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    for stage in stages:
        try:
            points += run_stage(stage, profiles, args)
        except (RuntimeError, OSError, subprocess.SubprocessError, psutil.Error) as exc:
            # One broken stage must not cost the other stages' results of a long run.
            failed[stage] = f"{type(exc).__name__}: {exc}"
            print(f"{stage}: FAILED, {failed[stage]} (logs in {args.raw / stage})", flush=True)
    print("engine ceiling: measuring the engine alone ...", flush=True)
    ceiling = engine_ceiling(sorted({p.text_kind for p in profiles}), args.ceiling_seconds)
    for kind, c in ceiling.items():
        print(
            f"engine ceiling ({kind}): {c['texts_per_s']:.1f} texts/s at batch {c['best_batch']}, "
            f"{c['best_calls_at_once']} call(s) at once",
            flush=True,
        )

    result = {
        "stamp": run.stamp(COMPARE_ENV, COMPARE_WITHOUT),
        "parameters": {
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "stop_timeout_s": args.stop_timeout,
            "server_env": COMPARE_ENV,
            "server_env_removed": list(COMPARE_WITHOUT),
            "seed": args.seed,
            "ceiling_seconds_per_batch": args.ceiling_seconds,
        },
        "stages": stages,
        "skipped_stages": skipped,
        "failed_stages": failed,
        "profiles": [{**vars(p), "options": list(p.options)} for p in profiles],
        "engine_ceiling": ceiling,
        "points": add_ratios(points, profiles, ceiling),
    }
    out, img = args.out or run.results_dir, args.img or run.img_dir
    written = [
        evidence.write_json(out / "compare.json", result),
        evidence.write_text(out / "compare.md", markdown(result)),
        *plots(result, img),
    ]
    print("wrote " + ", ".join(str(p) for p in written), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(1 if main().get("failed_stages") else 0)
