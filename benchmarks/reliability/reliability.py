"""The reliability report: every hostile input and every fault, counted, for the docs.

    make results ONLY=reliability                                     # about 8 minutes, 100 fuzz examples
    python -m benchmarks.reliability.reliability --quick  # 5 fuzz examples, about 5 minutes
    python -m benchmarks.reliability.reliability --record # docs/results/reliability.*

Runs the same catalogue and scenarios the tests assert on (``badinput.py``, ``fuzz.py``,
``slowclients.py``, ``faults.py`` beside this file) against every server stage, and writes what
happened: inputs tried and how they were answered, faults injected and requests lost.
The Markdown file holds the tables ``docs/reliability.md`` includes by snippet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.reliability import faults, slowclients
from benchmarks.reliability.badinput import MB, cases, send, send_huge
from benchmarks.reliability.fuzz import fuzz_server
from common.serve import available_stages
from loadtests import evidence
from loadtests.procs import running_stage
from loadtests.tables import page, table

FAULT_STAGES = ("stage4_cache_backpressure", "stage5_metrics")
BODY_TIMEOUT_S = 2.0  # shorter than the default 15 s, so the slow-client scenario takes seconds


def _peak_rss_during(pid: int, action: Any) -> tuple[Any, float]:
    """Run ``action()`` while sampling the process's RSS; return its result and the growth in MiB."""
    process = psutil.Process(pid)
    baseline = peak = process.memory_info().rss
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.wait(0.005):
            peak = max(peak, process.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = action()
    finally:
        stop.set()
        sampler.join()
    return result, (peak - baseline) / MB


def inputs_for_stage(stage: str, log_dir: Path, examples: int) -> dict[str, Any]:
    """The bad-input catalogue, two 100 MB bodies and the schema fuzzer against one stage."""
    statuses: Counter[str] = Counter()
    answers: dict[str, int] = {}
    unexpected: list[str] = []
    env = {"BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)}
    with (
        running_stage(stage, log_dir, env) as server,
        httpx.Client(base_url=server.url, timeout=120) as client,
    ):
        for case in cases():
            r = send(client, case)
            statuses[str(r.status_code)] += 1
            answers[case.name] = r.status_code
            if r.status_code not in case.expect:
                unexpected.append(f"{case.name}: {r.status_code}")
        huge = {}
        for chunked in (False, True):
            result, grew = _peak_rss_during(server.pid, lambda c=chunked: send_huge(server.url, 100 * MB, c))
            huge["chunked" if chunked else "content_length"] = {
                "status": result.status,
                "sent_mib": round(result.sent_bytes / MB, 1),
                "rss_growth_mib": round(grew, 1),
            }
        slow = asyncio.run(slowclients.run(server.url))
        fuzz = fuzz_server(server.url, examples)
        alive = client.get("/health").status_code == 200
        tracebacks = server.log().count("Traceback")
    return {
        "stage": stage,
        "catalogue": {
            "cases": len(cases()),
            "statuses": dict(sorted(statuses.items())),
            "unexpected": unexpected,
            "answers": answers,
            "server_errors": sum(n for s, n in statuses.items() if s.startswith("5")),
        },
        "body_100_mib": huge,
        "slow_clients": {
            "body_timeout_s": BODY_TIMEOUT_S,
            "slow_bodies": slow.slow_bodies,
            "body_statuses": slow.body_statuses,
            "body_answered_after_s": [round(min(slow.body_answer_s), 2), round(max(slow.body_answer_s), 2)],
            "slow_headers": slow.slow_headers,
            "headers_still_open": slow.headers_still_open,
            "ordinary": slow.ordinary,
            "ordinary_ok": slow.ordinary_ok,
            "ordinary_p50_ms": slow.ordinary_p50_ms,
            "baseline_p50_ms": slow.baseline_p50_ms,
        },
        "fuzz": {
            "examples_per_operation": examples,
            "requests": fuzz.total_requests,
            "operations": len(fuzz.requests),
            "statuses": {str(k): v for k, v in sorted(fuzz.statuses.items())},
            "failures": fuzz.failures,
        },
        "alive_after": alive,
        "tracebacks_in_log": tracebacks,
    }


def run(examples: int, log_dir: Path) -> dict[str, Any]:
    stages = available_stages()
    inputs = [inputs_for_stage(stage, log_dir, examples) for stage in stages]
    fault_stages = [s for s in stages if s in FAULT_STAGES]
    injected = {
        "redis_kill_restart": [faults.redis_restart(s, log_dir) for s in fault_stages],
        "sigterm": [faults.sigterm_drain(s, log_dir) for s in fault_stages],
        "sigterm_redis_dies": [faults.sigterm_drain(s, log_dir, redis_dies=True) for s in fault_stages],
        "sigkill_restart": [faults.sigkill_restart(s, log_dir, with_redis=True) for s in fault_stages],
    }
    tried = sum(
        i["catalogue"]["cases"] + 2 + i["fuzz"]["requests"] + i["slow_clients"]["slow_bodies"] for i in inputs
    )
    server_errors = sum(
        i["catalogue"]["server_errors"]
        + sum(n for s, n in i["fuzz"]["statuses"].items() if s.startswith("5"))
        for i in inputs
    )
    # SIGKILL loses what was in flight by definition; what counts there is coming back (ready, warm).
    lost = sum(r["failed"] for r in injected["redis_kill_restart"]) + sum(
        r["lost"] for r in injected["sigterm"] + injected["sigterm_redis_dies"]
    )
    summary = {
        "stages": stages,
        "inputs_tried": tried,
        "server_errors": server_errors,
        "unexpected_answers": sum(
            len(i["catalogue"]["unexpected"])
            + len(i["fuzz"]["failures"])
            + (i["slow_clients"]["ordinary"] - i["slow_clients"]["ordinary_ok"])
            + (i["slow_clients"]["slow_bodies"] - i["slow_clients"]["body_statuses"].get("408", 0))
            for i in inputs
        ),
        "faults_injected": sum(len(v) for v in injected.values()),
        "requests_lost": lost,
    }
    return {
        "examples_per_operation": examples,
        "body_timeout_s": BODY_TIMEOUT_S,
        "summary": summary,
        "inputs": inputs,
        "faults": injected,
    }


def markdown(report: dict[str, Any]) -> str:
    """reliability.md: the summary, inputs per stage, slow clients, faults, and every case."""
    s = report["summary"]
    sections: dict[str, list[str]] = {}
    sections["summary"] = table(
        ["inputs tried", "answered 5xx", "answers off the contract", "faults injected", "requests lost"],
        [
            (
                s["inputs_tried"],
                s["server_errors"],
                s["unexpected_answers"],
                s["faults_injected"],
                s["requests_lost"],
            )
        ],
    )
    rows = []
    for i in report["inputs"]:
        st, cat = i["catalogue"]["statuses"], i["catalogue"]
        ok, fives = st.get("200", 0), cat["server_errors"]
        big = ", ".join(f"{v['status']} (+{v['rss_growth_mib']} MiB)" for v in i["body_100_mib"].values())
        rows.append(
            (
                i["stage"],
                cat["cases"],
                f"{ok} / {cat['cases'] - ok - fives} / {fives}",
                big,
                i["fuzz"]["requests"],
                len(i["fuzz"]["failures"]),
            )
        )
    sections["inputs"] = table(
        [
            "stage",
            "hand-written cases",
            "answered 200 / 4xx / 5xx",
            "100 MB body: status, RSS growth",
            "schemathesis requests",
            "schema failures",
        ],
        rows,
        align="lrrlrr",
    )
    rows = []
    for i in report["inputs"]:
        sc = i["slow_clients"]
        answers = ", ".join(f"{n} x {status}" for status, n in sorted(sc["body_statuses"].items()))
        first, last = sc["body_answered_after_s"]
        rows.append(
            (
                i["stage"],
                f"{answers} ({first}-{last} s)",
                f"{sc['headers_still_open']}/{sc['slow_headers']}",
                f"{sc['ordinary_ok']}/{sc['ordinary']}",
                f"{sc['ordinary_p50_ms']} ms ({sc['baseline_p50_ms']} ms)",
            )
        )
    sections["slow"] = table(
        [
            "stage",
            "slow bodies: answers (after)",
            "slow headers still open",
            "ordinary requests meanwhile: 200s",
            "their p50 (alone)",
        ],
        rows,
        align="llrrr",
    )
    sections["faults"] = table(
        ["fault", "stage", "requests under the fault", "failed or lost", "notes"],
        _fault_rows(report["faults"]),
        align="llrrl",
    )
    sections["cases"] = _cases_table(report)
    return (
        page(
            report["stamp"],
            sections,
            f"{report['examples_per_operation']} schemathesis examples per operation and mode.",
        )
        + "\n"
    )


def _fault_rows(f: dict[str, Any]) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    for r in f["redis_kill_restart"]:
        rows.append(
            (
                "Redis SIGKILLed, restarted",
                r["stage"],
                f"{r['requests']} ({r['during_outage']} while down)",
                r["failed"],
                f"{r['redis_errors']} Redis errors absorbed; {r['redis_hits_after_restart']}"
                " hits after restart",
            )
        )
    for r in f["sigterm"]:
        after = ", ".join(f"{n} {k}" for k, n in sorted(r["after_sigterm"].items()))
        rows.append(
            (
                f"SIGTERM with {r['burst']} requests admitted",
                r["stage"],
                r["burst"],
                r["lost"],
                f"drained in {r['drain_seconds']} s; later requests: {after}",
            )
        )
    for r in f["sigterm_redis_dies"]:
        seen = (
            "the tier logged the dead Redis and failed open"
            if r["redis_failure_logged"]
            else "no Redis failure seen"
        )
        rows.append(
            (
                f"SIGTERM with {r['burst']} requests admitted, then Redis SIGKILLed mid-drain",
                r["stage"],
                r["burst"],
                r["lost"],
                f"drained in {r['drain_seconds']} s; {seen}",
            )
        )
    for r in f["sigkill_restart"]:
        rows.append(
            (
                "SIGKILL, restart",
                r["stage"],
                r["requests_during_kill"],
                "n/a (killed)",
                f"ready again in {r['ready_after_restart_s']} s; {r['cache_hits_after_restart']}/{r['texts']}"
                " texts still cached (Redis)",
            )
        )
    return rows


def _cases_table(report: dict[str, Any]) -> list[str]:
    """One row per hand-written case: what each stage answered, and what the contract allows."""
    expect = {c.name: "/".join(map(str, sorted(c.expect))) for c in cases()}
    stages = [i["stage"] for i in report["inputs"]]
    return table(
        ["case", "allowed", *(s.split("_")[0] for s in stages)],
        [
            (name, allowed, *(i["catalogue"]["answers"].get(name, "-") for i in report["inputs"]))
            for name, allowed in expect.items()
        ],
        align="ll" + "r" * len(stages),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--examples", type=int, help="schemathesis examples per operation and mode (100, quick 5)"
    )
    parser.add_argument("--out", type=Path, help="folder for reliability.json and .md")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    _stop_children_on_sigterm()
    run_ = evidence.start("benchmarks.reliability.reliability", args, argv)
    report = {"stamp": {}, **run(args.examples or (5 if args.quick else 100), run_.logs("reliability"))}
    report["stamp"] = run_.stamp({"BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)})
    out = args.out or run_.results_dir
    evidence.write_json(out / "reliability.json", report, indent=1)
    evidence.write_text(out / "reliability.md", markdown(report))
    print(json.dumps(report["summary"], indent=1))
    print(f"wrote {out / 'reliability.json'} and {out / 'reliability.md'}")
    s = report["summary"]
    return 0 if s["server_errors"] == s["unexpected_answers"] == s["requests_lost"] == 0 else 1


def _stop_children_on_sigterm() -> None:
    # SIGTERM's default kills this process without unwinding, orphaning the servers it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


if __name__ == "__main__":
    sys.exit(main())
