"""Stage 5 as a Ray Serve application: N replicas, each the whole stage 5 server.

A replica builds ``stage5_metrics.app.build_app(settings)``, so everything of stage 5 stays
per replica (batcher, in-process cache, admission, deadlines, metrics); the Redis tier
(CACHE_URL) is shared by all of them. Ray Serve adds what one process cannot: replicas on
several nodes behind one HTTP proxy, a queue in the proxy with its own refusals
(``max_queued_requests``), restarts of dead replicas, autoscaling on queue length.

    make cluster        # two nodes, one replica each, the API on HOST:PORT
    make cluster-down

Two additions per replica, both for operating a fleet: an ``x-served-by`` header naming the
replica and its node, and the replica's own ``/metrics`` on a port of its own, registered in
Ray's key-value store so ``python -m deploy.ray.cluster targets`` can list every replica for
Prometheus (through the proxy, a scrape would reach one replica at random).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI
from ray import serve
from ray.serve.config import BackpressureConfig
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.limits import APIError, error_response
from common.settings import Settings, get_settings
from deploy.ray.settings import ClusterSettings

APP_NAME = "embedserve"
SERVED_BY = "x-served-by"
KV_NAMESPACE = "embedserve"


# --8<-- [start:deployment]
@serve.deployment(name="stage5")
@serve.ingress()  # the app is built in the replica, from the replica's own settings
class Stage5Replica:
    """One replica: the stage 5 server, unchanged, plus its name on every answer."""

    async def __init__(self, cluster: dict[str, Any]) -> None:  # type: ignore[misc]  # Ray's idiom
        from stage5_metrics.app import build_app  # imported in the replica, never on the driver

        self.name = _replica_name()
        self.stage5 = build_app(get_settings())  # (`self.app` is Ray's: the app it serves)
        self.stage5.add_middleware(ServedBy, name=self.name)
        self.metrics = MetricsPort(self.stage5, self.name, int(cluster["metrics_port"]))
        await self.metrics.start()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.stage5

    async def __del__(self) -> None:
        if hasattr(self, "metrics"):
            await self.metrics.stop()


def application(cs: ClusterSettings | None = None, settings: Settings | None = None) -> Any:
    """The bound application: replicas, placement, queue and scaling, all from settings."""
    cs, settings = cs or ClusterSettings(), settings or get_settings()
    options: dict[str, Any] = {
        "max_ongoing_requests": cs.max_ongoing_requests,  # what one replica may hold (and batch)
        "max_queued_requests": cs.max_queued_requests,  # the proxy's queue; past it, a refusal
        "backpressure_config": BackpressureConfig(
            status_code=settings.overload_status, retry_after_s=cs.retry_after_s
        ),
        "max_replicas_per_node": cs.max_replicas_per_node,  # one per node: a node loss costs one
        "graceful_shutdown_timeout_s": settings.drain_timeout_s,
        "ray_actor_options": {"num_cpus": cs.replica_cpus, "runtime_env": {"env_vars": replica_env()}},
    }
    if cs.autoscale:
        options["autoscaling_config"] = {
            "min_replicas": cs.min_replicas,
            "initial_replicas": cs.replicas,
            "max_replicas": cs.replicas,
            "target_ongoing_requests": cs.target_ongoing_requests,
        }
    else:
        options["num_replicas"] = cs.replicas
    deployment = Stage5Replica.options(**options)  # type: ignore[attr-defined]
    return deployment.bind({"metrics_port": cs.metrics_port})


# --8<-- [end:deployment]


def replica_env() -> dict[str, str]:
    """The stage settings set in this environment (CACHE_URL, MAX_QUEUE, ...), for every replica."""
    names = {name.upper() for name in Settings.model_fields}
    return {name: value for name, value in os.environ.items() if name in names}


def _replica_name() -> str:
    import ray

    node = ray.get_runtime_context().get_node_id()
    return f"{serve.get_replica_context().replica_id.unique_id}@{node[:8]}"


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


class MetricsPort:
    """The replica's ``GET /metrics`` on a port of its own, for Prometheus to scrape each replica.

    It serves the replica's own app (same registry, same route), only that path; the address goes
    into Ray's key-value store under the replica's name and leaves it when the replica stops.
    """

    def __init__(self, app: ASGIApp, name: str, port: int) -> None:
        self.app, self.name, self.port = app, name, port
        self.server: uvicorn.Server | None = None
        self.task: asyncio.Task[None] | None = None

    async def _only_metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics":
            return await self.app(scope, receive, send)
        await error_response(APIError(404, "this port serves only /metrics"))(scope, receive, send)

    async def start(self) -> None:
        import ray
        from ray.experimental.internal_kv import _internal_kv_put

        host = ray.util.get_node_ip_address()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, self.port))  # port 0: any free one; the registry says which
        config = uvicorn.Config(
            self._only_metrics, interface="asgi3", lifespan="off", access_log=False, log_config=None
        )
        self.server = uvicorn.Server(config)
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        target = {"targets": [f"{host}:{sock.getsockname()[1]}"], "labels": {"replica": self.name}}
        _internal_kv_put(f"metrics/{self.name}", json.dumps(target), namespace=KV_NAMESPACE)

    async def stop(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_del

        _internal_kv_del(f"metrics/{self.name}", namespace=KV_NAMESPACE)
        if self.server is not None and self.task is not None:
            self.server.should_exit = True
            await self.task
