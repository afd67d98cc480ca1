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
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.micro.report import headline, markdown, trim
from loadtests import evidence

HERE = Path(__file__).resolve().parent


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
    evidence.against_reference(run, "bench.json", data, headline)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
