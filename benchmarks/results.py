"""`make results`: every results file, table and picture the docs include, regenerated in one go.

    python -m benchmarks.results                  # the full pipeline into docs/ (a clean tree)
    python -m benchmarks.results --quick          # the same steps, briefly, into out/
    python -m benchmarks.results --quick --record # ... into docs/ (a check, not evidence: QUICK is stamped)
    python -m benchmarks.results --only stage3,compare     # some steps, into out/ (make results ONLY=...)
    python -m benchmarks.results --from compare            # this step and the ones after it
    python -m benchmarks.results --render         # no measuring: rewrite every .md and plot from its JSON
    python -m benchmarks.results --list           # the steps, in order, with their estimates

Make is the front door and this is the one runner behind it: each step is one command of its own
(``python -m benchmarks.stage3 ...``), run as a subprocess with ``--quick``, ``--record`` and
``--allow-dirty`` passed on; a progress line per step and the total at the end. A full run records
by default (``--only`` writes out/ unless ``--record``); recording refuses a tree with
uncommitted changes (the results folders aside) unless ``--allow-dirty``. A step's time is in the
stamp of the file it writes (``wall_s``), so the timing table, pipeline.md, is drawn from the
results themselves beside each step's estimate.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtests import evidence, tables


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    module: str
    writes: tuple[str, ...]  # the results files (in docs/results/) it writes
    minutes: float  # the estimate of a full run on 2 cores from the step's defaults (the comment says how)
    quick_minutes: float
    stamped: bool = True  # takes --quick / --record / --allow-dirty; else --out <file> unless recording
    args: tuple[str, ...] = ()  # passed on before the others


# The order: each chapter's experiment from stage 0 (the model's build) on, then the
# whole-system runs, then what is generated from code. A failed step is reported; the rest still run.
STEPS: tuple[Step, ...] = (
    # the build's facts; 4 files and 8 static recipes scored on the gate sentences and the 1500 STS-B
    # dev pairs, timed on one thread in 2 rounds; 4 files x 7 batch sizes x 0.5 s of wall clock
    # (4.0 min beside a few neighbours, 288 CPU-seconds)
    Step(
        "stage0",
        "stage 0: the build, fp32 and three INT8 files, the quantization study",
        "benchmarks.stage0",
        ("stage0.json",),
        4,
        1,
    ),
    # pytest-benchmark's own rounds, about 30 benchmarks (15 s last run)
    Step("bench", "microbenchmarks (pytest-benchmark)", "benchmarks.micro", ("bench.json",), 0.5, 0.3),
    Step(
        "stage2-threads",
        "stage 2: thread settings",
        "benchmarks.stage2_threads",
        ("stage2_threads.json",),
        6.7,
        1.5,
    ),
    Step(
        "stage3",
        "stage 3: batching sweeps, windows by load",
        "benchmarks.stage3",
        ("stage3_sweep.json",),
        15,
        4,
    ),
    Step(
        "stage3-refinements",
        "stage 3: what each refinement changes (no HTTP)",
        "benchmarks.stage3_refinements",
        ("stage3_refinements.json",),
        0.2,
        0.2,
    ),
    Step(
        "stage4",
        "stage 4: cache tiers, repeats, overload, a flood",
        "benchmarks.stage4",
        ("stage4.json",),
        5,
        2,
    ),
    # 9 servers x (warm-up, 60 requests in turn, 120 from 8 clients), Redis plain and TLS, near and far
    Step(
        "cache-distance",
        "stage 4: a Redis tier at a distance, per-command and pooled",
        "benchmarks.cache_distance",
        ("cache_distance.json",),
        3,
        1.5,
    ),
    # 60 s of traffic, a server and a browser
    Step(
        "dashboard",
        "stage 5: the dashboard after a minute of traffic",
        "benchmarks.stage5_screenshot",
        ("dashboard.json",),
        1.5,
        0.6,
    ),
    Step(
        "layers", "what a layer costs: stages 1 to 5 in turns", "benchmarks.layers", ("layers.json",), 12, 2
    ),
    Step(
        "compare",
        "every stage under the same Locust profiles",
        "benchmarks.compare",
        ("compare.json",),
        10,
        4,
    ),
    # 2 stages x 3 profiles x 2 commits x 2 rounds x (6 s + about 2 s), and the servers' start-ups
    Step(
        "before-after",
        "stages 4 and 5 before the Redis write went behind the answer, and now, in turns",
        "benchmarks.compare",
        ("before_after.json",),
        4,
        2,
        args=(
            "--against",
            "f39c08d",
            "--stages",
            "stage4_cache_backpressure,stage5_metrics",
            "--profiles",
            "unique-1,unique-32,repeated-32",
        ),
    ),
    Step(
        "cost-model",
        "the cost model's constants, its prediction beside layers and compare",
        "benchmarks.cost_model",
        ("cost_model.json",),
        2,
        0.5,
    ),
    # 19 commands, most against a server started fresh for each, a few seconds each
    Step(
        "docs-outputs",
        "what the chapters' commands print, against fresh servers",
        "benchmarks.docs_outputs",
        ("outputs.json",),
        2,
        2,
    ),
    # one server, Locust's UI under load, 3 pictures (41 s last run)
    Step("screenshots", "Locust's web UI, pictures", "loadtests.ui_screenshot", ("locust_ui.json",), 1, 0.7),
    # the bad-input catalogue, the fuzzer and the faults against every stage (1.8 min last run)
    Step(
        "reliability",
        "hostile input and faults, counted",
        "benchmarks.reliability.reliability",
        ("reliability.json",),
        2,
        1.5,
    ),
    # 600 s of soak (the chapter's ten minutes) after 3 x 4 s of capacity and the warm-up
    Step("soak", "stage 5 with Redis for 10 minutes", "benchmarks.reliability.soak", ("soak.json",), 11, 1.5),
    # plain stage 5, the cluster with 1 and 2 replicas: capacity and a flood, 15 s a point (3.8 min)
    Step(
        "beyond",
        "stage 5 on the Ray cluster against plain stage 5 (the [cluster] extra)",
        "benchmarks.beyond",
        ("beyond.json",),
        4,
        3,
    ),
    Step(
        "settings",
        "settings table (from the code)",
        "benchmarks.settings_doc",
        ("settings.md",),
        0.1,
        0.1,
        stamped=False,
    ),
    Step(
        "metrics",
        "metrics reference (from the code)",
        "benchmarks.metrics_reference",
        ("stage5_metrics.md",),
        0.1,
        0.1,
        stamped=False,
    ),
)


@dataclass(frozen=True)
class Page:
    """A results JSON, the Markdown page rendered from it, and the pictures drawn from it."""

    json: str
    markdown: str
    render: str  # "module:function", taking the parsed JSON and returning the page
    draw: str | None = None  # "module:function", taking (JSON, img folder) and writing the pictures
    images: tuple[str, ...] = ()


PAGES: tuple[Page, ...] = (
    Page(
        "stage0.json",
        "stage0.md",
        "benchmarks.stage0:markdown",
        "benchmarks.stage0:draw",
        ("quantization.png",),
    ),
    Page("bench.json", "bench.md", "benchmarks.micro.__main__:markdown"),
    Page(
        "stage2_threads.json",
        "stage2_threads.md",
        "benchmarks.stage2_threads:markdown",
        "benchmarks.results:_draw_stage2_threads",
        ("stage2_threads.png",),
    ),
    Page(
        "stage3_sweep.json",
        "stage3.md",
        "benchmarks.stage3:markdown",
        "benchmarks.results:_draw_stage3",
        ("stage3_sweep.png",),
    ),
    Page("stage4.json", "stage4.md", "benchmarks.stage4:markdown"),
    Page("cache_distance.json", "cache_distance.md", "benchmarks.cache_distance:markdown"),
    Page(
        "compare.json",
        "compare.md",
        "benchmarks.compare:markdown",
        "benchmarks.compare:plots",
        ("compare_throughput.png", "compare_p99.png"),
    ),
    Page(
        "locust_ui.json",
        "locust_ui.md",
        "loadtests.ui_screenshot:caption_page",
        images=("locust_start.png", "locust_charts.png", "locust_statistics.png"),
    ),
    Page("reliability.json", "reliability.md", "benchmarks.reliability.reliability:markdown"),
    Page(
        "soak.json",
        "soak.md",
        "benchmarks.reliability.soak:markdown",
        "benchmarks.results:_draw_soak",
        ("soak.png",),
    ),
    Page("stage3_refinements.json", "stage3_refinements.md", "benchmarks.stage3_refinements:markdown"),
    Page(
        "dashboard.json",
        "dashboard.md",
        "benchmarks.stage5_screenshot:caption_page",
        images=("dashboard.png",),
    ),
    Page("layers.json", "layers.md", "benchmarks.layers:markdown"),
    Page("cost_model.json", "cost_model.md", "benchmarks.cost_model:markdown"),
    Page("before_after.json", "before_after.md", "benchmarks.compare:against_markdown"),
    Page("outputs.json", "outputs.md", "benchmarks.docs_outputs:markdown"),  # and outputs/<name>.txt
    Page("beyond.json", "beyond.md", "benchmarks.beyond:markdown"),
)
# Generated from the code (and, for pipeline.md, the stamps of the other files), not measured:
# checked by content (tests/), not stamped, since a commit stamp would make them differ from the
# code's rendering at every commit.
FROM_CODE = ("settings.md", "stage5_metrics.md", "pipeline.md")


def _function(ref: str) -> Callable[..., Any]:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def _draw_stage2_threads(result: dict[str, Any], img: Path) -> None:
    _function("benchmarks.stage2_threads:plot")(result, img / "stage2_threads.png")


def _draw_stage3(result: dict[str, Any], img: Path) -> None:
    _function("benchmarks.stage3:plot")(result, img / "stage3_sweep.png")


def _draw_soak(result: dict[str, Any], img: Path) -> None:
    _function("benchmarks.reliability.soak:plot")(result, img / "soak.png")


def render_page(page: Page, results: Path) -> str:
    """The Markdown ``page`` renders from its JSON in ``results``."""
    return str(_function(page.render)(json.loads((results / page.json).read_text())))


def render(results: Path = evidence.RESULTS, img: Path = evidence.IMG, pictures: bool = True) -> list[Path]:
    """Rewrite every page (and, with ``pictures``, every plot) from the JSON beside it."""
    written = []
    for page in PAGES:
        if not (results / page.json).is_file():
            continue
        written.append(evidence.write_text(results / page.markdown, render_page(page, results)))
        if pictures and page.draw:
            _function(page.draw)(json.loads((results / page.json).read_text()), img)
            written += [img / name for name in page.images]
    written.append(evidence.write_text(results / "pipeline.md", markdown(results)))
    return written


# --- the pipeline ------------------------------------------------------------------------
def command(step: Step, quick: bool, record: bool, allow_dirty: bool) -> list[str]:
    args = [sys.executable, "-m", step.module, *step.args]
    if step.stamped:
        args += [*(["--quick"] if quick else []), *(["--record"] if record else [])]
        args += ["--allow-dirty"] if allow_dirty else []
    elif not record:  # the generators write docs/results/ unless told otherwise
        args += [
            "--out",
            str(
                evidence.OUT / "results" / ("settings.md" if step.name == "settings" else "stage5_metrics.md")
            ),
        ]
    return args


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _took(step: Step, results: Path) -> str:
    """How long the run that wrote the step's first file took, from that file's stamp."""
    path = results / step.writes[0]
    if path.suffix != ".json" or not path.is_file():
        return "–"
    stamp = json.loads(path.read_text()).get("stamp") or {}
    return _minutes(stamp["wall_s"]) if "wall_s" in stamp else "–"


def markdown(results: Path = evidence.RESULTS) -> str:
    """pipeline.md: every step, its estimate from today's defaults, and how long its last recorded
    run took (the stamp of the file it wrote). Not stamped itself: it is rebuilt from the others."""
    rows = [
        (s.name, s.what, f"`{' '.join(['python', *command(s, False, True, False)[1:]])}`",
         _minutes(s.minutes * 60), _took(s, results))
        for s in STEPS
    ]  # fmt: skip
    total = sum(s.minutes for s in STEPS)
    quick = sum(s.quick_minutes for s in STEPS)
    lines = [
        "<!-- generated by `python -m benchmarks.results --render` from its steps and the stamps of"
        " docs/results/; do not edit -->",
        "",
        *tables.section(
            "steps",
            [
                *tables.table(["step", "what", "command", "estimate", "last recorded run"], rows, "lllrr"),
                "",
                f"Estimated in all: {_minutes(total * 60)} (`QUICK=1`: {_minutes(quick * 60)}). An estimate"
                " counts a step's points, seconds and rounds at its defaults; the last column is the"
                " time its results file records, whatever defaults it ran with then.",
            ],
        ),
    ]
    return "\n".join(lines)


def pipeline(steps: Sequence[Step], run: evidence.Run) -> int:
    quick, record, allow_dirty = run.quick, run.record, run.allow_dirty
    expected = sum(s.quick_minutes if quick else s.minutes for s in steps)
    where = "docs/results/ and docs/img/" if record else "out/results/ and out/img/"
    print(
        f"make results: {len(steps)} steps, {'QUICK' if quick else 'full'}, about {expected:.0f} min,"
        f" into {where}",
        flush=True,
    )
    started = time.monotonic()
    failed: list[str] = []
    for n, step in enumerate(steps, 1):
        print(f"[{n}/{len(steps)}] {step.name}: {step.what} ...", flush=True)
        t0 = time.monotonic()
        args = command(step, quick, record, allow_dirty)
        done = subprocess.run(args, cwd=evidence.REPO)
        seconds = time.monotonic() - t0
        if done.returncode != 0:
            # The steps are independent: a failed one (a crash, or a soak that failed its verdict,
            # whose results are written all the same) must not cost the others of a long run.
            failed.append(step.name)
            print(
                f"[{n}/{len(steps)}] {step.name}: FAILED (exit {done.returncode}) after {_minutes(seconds)}",
                flush=True,
            )
            continue
        print(f"[{n}/{len(steps)}] {step.name}: done in {_minutes(seconds)}", flush=True)
    total = _minutes(time.monotonic() - started)
    print(f"make results: {len(steps) - len(failed)} of {len(steps)} steps done in {total}", flush=True)
    if record and len(failed) < len(steps):
        print(f"wrote {evidence.write_text(evidence.RESULTS / 'pipeline.md', markdown())}", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}; run them again with --only {','.join(failed)}", flush=True)
        return 1
    return 0


def select(only: str | None, start: str | None) -> list[Step]:
    names = [s.name for s in STEPS]
    chosen = list(STEPS)
    if only:
        wanted = [n.strip() for n in only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise SystemExit(f"unknown step(s) {unknown}; the steps: {', '.join(names)}")
        chosen = [s for s in chosen if s.name in wanted]
    if start:
        if start not in names:
            raise SystemExit(f"unknown step {start!r}; the steps: {', '.join(names)}")
        chosen = [s for s in chosen if names.index(s.name) >= names.index(start)]
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    evidence.add_arguments(parser)
    parser.add_argument("--only", help="comma-separated step names")
    parser.add_argument("--from", dest="start", help="start at this step (after a failure)")
    parser.add_argument("--render", action="store_true", help="rewrite pages and plots from the JSON only")
    parser.add_argument("--list", action="store_true", help="print the steps and stop")
    args = parser.parse_args(argv)
    if args.list:
        for s in STEPS:
            print(f"{s.name:20s} {s.what} (~{s.minutes:g} min, QUICK ~{s.quick_minutes:g} min)")
        return 0
    if args.render:
        for path in render():
            print(f"wrote {path}")
        return 0
    # The whole pipeline is what the docs show; one step (a reader trying a chapter's) writes out/.
    record = args.record or not (args.quick or args.only)
    # Refuse a dirty tree here, before hours of measuring, not at the first step that records.
    options = argparse.Namespace(record=record, allow_dirty=args.allow_dirty, quick=args.quick)
    run = evidence.start("benchmarks.results", options, argv)
    return pipeline(select(args.only, args.start), run)


if __name__ == "__main__":
    sys.exit(main())
