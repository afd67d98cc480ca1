"""Ray nodes on this machine, started with ``ray start``: a head and workers, each its own
raylet and object store, found again by their processes.

On real machines each node runs the same ``ray start`` on its own host. Here all of them share
one machine and talk over loopback. The node address is 127.0.0.2, not 127.0.0.1: Ray replaces
``127.0.0.1`` and ``localhost`` with the machine's network address (so other machines could
reach it), and these machines may only talk to themselves; any 127.x address is loopback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from deploy.ray.settings import ClusterSettings

NODE_IP = "127.0.0.2"
_RAY = str(Path(sys.executable).with_name("ray"))


def gcs_address(cs: ClusterSettings) -> str:
    return f"{NODE_IP}:{cs.gcs_port}"


# --8<-- [start:ray_start]
def ray_start_command(cs: ClusterSettings, head: bool) -> list[str]:
    """The ``ray start`` line of one node (the head first; each worker joins its GCS)."""
    where = [f"--port={cs.gcs_port}", f"--temp-dir={cs.temp_dir}", "--include-dashboard=false"]
    return [
        _RAY,
        "start",
        *(["--head", *where] if head else [f"--address={gcs_address(cs)}"]),
        f"--node-ip-address={NODE_IP}",
        f"--num-cpus={cs.node_cpus}",  # logical CPUs: one replica reserves one
        f"--object-store-memory={cs.object_store_mb * 2**20}",
        "--disable-usage-stats",
    ]


# --8<-- [end:ray_start]


def start_node(cs: ClusterSettings, head: bool, env: dict[str, str]) -> str:
    """Start one node and return its node id. ``env`` reaches every process of the node (a
    raylet starts its workers, the replicas and the proxy, with its own environment)."""
    before = raylets(cs)
    subprocess.run(
        ray_start_command(cs, head),
        env={**os.environ, **env},
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    new = set(raylets(cs)) - set(before)
    if len(new) != 1:
        raise RuntimeError(f"expected one new raylet after `ray start`, found {sorted(new)}")
    return new.pop()


def raylets(cs: ClusterSettings) -> dict[str, int]:
    """node id -> raylet pid, for the live nodes of this cluster on this machine."""
    found = {}
    for proc in _cluster_processes(cs):
        try:
            if proc.name() != "raylet" or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            args = proc.cmdline()
        except psutil.NoSuchProcess:
            continue
        node = next((a.split("=", 1)[1] for a in args if a.startswith("--node_id=")), None)
        if node is not None:
            found[node] = proc.pid
    return found


def kill_node(cs: ClusterSettings, node_id: str, sig: signal.Signals = signal.SIGKILL) -> int:
    """What a machine crash does to a node: every process of it gets ``sig`` at once (the raylet,
    the replica and the proxy it started, its agents). Returns how many processes were signalled."""
    pid = raylets(cs).get(node_id)
    if pid is None:
        raise LookupError(f"node {node_id[:8]} is not running")
    raylet = psutil.Process(pid)
    return _signal_all([raylet, *raylet.children(recursive=True)], sig)


def stop_all(cs: ClusterSettings) -> int:
    """Kill every process of this cluster (``ray stop --force`` without touching other clusters)."""
    return _signal_all(processes(cs), signal.SIGKILL)


def processes(cs: ClusterSettings) -> list[psutil.Process]:
    """Every process of this cluster: those that name it, and what they started (workers, agents)."""
    found = _cluster_processes(cs)
    for proc in list(found):
        with contextlib.suppress(psutil.NoSuchProcess):
            found += proc.children(recursive=True)
    return list({p.pid: p for p in found}.values())


def _cluster_processes(cs: ClusterSettings) -> list[psutil.Process]:
    """Processes whose command line names this cluster's session folder or GCS address."""
    marks = (str(cs.temp_dir), gcs_address(cs))
    found = []
    for proc in psutil.process_iter():
        try:
            args = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if any(mark in args for mark in marks) and proc.pid != os.getpid():
            found.append(proc)
    return found


def _signal_all(procs: list[psutil.Process], sig: signal.Signals) -> int:
    unique = {p.pid: p for p in procs}
    sent = 0
    for proc in unique.values():
        try:
            proc.send_signal(sig)
            sent += 1
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(unique.values()), timeout=10)
    return sent
