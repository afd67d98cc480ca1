"""Stage 5 as a Ray Serve application: N replicas, each the whole stage 5 server.

A replica builds ``stage5_metrics.app.create_app(settings)``, so everything of stage 5 stays
per replica (batcher, in-process cache, admission, deadlines, metrics); the Redis tier
(CACHE_URL) is shared by all of them. Ray Serve adds what one process cannot: replicas on
several nodes behind one HTTP proxy, restarts of dead replicas, autoscaling on queue length.

The application is a typed builder, so Serve's own commands take it:

    serve run deploy.ray.app:builder replicas=1       # arguments checked by ClusterArgs
    serve deploy deploy/ray/serve.yaml                # the same builder, from the config file
    make cluster                                      # two nodes here, then that config file

Two additions per replica, both for operating a fleet: an ``x-served-by`` header naming the
replica and its node, and stage 5's registry copied into Ray's metrics (``ray.serve.metrics``,
which tags each series with its deployment and replica), so Ray's metrics export on each node
serves every replica's numbers to Prometheus.
"""

# No `from __future__ import annotations` here: Serve reads the builder's annotation as a class.
import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, Field
from ray import serve
from ray.serve.config import BackpressureConfig
from ray.serve.metrics import Gauge
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.settings import get_settings

SERVED_BY = "x-served-by"
METRICS_PERIOD_S = 2.0  # how often a replica hands its registry to Ray (Ray's agent reports every few s)


# --8<-- [start:deployment]
def replica_app() -> FastAPI:
    """Built in each replica when it starts (Serve calls it there): stage 5, from the replica's settings."""
    from stage5_metrics.app import create_app  # imported in the replica, never on the driver

    app = create_app(get_settings())
    app.add_middleware(ServedBy, name=replica_name())
    return app


class MetricsToRay:
    """What an ingress replica adds (both designs): stage 5's registry copied into Ray's metrics."""

    async def __init__(self, *bound: Any) -> None:  # type: ignore[misc]  # Ray's idiom: an async constructor
        self.metrics = asyncio.create_task(copy_metrics_to_ray(self._registry))

    def _registry(self) -> CollectorRegistry | None:
        """Stage 5's registry, once Serve has built the app (``self.app``, after this constructor)."""
        app = getattr(self, "app", None)
        return None if app is None else app.state.metrics.registry

    async def __del__(self) -> None:
        self.metrics.cancel()


@serve.deployment(name="stage5")
@serve.ingress(replica_app)  # Serve's documented form for an app built on the replica
class Stage5Replica(MetricsToRay):
    """One replica: the stage 5 server, unchanged, plus its name on every answer and its metrics in Ray's."""


class ClusterArgs(BaseModel):
    """The application's arguments: what `serve run ...:builder key=value` and serve.yaml's `args` set."""

    replicas: int = Field(2, ge=1, description="Replicas of stage 5 (the starting count when autoscaling).")
    replica_cpus: float = Field(1.0, gt=0, description="Logical CPUs one replica reserves.")
    max_replicas_per_node: int = Field(1, ge=1, description="Spread: at most this many replicas a node.")
    max_ongoing_requests: int = Field(
        2048,
        ge=1,
        description="Requests Serve hands one replica at once: more than stage 5 admits (MAX_QUEUE "
        "texts, 1024), so its own queue refuses first, in the API's shape. Ray's default (5) starves "
        "the batcher.",
    )
    max_queued_requests: int = Field(
        256,
        ge=-1,
        description="Requests the proxy holds while it picks a replica; past it Ray itself refuses, "
        "in plain text. A burst waits there a moment even with room in the replicas: size it above "
        "the clients expected at once, so that the replica refuses first.",
    )
    retry_after_s: float = Field(1.0, ge=0, description="Retry-After on a refusal by the proxy.")
    autoscale: bool = Field(False, description="Scale between min_replicas and replicas on queue length.")
    min_replicas: int = Field(1, ge=0, description="Fewest replicas when autoscaling.")
    target_ongoing_requests: float = Field(
        32, gt=0, description="Autoscaling target: requests in a replica (queued in it or running)."
    )


def builder(args: ClusterArgs) -> serve.Application:
    """The bound application (Serve's typed builder: it validates `args` into ClusterArgs first)."""
    return Stage5Replica.options(**deployment_options(args)).bind()  # type: ignore[attr-defined]


def deployment_options(args: ClusterArgs) -> dict[str, Any]:
    """A deployment's options from the arguments (both designs' builders)."""
    settings = get_settings()  # the stage settings every replica reads too (the nodes' environment)
    options: dict[str, Any] = {
        "max_ongoing_requests": args.max_ongoing_requests,
        "max_queued_requests": args.max_queued_requests,
        "backpressure_config": BackpressureConfig(
            status_code=settings.overload_status, retry_after_s=args.retry_after_s
        ),
        "max_replicas_per_node": args.max_replicas_per_node,  # one per node: a node loss costs one
        "graceful_shutdown_timeout_s": settings.drain_timeout_s,
        "ray_actor_options": {"num_cpus": args.replica_cpus},
    }
    if args.autoscale:
        options["autoscaling_config"] = {
            "min_replicas": args.min_replicas,
            "initial_replicas": args.replicas,
            "max_replicas": args.replicas,
            "target_ongoing_requests": args.target_ongoing_requests,
        }
    else:
        options["num_replicas"] = args.replicas
    return options


# --8<-- [end:deployment]


def replica_name() -> str:
    import ray

    node = ray.get_runtime_context().get_node_id()
    return f"{serve.get_replica_context().replica_tag}@{node[:8]}"


class ServedBy:
    """Names the replica (and its node) on every answer: ``x-served-by: 3kq1x0r2@1f2e3d4c``."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app, self.header = app, (SERVED_BY.encode(), name.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


# --8<-- [start:metrics]
async def copy_metrics_to_ray(registry: Callable[[], CollectorRegistry | None]) -> None:
    """Every few seconds, stage 5's registry (read in process) set into Ray gauges of the same
    names. Ray's agent exports them on the node's metrics port as ``ray_<name>``, tagged with
    ``deployment`` and ``replica``; deploy/ray/prometheus.yml drops the ``ray_`` again, so stage 5's
    recording rules read them unchanged (rate() and histogram_quantile() need no counter type)."""
    gauges: dict[str, Gauge] = {}
    while True:
        await asyncio.sleep(METRICS_PERIOD_S)
        found = registry()
        if found is None:  # the app is not built yet
            continue
        for family in found.collect():
            if not family.name.startswith("embedserve_"):
                continue  # process_* and python_*: Ray exports its own for every worker
            for sample in family.samples:
                gauge = gauges.get(sample.name)
                if gauge is None:
                    gauge = gauges[sample.name] = Gauge(
                        sample.name,
                        description=family.documentation,
                        tag_keys=tuple(sample.labels),  # type: ignore[arg-type]  # any length
                    )
                gauge.set(sample.value, tags=sample.labels)


# --8<-- [end:metrics]
