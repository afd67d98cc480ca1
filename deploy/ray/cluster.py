"""Start, inspect, break and stop the local two-node cluster (what ``make cluster`` runs).

    python -m deploy.ray.cluster up          # ray start (head, workers), deploy, wait for every replica
    python -m deploy.ray.cluster status      # nodes, replicas, the address
    python -m deploy.ray.cluster targets     # every replica's /metrics, for Prometheus (file_sd)
    python -m deploy.ray.cluster kill-node   # SIGKILL a worker node: a machine crash
    python -m deploy.ray.cluster add-node    # a worker joins again; Serve puts a replica back
    python -m deploy.ray.cluster redeploy    # the deployment again with this environment's settings
    python -m deploy.ray.cluster down        # stop Serve (drain), then every process of the cluster

The settings are ``CLUSTER_*`` (``deploy/ray/settings.py``), HOST and PORT, and every stage
setting (CACHE_URL, MAX_QUEUE, ...), handed to each replica.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from common.settings import REPO_ROOT, get_settings
from deploy.ray import nodes
from deploy.ray.settings import ClusterSettings


def node_env() -> dict[str, str]:
    """What every process of a node gets: the repository on the path, the proxy's middleware."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "PYTHONPATH": path,
        "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "deploy.ray.proxy.middlewares",
        # The proxy would send everything to the replica on its own node until that one is full;
        # spread instead (Ray's power of two choices): the worker's replica is no overflow tank.
        "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }


@contextmanager
def connected(cs: ClusterSettings) -> Iterator[None]:
    """A Ray driver in this process, for as long as a command needs it."""
    import ray

    ray.init(
        address=nodes.gcs_address(cs),
        _node_ip_address=nodes.NODE_IP,
        logging_level=logging.ERROR,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


# --8<-- [start:up]
def up(cs: ClusterSettings, timeout: float = 300.0) -> dict[str, Any]:
    """Start the nodes, deploy stage 5 with one replica per node, wait until every replica answers."""
    from ray import serve

    from deploy.ray.app import APP_NAME, application

    if nodes.raylets(cs):
        raise SystemExit("a cluster is already running here: `make cluster-down` first")
    settings = get_settings()
    started = time.monotonic()
    ids = []
    for i in range(cs.nodes):
        print("$ ray", shlex.join(nodes.ray_start_command(cs, head=i == 0)[1:]), flush=True)
        ids.append(nodes.start_node(cs, head=i == 0, env=node_env()))
    print(f"{len(ids)} nodes up in {time.monotonic() - started:.1f} s (head {ids[0][:8]})", flush=True)
    with connected(cs):
        # One proxy, on the head: the single entry point (a worker's loss never takes it away).
        serve.start(
            proxy_location="HeadOnly",
            http_options={
                "host": settings.host,
                "port": settings.port,
                "request_timeout_s": cs.proxy_timeout_s,  # a request queued in the proxy ends too
            },
        )
        serve.run(application(cs, settings), name=APP_NAME, route_prefix="/", blocking=False)
        url = f"http://{settings.host}:{settings.port}"
        wait_running(cs.replicas, timeout - (time.monotonic() - started))
        names = wait_replicas(url, cs.replicas, 60.0)
    state = {"url": url, "gcs": nodes.gcs_address(cs), "nodes": ids, "replicas": sorted(names)}
    cs.state_file.parent.mkdir(parents=True, exist_ok=True)
    cs.state_file.write_text(json.dumps(state, indent=2))
    print(f"serving on {url}: {len(names)} replicas {sorted(names)} in {time.monotonic() - started:.1f} s")
    if settings.cache_url is None:
        print("CACHE_URL is not set: each replica caches alone (CACHE_URL=redis://... to share one tier)")
    return state


# --8<-- [end:up]


def running_replicas() -> int:
    from ray import serve

    from deploy.ray.app import APP_NAME

    app = serve.status().applications.get(APP_NAME)
    if app is None:
        return 0
    return sum(n for d in app.deployments.values() for s, n in d.replica_states.items() if s == "RUNNING")


def wait_running(count: int, timeout: float) -> None:
    """Until Serve reports ``count`` replicas RUNNING (each has loaded and warmed its model)."""
    deadline = time.monotonic() + timeout
    while running_replicas() < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{running_replicas()} of {count} replicas running after {timeout:.0f} s")
        time.sleep(0.5)


def wait_replicas(url: str, count: int, timeout: float) -> set[str]:
    """Until ``count`` different replicas have answered /ready (the proxy spreads the probes)."""
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            try:
                r = client.get(f"{url}/ready")
                if r.status_code == 200 and "x-served-by" in r.headers:
                    seen.add(r.headers["x-served-by"])
                    if len(seen) >= count:
                        return seen
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"only {len(seen)} of {count} replicas answered {url}/ready in {timeout:.0f} s")


def redeploy(cs: ClusterSettings, timeout: float = 180.0) -> None:
    """Deploy again with the settings of this environment (queue, replicas, ...), nodes kept.

    Serve replaces the replicas one by one; the proxy's own options (HOST, PORT,
    CLUSTER_PROXY_TIMEOUT_S) stay as `up` set them.
    """
    from ray import serve

    from deploy.ray.app import APP_NAME, application

    with connected(cs):
        serve.run(application(cs, get_settings()), name=APP_NAME, route_prefix="/", blocking=False)
        wait_running(cs.replicas, timeout)
        # the old replicas are gone once only the new count runs
        deadline = time.monotonic() + timeout
        while serve.status().applications[APP_NAME].status != "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.5)
    print(f"redeployed: {cs.replicas} replicas")


def down(cs: ClusterSettings) -> int:
    """Stop Serve first (each replica drains, as on SIGTERM), then every process of the cluster."""
    if nodes.raylets(cs):
        try:
            from ray import serve

            with connected(cs):
                serve.shutdown()
        except Exception as exc:  # a broken cluster is still stopped below
            print(f"serve.shutdown failed ({exc}); killing the processes", file=sys.stderr)
    killed = nodes.stop_all(cs)
    cs.state_file.unlink(missing_ok=True)
    targets_file(cs).unlink(missing_ok=True)
    print(f"cluster down: {killed} processes stopped")
    return killed


def targets(cs: ClusterSettings) -> list[dict[str, Any]]:
    """Every live replica's /metrics address, written as a Prometheus file_sd file."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    from deploy.ray.app import KV_NAMESPACE

    with connected(cs):
        keys = _internal_kv_list("metrics/", namespace=KV_NAMESPACE)
        found = [json.loads(_internal_kv_get(k, namespace=KV_NAMESPACE) or b"{}") for k in keys]
    live = [t for t in found if t and _answers(f"http://{t['targets'][0]}/metrics")]
    targets_file(cs).parent.mkdir(parents=True, exist_ok=True)
    targets_file(cs).write_text(json.dumps(live, indent=2))
    return live


def targets_file(cs: ClusterSettings) -> Path:
    """Prometheus' file_sd list of replicas, beside the state file (deploy/ray/prometheus.yml reads it)."""
    return cs.state_file.with_name("targets.json")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code < 500
    except httpx.TransportError:
        return False  # a replica of a killed node: its key outlived it


def status(cs: ClusterSettings) -> dict[str, Any]:
    state = json.loads(cs.state_file.read_text()) if cs.state_file.exists() else {}
    live = nodes.raylets(cs)
    out = {**state, "live_nodes": sorted(live), "head": state.get("nodes", [None])[0]}
    if live:
        with connected(cs):
            out["replicas_running"] = running_replicas()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    commands = ["up", "down", "status", "targets", "kill-node", "add-node", "redeploy"]
    parser.add_argument("command", choices=commands)
    args = parser.parse_args(argv)
    cs = ClusterSettings()
    if args.command == "up":
        try:
            up(cs)
        except BaseException:
            print("the cluster did not come up; `make cluster-down` stops what started", file=sys.stderr)
            raise
        print(f"{len(targets(cs))} replica /metrics written to {_rel(targets_file(cs))}")
    elif args.command == "down":
        down(cs)
    elif args.command == "status":
        print(json.dumps(status(cs), indent=2))
    elif args.command == "targets":
        print(json.dumps(targets(cs), indent=2))
    elif args.command == "kill-node":
        head = status(cs)["head"]
        workers = [n for n in nodes.raylets(cs) if n != head]
        if not workers:
            raise SystemExit("no worker node is running")
        print(f"killed node {workers[0][:8]}: {nodes.kill_node(cs, workers[0])} processes (SIGKILL)")
    elif args.command == "redeploy":
        redeploy(cs)
    elif args.command == "add-node":
        print(f"node {nodes.start_node(cs, head=False, env=node_env())[:8]} joined")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


if __name__ == "__main__":
    main()
