"""`make results`: every results file, table and picture the docs include, regenerated in one go.

    python -m benchmarks.results                  # the whole pipeline into docs/ (a clean tree)
    python -m benchmarks.results --quick          # the same steps, briefly, into out/
    python -m benchmarks.results --only stage3,compare     # some steps, into out/ (make results ONLY=...)
    python -m benchmarks.results --from compare            # this step and the ones after it
    python -m benchmarks.results --list           # the steps, in order, with their estimates
    python -m benchmarks.results --list --record  # ... and pipeline.md rewritten from them
    python -m benchmarks.results --render         # every page rewritten from its JSON, nothing measured

Each step is one experiment's own command (``python -m benchmarks.stage3 ...``), run as a
subprocess with ``--quick``, ``--record`` and ``--allow-dirty`` passed on. Kept in Python rather
than as Makefile rules: the steps are also data, which pipeline.md (each step, its estimate and
the time its last recorded run took, from that file's stamp) and the staleness check read. A full
run records by default; recording refuses a tree with uncommitted changes unless ``--allow-dirty``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtests import evidence, tables


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    module: str
    writes: tuple[str, ...]  # its results files in docs/results/: x.json, each with the page x.md
    minutes: float  # the estimate of a full run on 2 cores at the step's defaults
    quick_minutes: float
    stamped: bool = True  # takes --quick/--record/--allow-dirty; else a generator from the code
    args: tuple[str, ...] = ()
    images: tuple[str, ...] = ()  # its pictures in docs/img/, stamped like its pages
    render: str = "markdown"  # the function ("module:function", or one of its module's) that renders a page

    def page(self, result: dict[str, Any]) -> str:
        """The Markdown page of one of its results files."""
        module, _, function = (
            self.render if ":" in self.render else f"{self.module}:{self.render}"
        ).partition(":")
        return str(getattr(importlib.import_module(module), function)(result))


# The order: stage 0's model and study, each chapter's experiment, the whole-system runs, then what is
# generated from the code. A failed step is reported; the rest still run.
STEPS: tuple[Step, ...] = (
    # the build's facts; 4 files and 8 static recipes scored on the gate sentences and the 1500 STS-B
    # dev pairs, timed on one thread in 2 rounds; 4 files x 7 batch sizes x 0.5 s of wall clock
    # (4.0 min beside a few neighbours, 288 CPU-seconds)
    Step("stage0", "stage 0: the build, fp32 and three INT8 files, the quantization study",
         "benchmarks.stage0", ("stage0.json",), 4, 1),
    # pytest-benchmark's own rounds, 16 benchmarks (15 s last run)
    Step("bench", "microbenchmarks (pytest-benchmark)", "benchmarks.micro", ("bench.json",), 0.5, 0.3,
         render="benchmarks.micro.__main__:markdown"),
    # 5 servers starting at once (20 s), then 3 rounds x 5 layouts x 2 loads x (3 s + about 0.7 s to settle)
    Step("stage2-threads", "stage 2: thread settings", "benchmarks.stage2_threads", ("stage2_threads.json",),
         2.5, 1),
    # the engine alone (14 x 1 s, the plateau about 40 s), the batcher alone (5 rounds x 11 bursts,
    # 70 s), 12 servers starting at once (40 s), then 4 rounds x 30 points x (Locust's 3.6 s, its
    # start and about 0.7 s to settle): four rounds, since a window's effect on this machine is
    # about the size of two rounds' noise
    Step("stage3", "stage 3: the batch-size sweep, windows by load, each refinement",
         "benchmarks.stage3", ("stage3.json",), 14, 4.5, images=("batch_sweep.png",)),
    # a full run took 2.6 min on a busy machine
    Step("stage4", "stage 4: Redis at a distance, the lookup's bound, overload, a flood",
         "benchmarks.stage4", ("stage4.json",), 3, 1.5),
    # 5 stages x 6 profiles x 3 rounds x (Locust: its start, 2.6 s, then about 0.8 s to settle), wrk
    # beside it on 2 profiles (2 s + 0.8 s), 5 start-ups (10 s) and the engine alone (2 kinds x 2
    # layouts x 7 batch sizes x 1 s, and the large batches' overrun)
    Step("compare", "every stage in turns under the same loads (Locust), each against the one"
         " before, stage 3's targets",
         "benchmarks.compare", ("compare.json",), 10, 2.5),
    # 3 apps in one process (their engines loading, 10 s), 6 rounds x 3 stages x 2000 requests (about
    # 2 s each), one profiled round each
    Step("layers", "stages 3, 4 and 5 in one process, the model answering at once: each layer's CPU",
         "benchmarks.layers", ("layers.json",), 1.5, 0.7),
    # 5 stages x 2 profiles x 2 commits x 3 rounds x (Locust's start and 2.6 s + about 0.8 s), 10 start-ups
    Step("before-after", "stages 1 to 5 of a fixed reference commit and of this checkout, in turns",
         "benchmarks.compare", ("before_after.json",), 5, 1.5,
         args=("--against", "31e7b5d", "--profiles", "unique-32,unique-128", "--rounds", "3"),
         render="against_markdown"),
    # 2 stages x 2 profiles x 2 commits x 3 rounds x (2 s + about 0.8 s), and 4 start-ups
    Step("idiom", "stages 4 and 5 with FastAPI's @app.middleware (commit 0dc2988) and as shipped, in turns",
         "benchmarks.compare", ("idiom.json",), 2.2, 1,
         args=("--against", "0dc2988", "--stages", "4,5", "--profiles", "unique-32,repeated-32", "--rounds",
               "3", "--name", "idiom"), render="against_markdown"),
    # the constants (30 s), 4 servers starting at once (15 s), 2 rounds x 8 points x (3 s + about 0.7 s)
    Step("cost-model", "the cost model: its constants, its prediction beside stages 1-3 in the same run",
         "benchmarks.cost_model", ("cost_model.json",), 2, 0.7),
    # about 20 commands, most against a server started fresh for each
    Step("docs-outputs", "what the chapters' commands print, against fresh servers",
         "benchmarks.docs_outputs", ("outputs.json",), 1, 1),
    # one stage 5, Locust's web UI driving it for 30 s, 4 pictures
    Step("screenshots", "Locust's web UI and stage 5's dashboard under its load, pictures",
         "benchmarks.screenshots", ("screenshots.json",), 1, 0.6,
         images=("locust_start.png", "locust_charts.png", "locust_statistics.png", "dashboard.png")),
    # the four reliability test files: about 23 server starts (2.5 s each), 9 faults under load (5 to 7 s
    # each), slow clients on 5 stages (4 s each), 250 bad inputs, schemathesis 50 examples (about 20 s)
    Step("reliability", "hostile input and faults: the reliability tests, counted", "benchmarks.reliability",
         ("reliability.json",), 3, 2),
    # 210 s of open-loop load after a server start, the largest batches and 1 + 3 x 4 s of wrk
    Step("soak", "stage 5 with Redis, open loop", "benchmarks.soak", ("soak.json",), 4, 1.5,
         images=("soak.png",)),
    # plain stage 5, 2 workers, the cluster's two designs on one cluster start-up: a warm-up and
    # 3 points of 8 s each a setup
    Step("beyond", "stage 5 as 2 workers and on the Ray cluster, both designs, against plain stage 5",
         "benchmarks.beyond", ("beyond.json",), 3.5, 2.5),
    # 3 rounds x (the image's start + make stage5's, a few seconds each); a build first when the
    # image's files changed (the first one, with the base and the model: many minutes)
    Step("image", "the stage 5 image beside make stage5: its size, its start to the first 200",
         "benchmarks.image", ("image.json",), 1, 0.5),
    Step("settings", "settings table (from the code)", "benchmarks.settings_doc", ("settings.md",), 0.1, 0.1,
         stamped=False),
    Step("metrics", "metrics reference (from the code)", "benchmarks.metrics_reference",
         ("stage5_metrics.md",), 0.1, 0.1, stamped=False),
)  # fmt: skip
# Generated from the code, not measured: checked by content (tests/), not stamped.
FROM_CODE = ("settings.md", "stage5_metrics.md", "pipeline.md")


def command(step: Step, quick: bool, record: bool, allow_dirty: bool) -> list[str]:
    args = [sys.executable, "-m", step.module, *step.args]
    if step.stamped:
        return [*args, *(["--quick"] if quick else []), *(["--record"] if record else []),
                *(["--allow-dirty"] if allow_dirty else [])]  # fmt: skip
    return args if record else [*args, "--out", str(evidence.OUT / "results" / step.writes[0])]


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _took(step: Step, results: Path) -> str:
    """How long the run that wrote the step's first file took, from that file's stamp."""
    path = results / step.writes[0]
    stamp = json.loads(path.read_text()).get("stamp", {}) if path.suffix == ".json" and path.is_file() else {}
    return _minutes(stamp["wall_s"]) if "wall_s" in stamp else "–"


def markdown(results: Path = evidence.RESULTS) -> str:
    """pipeline.md: every step, its estimate, and how long its last recorded run took."""
    rows = [
        (s.name, s.what, f"`{' '.join(['python', *command(s, False, True, False)[1:]])}`",
         _minutes(s.minutes * 60), _took(s, results))
        for s in STEPS
    ]  # fmt: skip
    total, quick = sum(s.minutes for s in STEPS), sum(s.quick_minutes for s in STEPS)
    body = [
        *tables.table(["step", "what", "command", "estimate", "last recorded run"], rows, "lllrr"),
        "",
        f"Estimated in all: {_minutes(total * 60)} (`QUICK=1`: {_minutes(quick * 60)}). An estimate counts a"
        " step's points, seconds and rounds at its defaults; the last column is the time its results file"
        " records.",
    ]
    note = "<!-- generated by `python -m benchmarks.results` from its steps and the stamps; do not edit -->"
    return "\n".join([note, "", *tables.section("steps", body)])


def pipeline(steps: Sequence[Step], run: evidence.Run) -> int:
    where = "docs/results/ and docs/img/" if run.record else "out/results/ and out/img/"
    expected = sum(s.quick_minutes if run.quick else s.minutes for s in steps)
    print(f"make results: {len(steps)} steps, {'QUICK' if run.quick else 'full'}, about {expected:.0f} min,"
          f" into {where}", flush=True)  # fmt: skip
    started, failed = time.monotonic(), []
    for n, step in enumerate(steps, 1):
        print(f"[{n}/{len(steps)}] {step.name}: {step.what} ...", flush=True)
        t0 = time.monotonic()
        done = subprocess.run(command(step, run.quick, run.record, run.allow_dirty), cwd=evidence.REPO)
        took = _minutes(time.monotonic() - t0)
        if done.returncode != 0:  # the steps are independent: one failure must not cost the others
            failed.append(step.name)
            print(f"[{n}/{len(steps)}] {step.name}: FAILED (exit {done.returncode}) after {took}", flush=True)
        else:
            print(f"[{n}/{len(steps)}] {step.name}: done in {took}", flush=True)
    total = _minutes(time.monotonic() - started)
    print(f"make results: {len(steps) - len(failed)} of {len(steps)} steps done in {total}", flush=True)
    if run.record and len(failed) < len(steps):
        print(f"wrote {evidence.write_text(evidence.RESULTS / 'pipeline.md', markdown())}", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}; run them again with --only {','.join(failed)}", flush=True)
    return 1 if failed else 0


def select(only: str | None, start: str | None) -> list[Step]:
    names = [s.name for s in STEPS]
    wanted = [n.strip() for n in (only or "").split(",") if n.strip()] + ([start] if start else [])
    if unknown := sorted(set(wanted) - set(names)):
        raise SystemExit(f"unknown step(s) {unknown}; the steps: {', '.join(names)}")
    chosen = [s for s in STEPS if not only or s.name in wanted]
    return [s for s in chosen if not start or names.index(s.name) >= names.index(start)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    evidence.add_arguments(parser)
    parser.add_argument("--only", help="comma-separated step names")
    parser.add_argument("--from", dest="start", help="start at this step (after a failure)")
    parser.add_argument("--list", action="store_true", help="print the steps and stop")
    parser.add_argument(
        "--render", action="store_true", help="rewrite every page from its JSON, measure nothing"
    )
    args = parser.parse_args(argv)
    if args.list:  # with --record: pipeline.md too, as after a recording run (after a change of STEPS)
        for s in STEPS:
            print(f"{s.name:20s} {s.what} (~{s.minutes:g} min, QUICK ~{s.quick_minutes:g} min)")
        if args.record:
            print(f"wrote {evidence.write_text(evidence.RESULTS / 'pipeline.md', markdown())}")
        return 0
    if args.render:  # after a change of how a page is written, not of what is measured
        for step in (s for s in STEPS if s.stamped):
            for name in (n for n in step.writes if (evidence.RESULTS / n).is_file()):
                page = step.page(json.loads((evidence.RESULTS / name).read_text()))
                print(f"wrote {evidence.write_text(evidence.RESULTS / name.replace('.json', '.md'), page)}")
        return 0
    # The whole pipeline is what the docs show; one step (a reader trying a chapter's) writes out/.
    record = args.record or not (args.quick or args.only)
    # Refuse a dirty tree here, before the measuring starts, not at the first step that records.
    options = argparse.Namespace(record=record, allow_dirty=args.allow_dirty, quick=args.quick)
    return pipeline(select(args.only, args.start), evidence.start("benchmarks.results", options, argv))


if __name__ == "__main__":
    sys.exit(main())
