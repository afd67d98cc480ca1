"""Hostile input and faults, counted: the reliability tests, run against every stage, and what they saw.

    make results ONLY=reliability              # 50 schemathesis examples per operation and mode
    python -m benchmarks.reliability --quick   # 10

The tests are the experiment: ``tests/test_bad_input.py`` (the hand-written catalogue, 100 MB
bodies), ``test_fuzz_schema.py``, ``test_slow_clients.py`` and ``test_faults.py`` assert on every
answer, and each test records what it saw (``observe``, pytest's ``record_property``). This runs
them once with ``--junitxml`` and turns the records into reliability.json and .md: one catalogue and
one runner serve the assertions and the counts, and a failed test shows in the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from loadtests import evidence
from loadtests.tables import page, stage_label, table

TESTS = ("test_bad_input.py", "test_fuzz_schema.py", "test_slow_clients.py", "test_faults.py")


def run_tests(examples: int, junit: Path) -> list[dict[str, Any]]:
    """Every test of TESTS, run once: its file, name, outcome and what it recorded (always a stage)."""
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"--junitxml={junit}", *(f"tests/{name}" for name in TESTS)],
        cwd=evidence.REPO, env={**os.environ, "FUZZ_EXAMPLES": str(examples)}, check=False,
    )  # fmt: skip
    tests = []
    for case in ElementTree.parse(junit).iter("testcase"):
        tags = {child.tag for child in case}
        outcome = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        saw = {p.get("name", ""): json.loads(p.get("value", "null")) for p in case.iter("property")}
        tests.append({"file": case.get("classname"), "test": case.get("name"), "outcome": outcome} | saw)
    return tests


def _saw(report: dict[str, Any], function: str) -> list[dict[str, Any]]:
    """What each test of one test function recorded, in the order they ran."""
    return [t for t in report["tests"] if t["test"].split("[")[0] == function and "stage" in t]


def markdown(report: dict[str, Any]) -> str:
    """reliability.md: the summary, inputs per stage, every case, slow clients and faults."""
    cases = _saw(report, "test_bad_input")
    huge = _saw(report, "test_100_mb_body_is_refused_without_buffering")
    fuzz = _saw(report, "test_schema_fuzz")
    slow = _saw(report, "test_slow_clients")
    faults = [_fault(t) for t in report["tests"] if t["file"] == "tests.test_faults" and "stage" in t]
    stages = list(dict.fromkeys(c["stage"] for c in cases))
    passed = sum(t["outcome"] == "passed" for t in report["tests"])
    tried = len(cases) + len(huge) + sum(f["requests"] for f in fuzz) + sum(s["slow_bodies"] for s in slow)
    fives = sum((c["status"] or 0) >= 500 for c in cases + huge)  # None: no answer at all
    fives += sum(n for f in fuzz for status, n in f["statuses"].items() if status.startswith("5"))
    lost = sum(row[3] for row in faults if isinstance(row[3], int))
    allowed = {c["case"]: "/".join(map(str, c["allowed"])) for c in cases}
    answered = {(c["case"], c["stage"]): c["status"] for c in cases}
    sections = {
        "summary": table(
            ["tests passed", "inputs tried", "answered 5xx", "faults injected", "requests lost"],
            [(f"{passed} of {len(report['tests'])}", tried, fives, len(faults), lost)],
        ),
        "inputs": table(
            ["stage", "hand-written cases", "answered 200 / 4xx / 5xx", "100 MB body: status, RSS growth",
             "schemathesis requests", "schema failures"],
            [_inputs(stage, cases, huge, fuzz) for stage in stages],
            align="lrrlrr",
        ),
        "cases": table(
            ["case", "allowed", *(stage_label(s) for s in stages)],
            [(case, ok, *(answered.get((case, s)) for s in stages)) for case, ok in allowed.items()],
            align="ll" + "r" * len(stages),
        ),
        "slow": table(
            ["stage", "slow bodies: answers (after)", "slow headers still open",
             "ordinary requests meanwhile: 200s", "their p50 (alone)"],
            [_slow(s) for s in slow],
            align="llrrr",
        ),
        "faults": table(
            ["fault", "stage", "requests under the fault", "failed or lost", "notes"], faults, align="llrrl"
        ),
    }  # fmt: skip
    failed = [t["test"] for t in report["tests"] if t["outcome"] == "failed"]
    note = f"{report['fuzz_examples']} schemathesis examples per operation and mode."
    note += f" **Failed**: {', '.join(failed)}." if failed else ""
    return page(report["stamp"], sections, note) + "\n"


def _inputs(stage: str, cases: list[Any], huge: list[Any], fuzz: list[Any]) -> tuple[Any, ...]:
    statuses = Counter(c["status"] // 100 for c in cases if c["stage"] == stage)
    big = ", ".join(f"{h['status']} (+{h['rss_growth_mib']} MiB)" for h in huge if h["stage"] == stage)
    schema = [f for f in fuzz if f["stage"] == stage]
    return (stage, statuses.total(), f"{statuses[2]} / {statuses[4]} / {statuses[5]}", big,
            sum(f["requests"] for f in schema), sum(f["failures"] for f in schema))  # fmt: skip


def _slow(s: dict[str, Any]) -> tuple[Any, ...]:
    answers = ", ".join(f"{n} x {status}" for status, n in sorted(s["body_statuses"].items()))
    first, last = s["body_answered_after_s"]
    p50 = f"{s['ordinary_p50_ms']} ms ({s['baseline_p50_ms']} ms)"
    return (s["stage"], f"{answers} ({first}-{last} s)", f"{s['headers_still_open']}/{s['slow_headers']}",
            f"{s['ordinary_ok']}/{s['ordinary']}", p50)  # fmt: skip


def _fault(r: dict[str, Any]) -> tuple[Any, ...]:
    """One row of the faults table from what a fault test recorded."""
    if "during_outage" in r:
        notes = f"{r['redis_errors']} Redis errors absorbed; {r['hits_after_restart']} hits after restart"
        under = f"{r['requests']} ({r['during_outage']} while down)"
        return "Redis SIGKILLed, restarted", r["stage"], under, r["failed"], notes
    if "drain_s" in r:
        fault = f"SIGTERM with {r['burst']} requests admitted"
        fault += ", then Redis SIGKILLed mid-drain" if r["redis_dies"] else ""
        after = ", ".join(f"{n} {k}" for k, n in sorted(r["after_sigterm"].items()))
        return (
            fault,
            r["stage"],
            r["burst"],
            r["lost"],
            f"drained in {r['drain_s']} s; later requests: {after}",
        )
    notes = f"ready again in {r['ready_after_restart_s']} s; {r['hits_after_restart']}/{r['texts']} texts"
    notes += " still cached (Redis)" if r["with_redis"] else " cached (no Redis: a cold start)"
    return "SIGKILL, restart", r["stage"], r["requests_during_kill"], "n/a (killed)", notes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--examples", type=int, help="schemathesis examples per operation, mode (50, quick 10)"
    )
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.reliability", args, argv)
    examples = args.examples or (10 if args.quick else 50)
    tests = run_tests(examples, run.logs("reliability") / "junit.xml")
    report = {"stamp": run.stamp(), "fuzz_examples": examples, "tests": tests}
    evidence.publish(run, "reliability", report, markdown)
    return 0 if all(t["outcome"] == "passed" for t in tests) else 1


if __name__ == "__main__":
    sys.exit(main())
