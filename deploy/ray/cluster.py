"""Start, inspect, break and stop the local two-node cluster (what ``make cluster`` runs).

    python -m deploy.ray.cluster up          # ray start (head, workers), serve deploy, Serve's status
    python -m deploy.ray.cluster status      # nodes, replicas, the address
    python -m deploy.ray.cluster kill-node   # SIGKILL a worker node: a machine crash
    python -m deploy.ray.cluster add-node    # a worker joins again; Serve puts a replica back
    python -m deploy.ray.cluster redeploy    # serve deploy the config file again, nodes kept
    python -m deploy.ray.cluster down        # stop Serve (drain), then every node

The nodes' settings are ``CLUSTER_*`` (``deploy/ray/settings.py``); the application is the Serve
config file ``CLUSTER_CONFIG`` (``deploy/ray/serve.yaml``), its proxy on HOST:PORT. Every stage
setting in this environment (CACHE_URL, MAX_QUEUE, ...) reaches every process of the nodes, the
replicas included.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from common.settings import REPO_ROOT, get_settings
from deploy.ray import nodes
from deploy.ray.settings import ClusterSettings

APP_NAME = "embedserve"  # the application's name in serve.yaml
_SERVE = str(Path(sys.executable).with_name("serve"))


def node_env() -> dict[str, str]:
    """What every process of a node gets: the repository on the path, the proxy's middleware, how
    soon a lost node is noticed."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "PYTHONPATH": path,
        "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "deploy.ray.proxy.middlewares",
        # The proxy would send everything to the replica on its own node until that one is full;
        # spread instead (Ray's power of two choices): the worker's replica is no overflow tank.
        "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        # A crashed node is declared dead after this many missed health checks, this far apart;
        # until then a request sent to its replicas waits. Ray's defaults (5 x 3 s) outlast a
        # deadline under 15 s (the cluster tests' is 10 s): the caller got a 504 where a retryable
        # 503 was due.
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_failure_threshold": "3",
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
    """Start the nodes, `serve deploy` the config file, wait until Serve reports it RUNNING."""
    if any(nodes.alive(pid) for pid in read_state(cs).get("nodes", {}).values()):
        raise SystemExit("a cluster is already running here: `make cluster-down` first")
    started = time.monotonic()
    settings = get_settings()
    state: dict[str, Any] = {"url": f"http://{settings.host}:{settings.port}", "gcs": nodes.gcs_address(cs)}
    state["nodes"] = {}  # node id -> pid of its `ray start --block`, the head first
    for i in range(cs.nodes):
        print("$ ray", shlex.join(nodes.ray_start_command(cs, head=i == 0)[1:]), flush=True)
        add_node(cs, state, head=i == 0)
    print(f"{cs.nodes} nodes up in {time.monotonic() - started:.1f} s", flush=True)
    deploy(cs)
    with connected(cs):
        replicas = wait_running(timeout - (time.monotonic() - started))
    print(f"serving on {state['url']}: {replicas} replicas RUNNING in {time.monotonic() - started:.1f} s")
    if settings.cache_url is None:
        print("CACHE_URL is not set: each replica caches alone (CACHE_URL=redis://... to share one tier)")
    return state


def deploy(cs: ClusterSettings) -> None:
    """`serve deploy` of the config file, its proxy on HOST:PORT (the head's dashboard takes it)."""
    settings = get_settings()
    config = yaml.safe_load(cs.config.read_text())
    config.setdefault("http_options", {}).update(host=settings.host, port=settings.port)
    deployed = cs.state_file.with_name("serve.yaml")
    deployed.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [_SERVE, "deploy", str(deployed), "--address", nodes.dashboard_address(cs)]
    print("$ serve", shlex.join(command[1:]), flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def wait_running(timeout: float, deployed_after: float = 0.0) -> int:
    """Until Serve's own status says the application is RUNNING (every replica started, its model
    loaded and warmed); the number of replicas running."""
    from ray import serve

    deadline = time.monotonic() + timeout
    while True:
        app = serve.status().applications.get(APP_NAME)
        if app is not None and app.last_deployed_time_s > deployed_after:
            if app.status == "RUNNING":
                return sum(
                    n for d in app.deployments.values() for s, n in d.replica_states.items() if s == "RUNNING"
                )
            if app.status == "DEPLOY_FAILED":
                raise RuntimeError(f"serve deploy failed: {app.message}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not RUNNING after {timeout:.0f} s: {app}")
        time.sleep(0.5)


# --8<-- [end:up]


def add_node(cs: ClusterSettings, state: dict[str, Any], head: bool = False) -> str:
    """Start one node, learn its id from Ray (``ray.nodes()``), record both in the state file."""
    import ray

    logs = cs.state_file.parent / "nodes"
    pid = nodes.start_node(cs, head, node_env(), logs / f"node-{len(state['nodes'])}.log")
    with connected(cs):
        new = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in state["nodes"]]
    if len(new) != 1:
        raise RuntimeError(f"expected one new node after `ray start`, Ray lists {new}")
    state["nodes"][new[0]] = pid
    cs.state_file.parent.mkdir(parents=True, exist_ok=True)
    cs.state_file.write_text(json.dumps(state, indent=2))
    return str(new[0])


def redeploy(cs: ClusterSettings, timeout: float = 180.0) -> None:
    """`serve deploy` the config file again (``CLUSTER_CONFIG``): Serve replaces the replicas one by one.
    The proxy's own options (HOST, PORT, request_timeout_s) stay as `up` set them."""
    from ray import serve

    with connected(cs):
        before = serve.status().applications[APP_NAME].last_deployed_time_s
        deploy(cs)
        print(f"redeployed: {wait_running(timeout, deployed_after=before)} replicas")


def down(cs: ClusterSettings) -> int:
    """Stop Serve first (each replica drains, as on SIGTERM), then each node, the head last."""
    state = read_state(cs)
    pids = [pid for pid in state.get("nodes", {}).values() if nodes.alive(pid)]
    if pids:
        try:
            from ray import serve

            with connected(cs):
                serve.shutdown()
        except Exception as exc:  # a broken cluster is still stopped below
            print(f"serve.shutdown failed ({exc}); stopping the nodes", file=sys.stderr)
    for pid in reversed(pids):  # the workers, then the head (their GCS)
        nodes.stop_node(pid)
    cs.state_file.unlink(missing_ok=True)
    print(f"cluster down: {len(pids)} nodes stopped")
    return len(pids)


def read_state(cs: ClusterSettings) -> dict[str, Any]:
    return json.loads(cs.state_file.read_text()) if cs.state_file.exists() else {}


def status(cs: ClusterSettings) -> dict[str, Any]:
    state = read_state(cs)
    ids = list(state.get("nodes", {}))
    live = [n for n, pid in state.get("nodes", {}).items() if nodes.alive(pid)]
    out = {**state, "live_nodes": live, "head": ids[0] if ids else None}
    if live:
        from ray import serve

        with connected(cs):
            app = serve.status().applications.get(APP_NAME)
            out["application"] = app.status if app else None
            out["replicas"] = {n: d.replica_states for n, d in app.deployments.items()} if app else {}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    commands = ["up", "down", "status", "kill-node", "add-node", "redeploy"]
    parser.add_argument("command", choices=commands)
    args = parser.parse_args(argv)
    cs = ClusterSettings()
    if args.command == "up":
        try:
            up(cs)
        except BaseException:
            print("the cluster did not come up; `make cluster-down` stops what started", file=sys.stderr)
            raise
        sd = cs.temp_dir / "prom_metrics_service_discovery.json"
        print(f"Prometheus finds every node's metrics in {sd} (deploy/ray/prometheus.yml)")
    elif args.command == "down":
        down(cs)
    elif args.command == "status":
        print(json.dumps(status(cs), indent=2))
    elif args.command == "kill-node":
        state = read_state(cs)
        workers = [(n, pid) for n, pid in list(state.get("nodes", {}).items())[1:] if nodes.alive(pid)]
        if not workers:
            raise SystemExit("no worker node is running")
        node, pid = workers[0]
        replicas = nodes.node_workers(cs, node)
        nodes.kill_node(pid, replicas)
        print(f"killed node {node[:8]}: SIGKILL to its `ray start` (pid {pid}) and its workers {replicas}")
    elif args.command == "redeploy":
        redeploy(cs)
    elif args.command == "add-node":
        print(f"node {add_node(cs, read_state(cs))[:8]} joined")


if __name__ == "__main__":
    main()
