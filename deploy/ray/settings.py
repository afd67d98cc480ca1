"""Settings of the local nodes, read from the environment like ``common.settings``.

Every field is an environment variable ``CLUSTER_<NAME>`` (``CLUSTER_NODES=1 make cluster``).
What runs on the nodes is not here: the Serve application is ``deploy/ray/serve.yaml`` (its
``args`` are ``deploy.ray.app.ClusterArgs``), and what each replica does inside (batch size,
cache, queue, deadlines) stays in ``common.settings``, read from the same variables as any stage.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.settings import REPO_ROOT


class ClusterSettings(BaseSettings):
    """How many Ray nodes `make cluster` starts on this machine, where, and what it deploys on them."""

    model_config = SettingsConfigDict(env_prefix="CLUSTER_", case_sensitive=False, extra="ignore")

    nodes: int = Field(2, ge=1, description="Ray nodes to start: a head and nodes-1 workers.")
    node_cpus: int = Field(
        1, ge=1, description="Logical CPUs each node offers Ray; one replica takes one (`replica_cpus`)."
    )
    gcs_port: int = Field(6390, description="Port of the head's GCS, the address workers join.")
    dashboard_port: int = Field(
        8265, description="Port of the head's dashboard: `serve deploy` and `serve status` talk to it."
    )
    temp_dir: Path = Field(
        Path("/tmp/ray-embedserve"),
        description="Ray's session folder (logs, sockets, Prometheus' service discovery file; short: "
        "a socket path).",
    )
    object_store_mb: int = Field(
        100, ge=75, description="Object store per node; requests and answers never go through it."
    )
    config: Path = Field(
        REPO_ROOT / "deploy" / "ray" / "serve.yaml",
        description="The Serve config file `make cluster` deploys (HOST and PORT set its proxy's address; "
        "deploy/ray/composed.yaml: the ingress-and-model design).",
    )
    state_file: Path = Field(
        REPO_ROOT / "out" / "cluster" / "state.json",
        description="Where `make cluster` writes each node's id and `ray start` process id, and the address.",
    )
