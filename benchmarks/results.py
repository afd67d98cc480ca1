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


# The order: the model's facts, then each chapter's experiment from stage 0 on, then the
# whole-system runs, then what is generated from code. A failed step is reported; the rest still run.
STEPS: tuple[Step, ...] = (
    Step("model", "model build facts", "benchmarks.model_facts", ("model.json",), 0.1, 0.1),
    # each model variant loaded and timed, 2 s a measurement (45 s last run)
    Step("stage0", "stage 0: fp32 and INT8 baseline", "benchmarks.stage0", ("stage0.json",), 1, 0.3),
    # every recipe of the study calibrated, scored on the STS dev pairs and timed (6.0 min last run)
    Step(
        "quantization",
        "stage 0: quantization study",
        "benchmarks.quantization",
        ("quantization.json",),
        6,
        3,
    ),
    # pytest-benchmark's own rounds, 16 benchmarks (15 s last run)
    Step("bench", "microbenchmarks (pytest-benchmark)", "benchmarks.micro", ("bench.json",), 0.5, 0.3),
    # 5 servers starting at once (20 s), then 3 rounds x 5 layouts x 2 loads x (3 s + about 0.7 s to settle)
    Step(
        "stage2-threads",
        "stage 2: thread settings",
        "benchmarks.stage2_threads",
        ("stage2_threads.json",),
        2.5,
        1,
    ),
    # the engine alone (14 x 1 s), the batcher alone (3 rounds x 11 bursts, 40 s), 6 servers starting
    # at once (25 s), then 2 rounds x 17 points x (3 s + about 0.7 s to settle)
    Step(
        "stage3",
        "stage 3: targets, windows by load, each refinement",
        "benchmarks.stage3",
        ("stage3.json",),
        4,
        2,
    ),
    # 19 servers; a Redis plain and TLS, near and 30 ms away (9 servers x 40 requests in turn and 80
    # from 8 clients), 2 x 400 requests from 32 clients, the seed's workloads, 7 flood points of 8 s
    # (2.6 min in a full run into out/ on a shared machine)
    Step(
        "stage4",
        "stage 4: Redis at a distance, the lookup's bound, repeats, overload, a flood",
        "benchmarks.stage4",
        ("stage4.json",),
        3,
        1.5,
    ),
    # 5 stages x 6 profiles x 3 rounds x (2 s of wrk + about 0.8 s to settle), 5 start-ups (10 s) and
    # the engine alone (2 kinds x 2 layouts x 7 batch sizes x 1 s, and the large batches' overrun)
    Step(
        "compare",
        "every stage in turns under the same loads, each against the one before",
        "benchmarks.compare",
        ("compare.json",),
        5.5,
        1.3,
    ),
    # 5 stages x 2 profiles x 2 commits x 2 rounds x (2 s + about 0.8 s), 10 start-ups, a worktree
    Step(
        "before-after",
        "stages 1 to 5 at the start of this simplification, and now, in turns",
        "benchmarks.compare",
        ("before_after.json",),
        2.4,
        1,
        args=("--against", "5b1685e", "--profiles", "unique-32,unique-128"),
    ),
    # the constants (30 s), 4 servers starting at once (15 s), 2 rounds x 8 points x (3 s + about 0.7 s)
    Step(
        "cost-model",
        "the cost model: its constants, its prediction beside stages 1-3 in the same run",
        "benchmarks.cost_model",
        ("cost_model.json",),
        2,
        0.7,
    ),
    # 19 commands, 15 of them against a server started fresh for each: a few seconds each (30 s last run)
    Step(
        "docs-outputs",
        "what the chapters' commands print, against fresh servers",
        "benchmarks.docs_outputs",
        ("outputs.json",),
        1,
        1,
    ),
    # stage 5 and Locust's UI start (about 15 s), 30 s of load, 4 pictures in a browser (about 15 s)
    Step(
        "screenshots",
        "Locust's web UI and stage 5's dashboard under its load, pictures",
        "benchmarks.screenshots",
        ("screenshots.json",),
        1,
        0.6,
    ),
    # the four reliability test files: about 23 server starts (2.5 s each), 9 faults under load (5 to 7 s
    # each), slow clients on 5 stages (4 s each), 250 bad inputs, schemathesis 50 examples (about 20 s)
    Step(
        "reliability",
        "hostile input and faults: the reliability tests, counted",
        "benchmarks.reliability",
        ("reliability.json",),
        3,
        2,
    ),
    # 210 s of open-loop load after a server start, the largest batches and 1 + 3 x 4 s of wrk
    Step("soak", "stage 5 with Redis, open loop", "benchmarks.soak", ("soak.json",), 4, 1.5),
    # plain stage 5, 2 workers, the cluster's two designs on one cluster start-up: a warm-up and
    # 3 points of 8 s each a setup (quick, 3 s a point: 2.2 min on a busy machine)
    Step(
        "beyond",
        "stage 5 as 2 workers and on the Ray cluster, both designs, against plain stage 5 ([cluster] extra)",
        "benchmarks.beyond",
        ("beyond.json",),
        3.5,
        2.5,
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
    Page("model.json", "model.md", "benchmarks.model_facts:markdown"),
    Page("stage0.json", "stage0.md", "benchmarks.stage0:markdown"),
    Page(
        "quantization.json",
        "quantization.md",
        "benchmarks.quantization:markdown",
        "benchmarks.results:_draw_quantization",
        ("quantization.png",),
    ),
    Page("bench.json", "bench.md", "benchmarks.micro.__main__:markdown"),
    Page("stage2_threads.json", "stage2_threads.md", "benchmarks.stage2_threads:markdown"),
    Page("stage3.json", "stage3.md", "benchmarks.stage3:markdown"),
    Page("stage4.json", "stage4.md", "benchmarks.stage4:markdown"),
    Page("compare.json", "compare.md", "benchmarks.compare:markdown"),
    Page(
        "screenshots.json",
        "screenshots.md",
        "benchmarks.screenshots:markdown",
        images=("locust_start.png", "locust_charts.png", "locust_statistics.png", "dashboard.png"),
    ),
    Page("reliability.json", "reliability.md", "benchmarks.reliability:markdown"),
    Page("soak.json", "soak.md", "benchmarks.soak:markdown", "benchmarks.soak:plot", ("soak.png",)),
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


def _draw_quantization(result: dict[str, Any], img: Path) -> None:
    _function("benchmarks.quantization:plot")(result, img / "quantization.png")




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
