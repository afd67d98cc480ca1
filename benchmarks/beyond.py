"""`make results ONLY=beyond`: four ways to serve stage 5 on this machine, in one run (docs/beyond.md).

    python -m benchmarks.beyond            # about 4 minutes
    python -m benchmarks.beyond --quick    # about 3 minutes: the cluster's start-up is most of it

One after the other (never side by side on 2 cores), each started as a reader starts it, all with
the same small queue and one private Redis tier (CACHE_URL):

* ``stage5``: ``make stage5``, one process;
* ``workers`` (c): ``WORKERS=2 make stage5``, two uvicorn workers on one socket, a model each;
* ``whole`` (a): ``make cluster``, two Ray nodes, one replica of the whole stage 5 on each;
* ``composed`` (b): ``deploy/ray/composed.yaml`` deployed on the same nodes: an ingress and a
  ``@serve.batch`` model deployment on each node, called through a handle.

Each answers, with wrk and one new mixed-length text per request (no cache hit): p50 at one connection;
capacity at 32 connections, with the CPU each process spent a request (by role: Ray's proxy, the
process that answers, Ray's model replica, the rest) and each process's memory (RSS); a flood of
200 connections against the small queue. Ray's processes are found by Ray's state API.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import yaml

from loadtests import evidence
from loadtests.load import bodies_for, settle, wrk
from loadtests.procs import free_port, redis_server, running_stage
from loadtests.tables import num, page, table

REPO = evidence.REPO
SETUPS = ("stage5", "workers", "whole", "composed")
LABELS = {"stage5": "stage 5", "workers": "(c) workers", "whole": "(a) whole", "composed": "(b) composed"}
MAX_QUEUE = 64  # texts one server (a worker, a replica, an ingress) holds before refusing
CAPACITY_CLIENTS, FLOOD_CLIENTS, WORKERS = 32, 200, 2
SERVER_ENV = {"MAX_QUEUE": str(MAX_QUEUE), "LOG_LEVEL": "WARNING"}
# Serve hands a replica more than it admits, and Ray's proxy queue holds a request a client: every
# refusal is then the server's own (deploy/ray/serve.yaml says why).
RAY_ARGS = {"max_ongoing_requests": 4 * MAX_QUEUE, "max_queued_requests": FLOOD_CLIENTS + 56}
CONFIGS = {"whole": REPO / "deploy/ray/serve.yaml", "composed": REPO / "deploy/ray/composed.yaml"}
ROLES = ("proxy", "front", "model", "rest")  # front: the process that answers HTTP (in (b) only, no model)


# --- the setups: a URL and the processes of each role ------------------------------------------
Roles = dict[str, list[psutil.Process]]


@contextmanager
def stage5(logs: Path, redis_url: str, workers: int) -> Iterator[tuple[str, Any]]:
    env = {**SERVER_ENV, "CACHE_URL": redis_url, "WORKERS": str(workers)}
    with running_stage("stage5_metrics", logs, env) as server:
        settle(server.pid, server.url)  # every worker's model loaded, not only the first one's
        top = psutil.Process(server.pid)

        def roles() -> Roles:  # a worker is a multiprocessing child; the supervisor only watches them
            kids = top.children()
            front = [p for p in kids if "spawn_main" in " ".join(p.cmdline())] or [top]
            rest = [p for p in [top, *kids] if p not in front]
            return {"front": front, **({"rest": rest} if rest else {})}

        yield server.url, roles


@contextmanager
def cluster(logs: Path, redis_url: str) -> Iterator[tuple[str, dict[str, str]]]:
    """``make cluster`` with the whole design's config, on free ports; ``make cluster-down`` after."""
    env = {
        **os.environ, **SERVER_ENV, "CACHE_URL": redis_url, "HOST": "127.0.0.1", "PORT": str(free_port()),
        "CLUSTER_GCS_PORT": str(free_port()), "CLUSTER_DASHBOARD_PORT": str(free_port()),
        "CLUSTER_TEMP_DIR": "/tmp/ray-esbench", "CLUSTER_STATE_FILE": str(logs / "cluster-state.json"),
        "CLUSTER_CONFIG": str(config(logs, "whole")),
    }  # fmt: skip
    up = subprocess.run(["make", "cluster"], cwd=REPO, env=env, capture_output=True, text=True)
    try:
        if up.returncode != 0:
            raise RuntimeError(f"make cluster failed:\n{up.stdout[-2000:]}\n{up.stderr[-2000:]}")
        yield f"http://127.0.0.1:{env['PORT']}", env
    finally:
        subprocess.run(["make", "cluster-down"], cwd=REPO, env=env, capture_output=True, text=True)


def config(logs: Path, design: str) -> Path:
    """The design's Serve config file, with the benchmark's queue sizes."""
    data = yaml.safe_load(CONFIGS[design].read_text())
    data["applications"][0]["args"].update(RAY_ARGS)
    path = logs / f"{design}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def redeploy(env: dict[str, str], logs: Path, design: str) -> None:
    command = [sys.executable, "-m", "deploy.ray.cluster", "redeploy"]
    subprocess.run(command, cwd=REPO, env={**env, "CLUSTER_CONFIG": str(config(logs, design))}, check=True)


def ray_roles(env: dict[str, str]) -> Roles:
    """Every process of the nodes (each `ray start` and all it started), each actor's role from Ray's
    state API (the proxy, the replicas; the rest: raylets, GCS, dashboard, agents, controller)."""
    from ray.util.state import list_actors

    address = f"http://127.0.0.2:{env['CLUSTER_DASHBOARD_PORT']}"
    role = {}
    for actor in list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=1000):
        name = actor.class_name
        if name == "ProxyActor" or name.startswith("ServeReplica"):
            role[actor.pid] = (
                "proxy" if name == "ProxyActor" else "model" if name.endswith(":model") else "front"
            )
    state = json.loads(Path(env["CLUSTER_STATE_FILE"]).read_text())
    out: Roles = {}
    for pid in state["nodes"].values():
        node = psutil.Process(pid)
        for proc in [node, *node.children(recursive=True)]:
            out.setdefault(role.get(proc.pid, "rest"), []).append(proc)
    return out


# --- what is measured ----------------------------------------------------------------------------
def cpu(roles: Roles) -> dict[str, float]:
    """CPU seconds so far of each role's processes (one process each, not its children)."""
    out = dict.fromkeys(roles, 0.0)
    for role, procs in roles.items():
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                out[role] += times.user + times.system
    return out


def rss_mb(roles: Roles) -> dict[str, float]:
    """Resident memory: one process of each role on average (MB), and all the setup's together."""
    sizes: dict[str, list[int]] = {}
    for role, procs in roles.items():
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                sizes.setdefault(role, []).append(proc.memory_info().rss)
    out = {role: round(sum(s) / len(s) / 2**20, 1) for role, s in sizes.items() if role in ("front", "model")}
    return {**out, "all": round(sum(sum(s) for s in sizes.values()) / 2**20, 1)}


def measure(url: str, find: Any, seconds: float, seed: int) -> dict[str, Any]:
    """Warm-up, capacity at 32 connections (with CPU and memory), p50 at one, then the flood."""
    wrk(url, bodies_for("mixed", 1500, seed), CAPACITY_CLIENTS, min(2.0, seconds))
    roles = find()
    before = cpu(roles)
    # More texts than the fastest setup answers in the interval: wrk cycles its bodies, and a text
    # sent twice would be a cache hit (each worker of (c) keeps a cache of its own).
    cap = wrk(url, bodies_for("mixed", int(2000 * seconds), seed + 1), CAPACITY_CLIENTS, seconds)
    used, served = cpu(roles), cap["requests_per_s"] * max(1, math.ceil(seconds))  # wrk's whole seconds
    cap["cpu_ms"] = {r: round(1e3 * (used[r] - before[r]) / max(served, 1), 2) for r in roles}
    cap["cpu_ms"]["total"] = round(sum(cap["cpu_ms"].values()), 2)
    cap["rss_mb"], cap["processes"] = rss_mb(roles), {r: len(p) for r, p in roles.items()}
    time.sleep(1)  # the last answers of the closed loop
    one = wrk(url, bodies_for("mixed", int(200 * seconds), seed + 2), 1, seconds)
    flood = wrk(url, bodies_for("mixed", int(3000 * seconds), seed + 3), FLOOD_CLIENTS, seconds)
    rps = cap["requests_per_s"]
    flood["of_capacity"] = round(flood["requests_per_s"] / rps, 4) if rps else None
    return {"capacity": cap, "one": one, "flood": flood}


def run_all(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with redis_server() as redis:
        for i, name in enumerate(s for s in args.setups if s in ("stage5", "workers")):
            print(f"{name}: measuring", flush=True)
            with stage5(logs, redis.url, WORKERS if name == "workers" else 1) as (url, find):
                out[name] = measure(url, find, args.duration, 1000 * (i + 1))
        designs = [s for s in args.setups if s in ("whole", "composed")]
        if designs:
            with cluster(logs, redis.url) as (url, env):
                for i, name in enumerate(designs):
                    if name != "whole":
                        redeploy(env, logs, name)
                    print(f"{name}: measuring", flush=True)
                    out[name] = measure(url, lambda env=env: ray_roles(env), args.duration, 5000 + 1000 * i)
    return {name: out[name] for name in args.setups}


# --- the page ------------------------------------------------------------------------------------
def _ranked(values: dict[str, float], most: bool) -> list[str]:
    """The setups from the best to the worst (the most, or the least)."""
    return sorted(values, key=values.__getitem__, reverse=most)


def _against(values: dict[str, float], most: bool, unit: str, digits: int) -> str:
    """The best one's value, then each other one, best first, as a multiple of it."""
    best, *rest = _ranked(values, most)
    others = "; ".join(f"{LABELS[n]} {values[n] / values[best]:.2f}× that" for n in rest)
    return f"{LABELS[best]}, {num(values[best], digits)} {unit}" + (f"; {others}." if others else ".")


def verdict(s: dict[str, Any]) -> list[str]:
    """When each wins, in sentences generated from the numbers (every word beside its ratio)."""
    cap = {n: r["capacity"]["requests_per_s"] for n, r in s.items()}
    p50 = {n: r["one"]["p50_ms"] for n, r in s.items()}
    lines = [
        "In this one run, one point a setup (no rounds: read a gap under 10% as noise):",
        "",
        f"- **Capacity** (32 connections), the most: {_against(cap, True, 'req/s', 0)}",
        f"- **Latency** (one connection), the lowest p50: {_against(p50, False, 'ms', 1)}",
    ]
    alone = s["stage5"]["capacity"]["cpu_ms"]["total"] if "stage5" in s else None
    for n in ("workers", "whole", "composed"):
        ms = s.get(n, {}).get("capacity", {}).get("cpu_ms")
        if ms and alone:
            proxy = f"; Ray's proxy alone {num(ms.get('proxy'), 1)} ms" if "proxy" in ms else ""
            total = (
                f"{num(ms['total'], 1)} ms, {ms['total'] / alone:.2f}× plain stage 5's"
                f" {num(alone, 1)} ms in this run"
            )
            lines.append(f"- **CPU a request**, {LABELS[n]}: {total}{proxy}.")
    mem = {n: r["capacity"]["rss_mb"]["all"] for n, r in s.items()}
    lines.append(f"- **Memory**, all processes, the least: {_against(mem, False, 'MB', 0)}")
    ok = {n: r["flood"]["requests_per_s"] for n, r in s.items()}
    flood = f"- **Flood** ({FLOOD_CLIENTS} connections, MAX_QUEUE={MAX_QUEUE}), the most answered with 200"
    lines.append(f"{flood}: {_against(ok, True, 'a second', 0)}")
    kept = {n: r["flood"]["of_capacity"] or 0.0 for n, r in s.items()}
    shares = ", ".join(f"{LABELS[n]} {kept[n]:.0%}" for n in _ranked(kept, True))
    errors = {n: r["flood"]["socket_errors"] for n, r in s.items()}
    lost = ", ".join(f"{LABELS[n]} {e}" for n, e in errors.items() if e)
    lines.append(
        f"- **Flood against capacity**, 200s a second as a share of its own at {CAPACITY_CLIENTS}"
        f" connections: {shares}"
        + (f"; no answer within wrk's 2 s (socket errors): {lost}." if lost else ".")
    )
    if "whole" in cap and "composed" in cap:
        ratio = cap["composed"] / cap["whole"]
        lines.append(
            f"- **(b) against (a)** on one machine: {ratio:.2f}× the capacity, so (b)"
            f" {'wins' if ratio >= 1.1 else 'loses' if ratio <= 1 / 1.1 else 'is within noise of (a)'} here;"
            " what it buys is elsewhere: its model and its"
            " HTTP side scale each on its own, on machines of their own."
        )
    return lines


def markdown(result: dict[str, Any]) -> str:
    s = result["setups"]
    base = s.get("stage5", {}).get("capacity", {}).get("requests_per_s")
    capacity, cost, flood = [], [], []
    for n, r in s.items():
        c, f, one = r["capacity"], r["flood"], r["one"]
        of = f"{c['requests_per_s'] / base:.2f}×" if base else "–"
        capacity.append(
            [LABELS[n], num(c["requests_per_s"], 0), of, num(one["p50_ms"], 1), num(c["p99_ms"], 1)]
        )
        ms, mb, count = c["cpu_ms"], c["rss_mb"], c["processes"]
        model = f"{num(mb['model'], 0)} (×{count['model']})" if "model" in mb else "–"
        cpu_cells = [num(ms.get(role), 2) for role in ROLES]
        front = f"{num(mb['front'], 0)} (×{count['front']})"
        cost.append([LABELS[n], num(ms["total"], 2), *cpu_cells, front, model, num(mb["all"], 0)])
        share = f"{100 * (f['of_capacity'] or 0):.0f} %"
        flood.append(
            [LABELS[n], num(f["requests_per_s"], 0), share, num(f["non_2xx_per_s"], 0), f["socket_errors"]]
        )
    sections = {
        "capacity": table(
            ["setup", "req/s, 32 conn.", "of stage 5", "p50 ms, 1 conn.", "p99 ms, 32 conn."], capacity
        ),
        "cost": table(
            ["setup", "CPU ms/request", *ROLES, "MB a front process", "MB a model process", "MB in all"], cost
        ),
        "flood": table(["setup", "200s/s", "of capacity", "refusals/s", "socket errors"], flood),
        "verdict": verdict(s),
    }
    note = (
        f"One new mixed-length text (query, sentence or passage) per request (no cache hit), wrk,"
        f" {result['duration_s']:g} s a point."
        f" MAX_QUEUE={MAX_QUEUE} texts a server (a worker, a replica, an ingress); {WORKERS} workers in (c);"
        f" Ray's proxy queue {RAY_ARGS['max_queued_requests']},"
        f" max_ongoing_requests {RAY_ARGS['max_ongoing_requests']} (the shipped files: 2048)."
        f" CPU by role: proxy (Ray's); front, the"
        " process that answers HTTP (stage 5, a worker, a replica of (a), an ingress of (b)), which runs"
        " the model too except in (b); model, a model replica of (b); rest, Ray's other processes or the"
        " parent process that watches the workers. RSS counts shared pages in every process. Ray's nodes,"
        " wrk and Redis share the cores."
    )
    return page(result["stamp"], sections, note) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, help="Seconds a point (default 8; quick 3).")
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    parser.add_argument("--out", type=Path, help="Folder for beyond.json and .md.")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.beyond", args, argv)
    args.duration = args.duration or (3.0 if args.quick else 8.0)
    started = time.monotonic()
    setups = run_all(args, run.logs("beyond"))
    result = {"stamp": run.stamp(SERVER_ENV), "duration_s": args.duration, "setups": setups,
              "max_queue": MAX_QUEUE, "workers": WORKERS, "ray_args": RAY_ARGS,
              "seconds": round(time.monotonic() - started, 1)}  # fmt: skip
    evidence.publish(run, "beyond", result, markdown, args.out)


if __name__ == "__main__":
    main()
