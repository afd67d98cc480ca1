"""`make compare`: every server stage under the same Locust profiles, in one run, on one machine.

    python -m benchmarks.compare            # full: 20 s per point, about 45 minutes (a quiet machine)
    python -m benchmarks.compare --quick    # a few seconds per point, about 6 minutes
    python -m benchmarks.compare --record   # the same, written to docs/results/ and docs/img/

For each stage that exists: start it with the command `make stageN` runs, warm it up, run every
profile in ``harness.PROFILES`` as one headless Locust process, stop it. Then measure the engine
alone on the same texts (the ceiling no server can beat without a cache). Absolute numbers
depend on the machine and on whatever else runs on it; ratios inside one run are the result.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from benchmarks import compare_report as report
from common.engine import Engine
from common.serve import STAGES, available_stages, resolve
from common.settings import Settings
from loadtests import evidence, harness
from loadtests.harness import COMPARE_ENV, COMPARE_WITHOUT, PROFILES, Profile
from loadtests.procs import free_port, running_stage
from stage0_script import corpus

CEILING_SEED = 7
CEILING_BATCHES = (1, 2, 4, 8, 16, 32, 64)


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
    parser.add_argument("--duration", type=float, help="Seconds per point (default 20, quick 3).")
    parser.add_argument("--warmup", type=float, help="Seconds of warm-up per stage (default 10, quick 1).")
    parser.add_argument(
        "--stop-timeout",
        type=float,
        help="Seconds Locust waits for requests in flight (default 30, quick 10).",
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
    args.duration = args.duration or (3.0 if args.quick else 20.0)
    args.warmup = args.warmup if args.warmup is not None else (1.0 if args.quick else 10.0)
    args.stop_timeout = args.stop_timeout if args.stop_timeout is not None else (10.0 if args.quick else 30.0)
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
            settled = harness.settle(server.pid, url)
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


def headline(result: dict[str, Any]) -> dict[str, float]:
    """The figures a reader's run is compared with: unique-32 per stage, and the engine alone."""
    out = {f"{p['stage']} unique-32 req/s": p["rps"] for p in result["points"] if p["profile"] == "unique-32"}
    out["engine alone, sentences, texts/s"] = result["engine_ceiling"]["sentence"]["texts_per_s"]
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    run = evidence.start("benchmarks.compare", args, argv)
    wanted = [resolve(s.strip()) for s in args.stages.split(",")] if args.stages else list(STAGES)
    present = set(available_stages())
    stages = [s for s in wanted if s in present]
    skipped = [s for s in wanted if s not in present]
    for s in skipped:
        print(f"{s}: skipped, it does not exist in this checkout yet", flush=True)
    profiles = select_profiles(args.profiles, args.users)
    if args.endpoint != "/v1/embed":
        profiles = [replace(p, options=(*p.options, "--endpoint", args.endpoint)) for p in profiles]

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
        "points": report.add_ratios(points, profiles, ceiling),
    }
    out, img = args.out or run.results_dir, args.img or run.img_dir
    written = [
        evidence.write_json(out / "compare.json", result),
        evidence.write_text(out / "compare.md", report.markdown(result)),
        *report.plots(result, img),
    ]
    print("wrote " + ", ".join(str(p) for p in written), flush=True)
    evidence.against_reference(run, "compare.json", result, headline)
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["failed_stages"] else 0)
