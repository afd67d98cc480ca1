"""`make bench`: the pytest-benchmark microbenchmarks in this folder, then bench.json and bench.md.

    python -m benchmarks.micro                 # every microbenchmark, about 2 minutes
    python -m benchmarks.micro --quick         # short rounds (seconds), to see that they run
    python -m benchmarks.micro --compare       # also compare with your last run (pytest-benchmark)
    python -m benchmarks.micro --record        # bench.json and bench.md into docs/results/

pytest-benchmark keeps every run under out/benchmarks/ (git-ignored), so ``--compare`` compares a
reader's runs with each other; the committed docs/results/bench.json is the reference the
ratios at the end are computed against.
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
from loadtests.evidence import describe
from loadtests.tables import num, page, table

HERE = Path(__file__).resolve().parent


def trim(data: dict[str, Any]) -> dict[str, Any]:
    """Drop the raw per-round times, which would make the file megabytes (the statistics stay)."""
    for bench in data["benchmarks"]:
        bench["stats"].pop("data", None)
    return data


def _order(bench: dict[str, Any]) -> tuple[str, list[Any]]:
    """By group, then by name with numbers compared as numbers (``[8]`` before ``[64]``)."""
    parts = re.split(r"(\d+)", bench["name"])
    return bench.get("group") or "", [int(p) if p.isdigit() else p for p in parts]


def _items(bench: dict[str, Any]) -> int:
    extra = bench.get("extra_info", {})
    return int(extra.get("texts") or extra.get("requests") or extra.get("keys") or 1)


def markdown(data: dict[str, Any]) -> str:
    rows = [
        (b.get("group") or "", f"`{b['name']}`", num(s["median"] * 1e6), num(s["mean"] * 1e6),
         num(s["min"] * 1e6), s["rounds"], num(s["median"] / _items(b) * 1e6))
        for b in sorted(data["benchmarks"], key=_order)
        for s in [b["stats"]]
    ]  # fmt: skip
    bench = [
        f"{describe(data['stamp'])} Times in microseconds.",
        "",
        *table(["group", "benchmark", "median µs", "mean µs", "min µs", "rounds", "per item µs"], rows),
    ]
    return page(data["stamp"], {"bench": bench})


def pytest_command(raw: Path, quick: bool, compare: bool, extra: Sequence[str]) -> list[str]:
    # fmt: off
    return [
        sys.executable, "-m", "pytest", str(HERE), "-o", "python_files=bench_*.py",
        "-o", "python_functions=bench_*", "-p", "no:cacheprovider", "--benchmark-enable",
        "--benchmark-only", f"--benchmark-storage=file://{evidence.OUT / 'benchmarks'}",
        "--benchmark-autosave", f"--benchmark-json={raw}",
        *(["--benchmark-max-time=0.05", "--benchmark-min-rounds=3"] if quick else []),
        *(["--benchmark-compare"] if compare else []), *extra,
    ]
    # fmt: on


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compare", action="store_true", help="compare with your last saved run")
    parser.add_argument("--out", type=Path, help="folder for bench.json and bench.md")
    evidence.add_arguments(parser)
    args, extra = parser.parse_known_args(argv)  # the rest goes to pytest (e.g. -k engine)
    run = evidence.start("benchmarks.micro", args, argv)
    raw = evidence.OUT / "benchmarks" / "last.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(pytest_command(raw, args.quick, args.compare, extra), cwd=evidence.REPO)
    if done.returncode != 0:
        return done.returncode
    data = trim(json.loads(raw.read_text()))
    data["stamp"] = run.stamp()
    out = args.out or run.results_dir
    evidence.write_json(out / "bench.json", data, indent=1)
    evidence.write_text(out / "bench.md", markdown(data))
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
