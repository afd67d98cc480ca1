"""Ray nodes on this machine, each one ``ray start --block`` process: a head and workers, each with
its own raylet and object store.

``ray start --block`` is how a container runs a Ray node (it is the container's first process):
it stays in the foreground and the node's processes share its fate. SIGTERM drains the node and
stops its processes. SIGKILL to it is half a machine crash: the kernel ends the raylet and agents
it started (Ray starts them with "kill me when my parent dies"), but a worker (a replica) lives on
until it notices its raylet gone, and meanwhile takes requests. So a crash also kills the node's
workers, by the process ids Ray's state API lists for that node. Each node is one process id of our
own and no process is hunted by name. (``ray stop`` would stop every Ray process on the machine,
another cluster's too.)

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
import time
from pathlib import Path

from deploy.ray.settings import ClusterSettings

NODE_IP = "127.0.0.2"
_RAY = str(Path(sys.executable).with_name("ray"))
_STARTED = "Ray runtime started"  # what `ray start` prints once the node is up


def gcs_address(cs: ClusterSettings) -> str:
    return f"{NODE_IP}:{cs.gcs_port}"


def dashboard_address(cs: ClusterSettings) -> str:
    return f"http://{NODE_IP}:{cs.dashboard_port}"


# --8<-- [start:ray_start]
def ray_start_command(cs: ClusterSettings, head: bool) -> list[str]:
    """The ``ray start`` line of one node (the head first, with the dashboard; each worker joins its GCS)."""
    where = [
        f"--port={cs.gcs_port}",
        f"--temp-dir={cs.temp_dir}",
        "--include-dashboard=true",  # `serve deploy`, `serve status`, Prometheus' discovery file
        f"--dashboard-host={NODE_IP}",
        f"--dashboard-port={cs.dashboard_port}",
    ]
    return [
        _RAY,
        "start",
        "--block",  # the node lives as long as this process
        *(["--head", *where] if head else [f"--address={gcs_address(cs)}"]),
        f"--node-ip-address={NODE_IP}",
        f"--num-cpus={cs.node_cpus}",  # logical CPUs: one replica reserves one
        f"--object-store-memory={cs.object_store_mb * 2**20}",
        "--disable-usage-stats",
    ]


# --8<-- [end:ray_start]


def start_node(cs: ClusterSettings, head: bool, env: dict[str, str], log: Path, timeout: float = 120) -> int:
    """Start one node in the background; return its ``ray start --block`` process id once it is up.

    ``env`` reaches every process of the node (a raylet starts its workers, the replicas and the
    proxy, with its own environment)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ray_start_command(cs, head),
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # not in our process group: a Ctrl-C here leaves the node alone
        )
    deadline = time.monotonic() + timeout
    while _STARTED not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"`ray start` did not start a node (see {log}):\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc.pid


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not _zombie(pid)


def node_workers(cs: ClusterSettings, node_id: str) -> list[int]:
    """Process ids of the live actors (replicas, proxy, controller) on a node, as Ray reports them."""
    from ray.util.state import list_actors

    filters: list[tuple[str, str, str | bool | int | float]] = [
        ("node_id", "=", node_id),
        ("state", "=", "ALIVE"),
    ]
    return [a.pid for a in list_actors(address=dashboard_address(cs), filters=filters) if a.pid]


def kill_node(pid: int, workers: list[int] | None = None) -> None:
    """What a machine crash does to a node: SIGKILL at once to its ``ray start`` (so to its raylet and
    agents) and to its ``workers`` (``node_workers``)."""
    for target in (*(workers or []), pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)


def stop_node(pid: int, timeout: float = 60.0) -> None:
    """The node's own shutdown (SIGTERM: drain, then stop its processes); SIGKILL if it takes too long."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            kill_node(pid)
            deadline += 10
        time.sleep(0.2)


def _zombie(pid: int) -> bool:
    """A process that has exited but not been waited for (its parent is the process that started it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return False
