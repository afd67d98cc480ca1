"""Settings of the cluster deployment, read from the environment like ``common.settings``.

Every field is an environment variable ``CLUSTER_<NAME>`` (``CLUSTER_REPLICAS=1 make cluster``).
What each replica does inside (batch size, cache, queue, deadlines) stays in ``common.settings``:
a replica is the stage 5 server, configured the same way, with the same variables.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.settings import REPO_ROOT


class ClusterSettings(BaseSettings):
    """How many replicas, where, and how Ray Serve queues and scales them."""

    model_config = SettingsConfigDict(env_prefix="CLUSTER_", case_sensitive=False, extra="ignore")

    # --- the nodes (`make cluster` starts them on this machine) -----------------
    nodes: int = Field(2, ge=1, description="Ray nodes to start: a head and nodes-1 workers.")
    node_cpus: int = Field(
        1, ge=1, description="Logical CPUs each node offers Ray; one replica takes one (`replica_cpus`)."
    )
    gcs_port: int = Field(6390, description="Port of the head's GCS, the address workers join.")
    temp_dir: Path = Field(
        Path("/tmp/ray-embedserve"), description="Ray's session folder (logs, sockets; short: a socket path)."
    )
    object_store_mb: int = Field(
        100, ge=75, description="Object store per node; requests and answers never go through it."
    )
    state_file: Path = Field(
        REPO_ROOT / "out" / "cluster" / "state.json",
        description="Where `make cluster` writes the nodes' process ids and addresses.",
    )

    # --- the deployment (Ray Serve) ------------------------------------------------
    replicas: int = Field(2, ge=1, description="Replicas of stage 5 (the starting count when autoscaling).")
    replica_cpus: float = Field(1.0, gt=0, description="Logical CPUs one replica reserves.")
    max_replicas_per_node: int = Field(1, ge=1, description="Spread: at most this many replicas a node.")
    max_ongoing_requests: int = Field(
        64,
        ge=1,
        description="Requests the proxy sends one replica at once. Ray's default (5) starves the "
        "batcher: a replica batches only what it holds.",
    )
    max_queued_requests: int = Field(
        256,
        ge=-1,
        description="Requests the proxy holds when every replica is full; more get OVERLOAD_STATUS "
        "with Retry-After (-1: no limit).",
    )
    retry_after_s: float = Field(1.0, ge=0, description="Retry-After on a refusal by the proxy.")
    proxy_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest a request may spend in Ray's proxy, its queue included; past it a 504. "
        "A replica's own deadline (REQUEST_TIMEOUT_S) starts only when the replica takes the request.",
    )
    autoscale: bool = Field(False, description="Scale between min_replicas and replicas on queue length.")
    min_replicas: int = Field(1, ge=0, description="Fewest replicas when autoscaling.")
    target_ongoing_requests: float = Field(
        32, gt=0, description="Autoscaling target: requests in a replica (queued in it or running)."
    )
    metrics_port: int = Field(
        0,
        ge=0,
        description="Port of each replica's own /metrics (0: a free one; with one node a machine, "
        "a fixed port such as 9100 is simpler to scrape). `cluster targets` lists them.",
    )
