"""The reliability report: every hostile input and every fault, counted, for the docs.

    make reliability        # docs/results/reliability.json and docs/results/reliability.md

Runs the same catalogue and scenarios the tests assert on (``loadtests/badinput.py``,
``loadtests/fuzz.py``, ``loadtests/faults.py``) against every server stage, and writes what
happened: inputs tried and how they were answered, faults injected and requests lost.
The Markdown file holds the tables ``docs/reliability.md`` includes by snippet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.reliability import faults, slowclients
from benchmarks.reliability.badinput import MB, cases, send, send_huge
from benchmarks.reliability.fuzz import fuzz_server
from common.serve import available_stages
from loadtests.machine import machine_info
from loadtests.procs import stage_process

REPO = Path(__file__).resolve().parents[2]
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
        stage_process(stage, log_dir, env) as server,
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
        "command": "make reliability",
        "machine": machine_info(),
        "summary": summary,
        "inputs": inputs,
        "faults": injected,
    }


def markdown(report: dict[str, Any]) -> str:
    m, s = report["machine"], report["summary"]
    lines = [
        "<!-- generated by `make reliability`; do not edit -->",
        "<!-- --8<-- [start:machine] -->",
        f"Measured by `{report['command']}` on {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB memory, "
        f"{m['date']}.",
        "<!-- --8<-- [end:machine] -->",
        "",
        "<!-- --8<-- [start:summary] -->",
        "| inputs tried | answered 5xx | answers off the contract | faults injected | requests lost |",
        "|---|---|---|---|---|",
        f"| {s['inputs_tried']} | {s['server_errors']} | {s['unexpected_answers']} | {s['faults_injected']} "
        f"| {s['requests_lost']} |",
        "<!-- --8<-- [end:summary] -->",
        "",
        "<!-- --8<-- [start:inputs] -->",
        "| stage | hand-written cases | answered 200 / 4xx / 5xx | 100 MB body: status, RSS growth | "
        "schemathesis requests | schema failures |",
        "|---|---|---|---|---|---|",
    ]
    for i in report["inputs"]:
        st = i["catalogue"]["statuses"]
        ok = st.get("200", 0)
        fives = i["catalogue"]["server_errors"]
        fours = i["catalogue"]["cases"] - ok - fives
        huge = i["body_100_mib"]
        big = ", ".join(f"{v['status']} (+{v['rss_growth_mib']} MiB)" for v in huge.values())
        lines.append(
            f"| {i['stage']} | {i['catalogue']['cases']} | {ok} / {fours} / {fives} | {big} "
            f"| {i['fuzz']['requests']} | {len(i['fuzz']['failures'])} |"
        )
    lines += [
        "<!-- --8<-- [end:inputs] -->",
        "",
        "<!-- --8<-- [start:slow] -->",
        "| stage | slow bodies: answers (after) | slow headers still open | "
        "ordinary requests meanwhile: 200s | their p50 (alone) |",
        "|---|---|---|---|---|",
    ]
    for i in report["inputs"]:
        sc = i["slow_clients"]
        answers = ", ".join(f"{n} x {status}" for status, n in sorted(sc["body_statuses"].items()))
        first, last = sc["body_answered_after_s"]
        still_open = f"{sc['headers_still_open']}/{sc['slow_headers']}"
        ordinary = f"{sc['ordinary_ok']}/{sc['ordinary']}"
        p50 = f"{sc['ordinary_p50_ms']} ms ({sc['baseline_p50_ms']} ms)"
        lines.append(f"| {i['stage']} | {answers} ({first}-{last} s) | {still_open} | {ordinary} | {p50} |")
    lines += [
        "<!-- --8<-- [end:slow] -->",
        "",
        "<!-- --8<-- [start:faults] -->",
        "| fault | stage | requests under the fault | failed or lost | notes |",
        "|---|---|---|---|---|",
    ]
    f = report["faults"]
    for r in f["redis_kill_restart"]:
        lines.append(
            f"| Redis SIGKILLed, restarted | {r['stage']} "
            f"| {r['requests']} ({r['during_outage']} while down) "
            f"| {r['failed']} | {r['redis_errors']} Redis errors absorbed; {r['redis_hits_after_restart']} "
            "hits after restart |"
        )
    for r in f["sigterm"]:
        after = ", ".join(f"{n} {k}" for k, n in sorted(r["after_sigterm"].items()))
        lines.append(
            f"| SIGTERM with {r['burst']} requests admitted | {r['stage']} | {r['burst']} "
            f"| {r['lost']} | drained in {r['drain_seconds']} s; later requests: {after} |"
        )
    for r in f["sigterm_redis_dies"]:
        lines.append(
            f"| SIGTERM with {r['burst']} requests admitted, then Redis SIGKILLed mid-drain | {r['stage']} "
            f"| {r['burst']} | {r['lost']} | drained in {r['drain_seconds']} s; "
            + (
                "the tier logged the dead Redis and failed open |"
                if r["redis_failure_logged"]
                else "no Redis failure seen |"
            )
        )
    for r in f["sigkill_restart"]:
        lines.append(
            f"| SIGKILL, restart | {r['stage']} | {r['requests_during_kill']} | n/a (killed) "
            f"| ready again in {r['ready_after_restart_s']} s; {r['cache_hits_after_restart']}/{r['texts']} "
            "texts still cached (Redis) |"
        )
    lines.append("<!-- --8<-- [end:faults] -->")
    lines += _cases_table(report)
    return "\n".join(lines) + "\n"


def _cases_table(report: dict[str, Any]) -> list[str]:
    """One row per hand-written case: what each stage answered, and what the contract allows."""
    expect = {c.name: "/".join(map(str, sorted(c.expect))) for c in cases()}
    stages = [i["stage"] for i in report["inputs"]]
    lines = [
        "",
        "<!-- --8<-- [start:cases] -->",
        "| case | allowed | " + " | ".join(s.split("_")[0] for s in stages) + " |",
        "|---|---|" + "---|" * len(stages),
    ]
    for name, allowed in expect.items():
        got = [str(i["catalogue"]["answers"].get(name, "-")) for i in report["inputs"]]
        lines.append(f"| {name} | {allowed} | " + " | ".join(got) + " |")
    lines.append("<!-- --8<-- [end:cases] -->")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--examples", type=int, default=100, help="schemathesis examples per operation and mode"
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs/results/reliability.json")
    args = parser.parse_args(argv)
    _stop_children_on_sigterm()
    with tempfile.TemporaryDirectory() as logs:
        report = run(args.examples, Path(logs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(json.dumps(report["summary"], indent=1))
    s = report["summary"]
    return 0 if s["server_errors"] == s["unexpected_answers"] == s["requests_lost"] == 0 else 1


def _stop_children_on_sigterm() -> None:
    # SIGTERM's default kills this process without unwinding, orphaning the servers it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


if __name__ == "__main__":
    sys.exit(main())
