"""`make bench`: the pytest-benchmark microbenchmarks in this folder, then bench.json and bench.md.

    python -m benchmarks.micro                 # every microbenchmark, about 30 s
    python -m benchmarks.micro --quick         # short rounds, to see that they run
    python -m benchmarks.micro --compare       # also compare with your last run (pytest-benchmark)
    python -m benchmarks.micro --record        # bench.json and bench.md into docs/results/

pytest-benchmark keeps every run under out/benchmarks/ (git-ignored), so ``--compare`` compares
a reader's runs with each other; anything else on the command line goes to pytest (``-k engine``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtests import evidence
from loadtests.tables import num, page, table


def _order(bench: dict[str, Any]) -> tuple[str, list[Any]]:
    """By group, then by name with numbers compared as numbers (``[8]`` before ``[64]``)."""
    return bench["group"] or "", [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", bench["name"])]


def markdown(data: dict[str, Any]) -> str:
    rows = []
    for b in sorted(data["benchmarks"], key=_order):
        s, items = b["stats"], max(b["extra_info"].values(), default=1)  # texts, requests or keys
        times = [num(s[k] * 1e6) for k in ("median", "mean", "min")]
        rows.append((b["group"] or "", f"`{b['name']}`", *times, s["rounds"], num(s["median"] / items * 1e6)))
    headers = ["group", "benchmark", "median µs", "mean µs", "min µs", "rounds", "per item µs"]
    return page(data["stamp"], {"bench": [f"{evidence.describe(data['stamp'])} Times in microseconds.",
                                          "", *table(headers, rows)]})  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compare", action="store_true", help="compare with your last saved run")
    parser.add_argument("--out", type=Path, help="folder for bench.json and bench.md")
    evidence.add_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    run = evidence.start("benchmarks.micro", args, argv)
    raw = evidence.OUT / "benchmarks" / "last.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(__file__).parent), "-o", "python_files=bench_*.py",
         "-o", "python_functions=bench_*", "-p", "no:cacheprovider", "--benchmark-enable", "--benchmark-only",
         f"--benchmark-storage=file://{raw.parent}", "--benchmark-autosave", f"--benchmark-json={raw}",
         *(["--benchmark-max-time=0.05", "--benchmark-min-rounds=3"] if args.quick else []),
         *(["--benchmark-compare"] if args.compare else []), *extra],
        cwd=evidence.REPO,
    )  # fmt: skip
    if done.returncode != 0:
        return done.returncode
    data = json.loads(raw.read_text())
    for bench in data["benchmarks"]:
        bench["stats"].pop("data", None)  # every round's time: megabytes; the statistics stay
    evidence.publish(run, "bench", {"stamp": run.stamp(), **data}, markdown, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
