"""Design (b), Ray Serve's own pattern: an ingress deployment calling a batched model deployment.

    serve run deploy.ray.composed:builder                    # on a cluster of your own
    CLUSTER_CONFIG=deploy/ray/composed.yaml make cluster     # two nodes here

Design (a) (``app.py``) runs the whole of stage 5 in every replica. Here the server is cut in
two deployments, which Serve places and scales each on its own:

* ``ingress``: stage 5's app (the contract, stage 4's cache, single-flight and admission, stage 5's
  metrics), whose batcher is a ``DeploymentHandle`` to the model deployment (``ModelHandle``);
* ``model``: the ONNX model, its batches formed by ``@serve.batch`` with MAX_BATCH_SIZE and
  BATCH_WINDOW_MS, BATCH_CONCURRENCY batches at once.

The ingress tokenizes, so a cache hit never leaves it, and sends each missing text's token ids
as one call: ``@serve.batch`` batches calls, one item each. When a model replica dies with texts
in it (its node crashed), their callers get 503 with Retry-After: embedding is idempotent.
"""

# No `from __future__ import annotations` here: Serve reads the builder's annotation as a class.
import asyncio
import time
from collections.abc import Sequence

import numpy as np
from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from common.engine import Engine, TokenizedText
from common.limits import APIError, DeadlineExceeded
from common.settings import Settings, get_settings
from deploy.ray.app import ClusterArgs, MetricsToRay, ServedBy, deployment_options, replica_name
from stage3_batching.batcher import Batcher
from stage3_batching.pending import BatchOutcome

Reply = tuple[np.ndarray, int, float]  # a text's vector, its batch's size, that batch's model ms


def _elsewhere(ids: list[np.ndarray]) -> np.ndarray:
    raise RuntimeError("the ingress runs no model: the model deployment does")


# --8<-- [start:model]
@serve.deployment(name="model")
class Model:
    """The model alone: token ids in, one raw (not normalized) vector out, batched by Serve."""

    def __init__(self) -> None:
        settings = get_settings()
        self.engine = Engine.from_settings(settings, settings.batch_concurrency)
        self.engine.warmup()
        # The stage settings, through @serve.batch's documented setters.
        self.embed.set_max_batch_size(settings.max_batch_size)  # type: ignore[attr-defined]
        self.embed.set_batch_wait_timeout_s(settings.batch_window_ms / 1e3)  # type: ignore[attr-defined]

    # A decorator's argument: read from the environment where the module is imported (every replica).
    @serve.batch(max_concurrent_batches=get_settings().batch_concurrency)
    async def embed(self, ids: list[np.ndarray]) -> list[Reply]:
        started = time.perf_counter()
        vectors = await asyncio.to_thread(self.engine.run, ids)  # off the loop: the next batch forms
        ms = (time.perf_counter() - started) * 1e3
        return [(vector, len(ids), ms) for vector in vectors]


# --8<-- [end:model]


# --8<-- [start:handle]
class ModelHandle(Batcher):
    """Stage 3's batcher as stages 4 and 5 use it (``enqueue``, ``queue_depth``), its batches formed
    by the model deployment: each text one call through the handle."""

    def __init__(self, model: DeploymentHandle, settings: Settings) -> None:
        super().__init__(_elsewhere, settings)
        self.model, self.waiting = model, 0

    @property
    def queue_depth(self) -> int:
        """Texts sent to the model deployment, not answered yet: what admission bounds (MAX_QUEUE)."""
        return self.waiting

    async def start(self) -> None:  # the queue and its loop are Serve's, in the model replica
        pass

    async def close(self) -> None:  # Serve drains the replica's requests (graceful_shutdown_timeout_s)
        pass

    def enqueue(
        self, tokens: Sequence[TokenizedText], *, deadline: float | None = None
    ) -> asyncio.Future[BatchOutcome]:
        return asyncio.create_task(self._ask(tokens, deadline))  # cancelled: its Ray calls are too

    async def _ask(self, tokens: Sequence[TokenizedText], deadline: float | None) -> BatchOutcome:
        started = time.perf_counter()
        calls = [self.model.embed.remote(t.ids) for t in tokens]
        self.waiting += len(calls)
        try:
            async with asyncio.timeout(None if deadline is None else deadline - time.monotonic()):
                replies: list[Reply] = [await call for call in calls]
        except BaseException as exc:  # (a deadline, a client gone, a lost replica)
            for call in calls:
                call.cancel()  # texts still queued in the model replica never run
            if isinstance(exc, TimeoutError):
                waited_ms = (time.perf_counter() - started) * 1e3
                raise DeadlineExceeded(
                    f"request deadline passed after {waited_ms:.0f} ms at the model"
                ) from None
            if isinstance(exc, RayActorError):
                message = "the model replica serving this request was lost; retry (embedding is idempotent)"
                raise APIError(503, message, headers={"Retry-After": "1"}) from exc
            raise
        finally:
            self.waiting -= len(calls)
        model_ms = max(ms for _, _, ms in replies)
        batches = dict.fromkeys((size, ms) for _, size, ms in replies)  # the texts of one batch share both
        waited_ms = (time.perf_counter() - started) * 1e3
        vectors = np.stack([vector for vector, _, _ in replies])
        return BatchOutcome(vectors, max(0.0, waited_ms - model_ms), model_ms, [size for size, _ in batches])


# --8<-- [end:handle]


# --8<-- [start:ingress]
def ingress_app() -> FastAPI:
    """Built in each ingress replica when it starts: stage 5 around a handle to the model deployment
    (found by name, as Serve's own builder example does)."""
    from stage4_cache_backpressure.backend import CacheBackend  # imported in the replica, never on
    from stage5_metrics.app import create_app  # the driver

    model = serve.get_deployment_handle("model", app_name=serve.get_replica_context().app_name)

    def stage4(engine: Engine, settings: Settings) -> CacheBackend:
        # NEW: stage 4's steps around a handle to the model deployment, in place of stage 3's batcher
        return CacheBackend(engine, ModelHandle(model, settings), settings, drain_on_signal=True)

    app = create_app(get_settings(), stage4_backend=stage4)
    app.add_middleware(ServedBy, name=replica_name())
    return app


@serve.deployment(name="ingress")
@serve.ingress(ingress_app)
class Ingress(MetricsToRay):
    """The HTTP side. The model deployment is bound to it, so Serve deploys both as one application."""


def builder(args: ClusterArgs) -> serve.Application:
    """Both deployments with the same options; serve.yaml's `deployments:` sets each one's replicas."""
    options = deployment_options(args)
    return Ingress.options(**options).bind(Model.options(**options).bind())  # type: ignore[attr-defined]


# --8<-- [end:ingress]
