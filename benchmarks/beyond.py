"""`make results ONLY=beyond`: stage 5 on the Ray cluster against plain stage 5, here (docs/beyond.md).

    python -m benchmarks.beyond            # about 6 minutes
    python -m benchmarks.beyond --quick    # about 3 minutes, seconds per point
    python -m benchmarks.beyond --record   # written to docs/results/beyond.json and .md

Three setups, one after the other (never side by side on 2 cores), each started as a reader
starts it (``make stage5``, ``make cluster``) with the same small queue:

* ``stage5``: one process;
* ``ray-1``: one Ray node, one replica (the proxy in front of it);
* ``ray-2``: two Ray nodes on this machine, one replica each.

For each, two measurements with the light load kit (``loadtests.httpload``), one new sentence per
request so no cache answers:

1. capacity: a closed loop of 32 connections: requests/s, p50/p99, and the CPU every process of
   the setup used per request (for the cluster: replicas, proxy, and the rest of Ray);
2. a flood of 200 connections: the 200s per second as a share of that capacity (goodput), with
   clients that send again at once after a refusal, and clients that wait its Retry-After.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import psutil
import yaml

from common.corpus import texts as corpus_texts
from loadtests import evidence
from loadtests.httpload import closed_loop, percentile_ms, post_requests
from loadtests.procs import free_port, running_stage
from loadtests.tables import num, page, table

REPO = evidence.REPO
MAX_QUEUE = 64  # texts one server (one replica) holds before refusing: small against 200 connections
# Requests Serve hands one replica: more than it admits (its queue, a batch, those being read), so
# the replica's own queue refuses first, as deploy/ray/serve.yaml has it.
REPLICA_ROOM = 4 * MAX_QUEUE
CAPACITY_CLIENTS = 32
FLOOD_CLIENTS = 200
# Requests Ray's proxy holds while it picks a replica (serve.yaml's max_queued_requests). Past it
# Ray refuses by itself, in plain text, even with room in the replicas (a burst waits there for a
# moment); as many as there are clients, so that never happens and every refusal is a replica's.
PROXY_QUEUE = FLOOD_CLIENTS
TEMP_DIR = Path("/tmp/ray-esbench")
SETUPS = ("stage5", "ray-1", "ray-2")
SERVER_ENV = {"MAX_QUEUE": str(MAX_QUEUE), "LOG_LEVEL": "WARNING"}


# --- the setups -----------------------------------------------------------------------------------
@contextmanager
def setup(name: str, logs: Path) -> Iterator[tuple[int, list[psutil.Process]]]:
    """Start one setup; yield its port and a way to find all its processes."""
    if name == "stage5":
        with running_stage("stage5_metrics", logs, SERVER_ENV) as server:
            yield server.port, [psutil.Process(server.pid)]
        return
    replicas = int(name.split("-")[1])
    port = free_port()
    config = yaml.safe_load((REPO / "deploy" / "ray" / "serve.yaml").read_text())
    args = {"replicas": replicas, "max_ongoing_requests": REPLICA_ROOM, "max_queued_requests": PROXY_QUEUE}
    config["applications"][0]["args"].update(args)
    (logs / f"{name}-serve.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    env = {
        **os.environ,
        **SERVER_ENV,
        "HOST": "127.0.0.1",
        "PORT": str(port),
        "CLUSTER_NODES": str(replicas),
        "CLUSTER_CONFIG": str(logs / f"{name}-serve.yaml"),
        "CLUSTER_GCS_PORT": str(free_port()),
        "CLUSTER_DASHBOARD_PORT": str(free_port()),
        "CLUSTER_TEMP_DIR": str(TEMP_DIR),
        "CLUSTER_STATE_FILE": str(logs / f"{name}-state.json"),
    }
    up = subprocess.run(["make", "cluster"], cwd=REPO, env=env, capture_output=True, text=True)
    try:
        if up.returncode != 0:
            raise RuntimeError(f"make cluster failed:\n{up.stdout[-2000:]}\n{up.stderr[-2000:]}")
        yield port, cluster_processes(str(TEMP_DIR), f"127.0.0.2:{env['CLUSTER_GCS_PORT']}")
    finally:
        subprocess.run(["make", "cluster-down"], cwd=REPO, env=env, capture_output=True, text=True)


def cluster_processes(*marks: str) -> list[psutil.Process]:
    """Every process of the cluster: those whose command line names its session folder or GCS
    address, and what they started (Ray renames its workers `ray::...`)."""
    found = {}
    for proc in psutil.process_iter():
        try:
            if any(mark in " ".join(proc.cmdline()) for mark in marks):
                found[proc.pid] = proc
                found.update({child.pid: child for child in proc.children(recursive=True)})
        except psutil.Error:
            continue
    return list(found.values())


def _role(proc: psutil.Process) -> str:
    try:
        title = " ".join(proc.cmdline())
    except psutil.Error:
        return "gone"
    if "ServeReplica" in title or "stage5" in title:
        return "replicas"
    if "ProxyActor" in title:
        return "proxy"
    return "ray"


class CpuMeter:
    """CPU seconds of a set of processes between two readings, by role."""

    def __init__(self, procs: list[psutil.Process]) -> None:
        self.procs = procs
        self.start = self._read()

    def _read(self) -> dict[int, tuple[str, float]]:
        out = {}
        for proc in self.procs:
            try:
                t = proc.cpu_times()
                out[proc.pid] = (_role(proc), t.user + t.system + t.children_user + t.children_system)
            except psutil.Error:
                continue
        return out

    def used(self) -> dict[str, float]:
        end, by_role = self._read(), dict[str, float]()
        for pid, (role, cpu) in end.items():
            if pid in self.start:
                by_role[role] = by_role.get(role, 0.0) + cpu - self.start[pid][1]
        return by_role


# --- the loads ------------------------------------------------------------------------------------
def bodies(n: int, seed: int) -> list[bytes]:
    return [orjson.dumps({"inputs": [t]}) for t in corpus_texts(n, seed=seed, kind="mixed")]


def capacity(port: int, procs: list[psutil.Process], seconds: float, seed: int) -> dict[str, Any]:
    # Every text new to the server, the warm-up's too (other seeds): no answer may be a cache hit.
    # More texts than the fastest setup can send in the time, so no client comes round to one again.
    warmup = post_requests("/v1/embed", bodies(3000, seed + 10_000))
    requests = post_requests("/v1/embed", bodies(int(2000 * seconds), seed))
    asyncio.run(closed_loop("127.0.0.1", port, warmup, CAPACITY_CLIENTS, seconds=min(3.0, seconds)))
    meter, me = CpuMeter(procs), psutil.Process()
    client_cpu = sum(me.cpu_times()[:2])
    answers = asyncio.run(closed_loop("127.0.0.1", port, requests, CAPACITY_CLIENTS, seconds=seconds))
    used = meter.used()
    ok = [a.ms for a in answers if a.status == 200]
    cpu = sum(used.values())
    return {
        "requests_per_s": round(len(ok) / seconds, 1),
        "p50_ms": percentile_ms(ok, 50),
        "p99_ms": percentile_ms(ok, 99),
        "errors": len(answers) - len(ok),
        "server_cores": round(cpu / seconds, 2),
        "cpu_ms_per_request": round(1e3 * cpu / max(len(ok), 1), 2),
        "cpu_ms_by_role": {k: round(1e3 * v / max(len(ok), 1), 2) for k, v in sorted(used.items())},
        "client_cores": round((sum(me.cpu_times()[:2]) - client_cpu) / seconds, 2),
    }


def flood(port: int, seconds: float, seed: int, polite: bool, capacity_rps: float) -> dict[str, Any]:
    requests = post_requests("/v1/embed", bodies(int(2000 * seconds), seed))
    answers = asyncio.run(
        closed_loop("127.0.0.1", port, requests, FLOOD_CLIENTS, seconds=seconds, honour_retry_after=polite)
    )
    ok = [a.ms for a in answers if a.status == 200]
    statuses: dict[str, int] = {}
    for a in answers:
        statuses[str(a.status)] = statuses.get(str(a.status), 0) + 1
    return {
        "clients": "wait Retry-After" if polite else "send again at once",
        "goodput_per_s": round(len(ok) / seconds, 1),
        "of_capacity": round(len(ok) / seconds / capacity_rps, 4) if capacity_rps else None,
        "refused_per_s": round(sum(v for k, v in statuses.items() if k in ("429", "503")) / seconds, 1),
        "statuses": dict(sorted(statuses.items())),
        "p99_ok_ms": percentile_ms(ok, 99),
    }


def measure(args: argparse.Namespace, run: evidence.Run) -> dict[str, Any]:
    out: dict[str, Any] = {
        "duration_s": args.duration,
        "max_queue": MAX_QUEUE,
        "max_ongoing_requests": REPLICA_ROOM,
        "proxy_queue": PROXY_QUEUE,
        "capacity_clients": CAPACITY_CLIENTS,
        "flood_clients": FLOOD_CLIENTS,
        "setups": {},
    }
    logs = run.logs("beyond")
    for i, name in enumerate(args.setups):
        print(f"{i + 1}/{len(args.setups)} {name}", flush=True)
        with setup(name, logs) as (port, procs):
            cap = capacity(port, procs, args.duration, seed=100 + i)
            rps = cap["requests_per_s"]
            impatient = flood(port, args.duration, 200 + i, polite=False, capacity_rps=rps)
            polite = flood(port, args.duration, 300 + i, polite=True, capacity_rps=rps)
        out["setups"][name] = {"capacity": cap, "flood": [impatient, polite]}
        print(json.dumps(out["setups"][name]), flush=True)
    base = out["setups"].get("stage5", {}).get("capacity", {}).get("requests_per_s")
    for result in out["setups"].values():
        result["capacity"]["over_stage5"] = (
            round(result["capacity"]["requests_per_s"] / base, 4) if base else None
        )
    return out


# --- the page -------------------------------------------------------------------------------------
def markdown(result: dict[str, Any]) -> str:
    setups = result["setups"]
    cap_rows = []
    for name, r in setups.items():
        c = r["capacity"]
        roles = c["cpu_ms_by_role"]
        cap_rows.append((
            name, num(c["requests_per_s"], 0), f"{c['over_stage5']:.2f}×", num(c["p50_ms"], 1),
            num(c["p99_ms"], 1), num(c["cpu_ms_per_request"], 2), num(roles.get("replicas"), 2),
            num(roles.get("proxy"), 2), num(roles.get("ray"), 2), num(c["server_cores"], 2),
        ))  # fmt: skip
    capacity_table = table(
        ["setup", "req/s", "of stage5", "p50 ms", "p99 ms", "CPU ms/request", "replicas", "proxy",
         "rest of Ray", "server cores"],
        cap_rows,
        align="lrrrrrrrrr",
    )  # fmt: skip
    flood_rows = []
    for name, r in setups.items():
        for f in r["flood"]:
            flood_rows.append((
                name, f["clients"], num(f["goodput_per_s"], 0), f"{100 * f['of_capacity']:.0f} %",
                num(f["refused_per_s"], 0), num(f["p99_ok_ms"], 0),
                ", ".join(f"{k}: {v}" for k, v in f["statuses"].items()),
            ))  # fmt: skip
    flood_table = table(
        ["setup", "clients after a refusal", "200s/s", "of capacity", "refusals/s", "p99 of 200s ms",
         "answers"],
        flood_rows,
        align="llrrrrl",
    )  # fmt: skip
    note = (
        f"One new sentence per request, {result['duration_s']:g} s per point. Capacity: a closed loop of"
        f" {result['capacity_clients']} connections. Flood: {result['flood_clients']} connections,"
        f" MAX_QUEUE={result['max_queue']} texts per server (per replica), Ray's proxy queue"
        f" {result['proxy_queue']} requests. Both Ray nodes share this machine's cores with the load"
        " generator."
    )
    return page(result["stamp"], {"capacity": capacity_table, "flood": flood_table}, note) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, help="Seconds per point (default 15; quick 4).")
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    parser.add_argument("--out", type=Path, help="Folder for beyond.json and .md.")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.beyond", args, argv)
    args.duration = args.duration or (4.0 if args.quick else 15.0)
    result = {"stamp": {}, **measure(args, run)}
    result["stamp"] = run.stamp(SERVER_ENV)
    evidence.publish(run, "beyond", result, markdown, args.out)


if __name__ == "__main__":
    main()
