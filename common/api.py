"""The API contract every server stage shares, defined once.

A stage supplies a *backend*: an object with ``async def embed(job) -> EmbedResult``
(and optionally ``async def start()`` / ``async def close()``). Everything else,
routes, validation, limits, errors, headers and JSON encoding, lives here (the HTTP
plumbing, bodies read in one pass and errors in one shape, in ``common.routing``; what a backend
sees and returns, in ``common.backend``), so the stages differ only in how they call the model.

Routes: ``POST /v1/embed``, ``POST /v1/embeddings`` (OpenAI shape), ``GET /v1/models``,
``GET /health`` (liveness), ``GET /ready`` (readiness).
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from common.auth import install_auth
from common.backend import (
    Backend,
    BackendFactory,
    EmbedJob,
    EmbedResult,
    check_truncation,
    tokenize,
    validate_texts,
)
from common.engine import Engine
from common.limits import APIError, BodyGuard, error_response, not_ready
from common.routing import (
    ERRORS,
    NumpyJSONResponse,
    body_doc,
    install_error_handlers,
    read_body,
)
from common.schemas import (
    EmbedRequest,
    EmbedResponse,
    ErrorResponse,
    ModelList,
    OpenAIEmbeddingRequest,
    OpenAIEmbeddingResponse,
    Status,
)
from common.settings import Settings, get_settings

__all__ = [
    "Backend",
    "BackendFactory",
    "EmbedJob",
    "EmbedRequest",
    "EmbedResult",
    "OpenAIEmbeddingRequest",
    "backend_of",
    "check_truncation",
    "create_app",
    "read_body",
    "tokenize",
    "validate_texts",
]

log = logging.getLogger("embedserve")


def _deadline(request: Request, settings: Settings) -> float:
    raw = request.headers.get("x-request-timeout")
    timeout = settings.request_timeout_s
    if raw is not None:
        try:
            timeout = float(raw)
        except ValueError:
            raise APIError(
                400, "X-Request-Timeout must be a number of seconds", param="X-Request-Timeout"
            ) from None
        if not 0 < timeout <= 3600:
            raise APIError(400, "X-Request-Timeout must be in (0, 3600] seconds", param="X-Request-Timeout")
    return time.monotonic() + timeout


def _result_headers(result: EmbedResult, started: float) -> dict[str, str]:
    """x-total-time and x-inference-time on every answer (0 when no model ran: a cache hit), and
    what the later stages know: x-queue-time, x-batch-size, x-cache with its counts."""
    headers = {
        "x-total-time": f"{(time.perf_counter() - started) * 1e3:.2f}",
        "x-inference-time": f"{result.inference_ms:.2f}",
    }
    if result.queue_ms is not None:
        headers["x-queue-time"] = f"{result.queue_ms:.2f}"
    if result.batch_sizes:
        headers["x-batch-size"] = ",".join(map(str, result.batch_sizes))
    if result.cache_hits is not None:
        n, hits = len(result.n_tokens), result.cache_hits
        state = "hit" if hits == n else "miss" if hits == 0 else "partial"
        headers["x-cache"] = "bypass" if result.cache_bypassed else state
        headers["x-cache-hits"], headers["x-cache-misses"] = str(hits), str(n - hits)
    return headers


# --- the app --------------------------------------------------------------------
def create_app(
    title: str,
    make_backend: BackendFactory,
    settings: Settings | None = None,
    description: str = "",
    calls_at_once: Callable[[Settings], int] = lambda settings: 1,
) -> FastAPI:
    """A FastAPI app serving the contract, with ``make_backend`` deciding how the model runs.

    ``calls_at_once``: how many model calls the backend runs side by side (the engine shares
    the cores out among them when ONNX_INTRA_THREADS=0).
    """

    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The model loads here, never at import time, and warms up before /ready says yes.
        engine = await run_in_threadpool(Engine.from_settings, settings, calls_at_once(settings))
        await run_in_threadpool(engine.warmup)
        backend = make_backend(engine, settings)
        await backend.start()
        app.state.engine, app.state.backend = engine, backend
        log.info("%s ready: model %s", title, engine.model_name)
        try:
            yield
        finally:
            app.state.backend = None  # from here on, a request that needs it is told "not ready"
            await backend.close()

    app = FastAPI(title=title, description=description, lifespan=lifespan, version="1.0")
    app.state.settings = settings
    app.state.backend = None  # the lifespan makes it once the model has loaded
    app.add_middleware(BodyGuard, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    install_auth(app, settings)  # outside the contract: a request without a key is not even read
    install_error_handlers(app)
    _install_routes(app, settings)
    return app


async def backend_of(request: Request) -> Backend:
    """The app's backend, for a route that needs it (``Depends(backend_of)``): 503 while there is
    none, before the model has loaded and once the server has closed it. An ``async def``: FastAPI
    runs a plain ``def`` dependency in a thread, a hop per request (seen in the profile)."""
    backend: Backend | None = request.app.state.backend
    if backend is None:
        raise not_ready()
    return backend


def _install_routes(app: FastAPI, settings: Settings) -> None:
    # --8<-- [start:run_job]
    async def run_job(
        request: Request,
        backend: Backend,
        started: float,
        texts: list[str],
        *,
        param: str,
        normalize: bool = True,
        truncate: bool = True,
        cache: bool = True,
    ) -> EmbedResult:
        """Validate, hand to the stage's backend (which tokenizes and runs the model): the part
        every stage shares."""
        validate_texts(texts, settings, param)
        if cache and "no-cache" in request.headers.get("cache-control", ""):
            cache = False
        deadline = _deadline(request, settings)
        # receive: for a stage that drops the work of a client that hung up (stage 4)
        job = EmbedJob(texts, normalize, truncate, cache, deadline, param, request.receive)
        try:
            result = await backend.embed(job)
        except APIError as exc:  # a refusal says how long it took too (a 503 should be fast)
            exc.headers["x-total-time"] = f"{(time.perf_counter() - started) * 1e3:.2f}"
            raise
        if result.vectors.shape[0] != len(texts):  # never hand a caller someone else's vectors
            raise APIError(500, f"backend returned {result.vectors.shape[0]} vectors for {len(texts)} texts")
        return result

    # --8<-- [end:run_job]

    @app.post(
        "/v1/embed",
        tags=["embeddings"],
        response_model=EmbedResponse,
        responses=ERRORS,
        openapi_extra=body_doc(EmbedRequest, "inputs", settings),
    )
    async def embed(request: Request, backend: Annotated[Backend, Depends(backend_of)]) -> Response:
        """Embed one text or a list of texts."""
        started = time.perf_counter()
        body = await read_body(request, EmbedRequest)
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        result = await run_job(
            request, backend, started, texts,
            param="inputs", normalize=body.normalize, truncate=body.truncate, cache=body.cache,
        )  # fmt: skip
        engine: Engine = request.app.state.engine
        payload = {
            "embeddings": result.vectors,
            "model": engine.model_name,
            "dimensions": engine.dimensions,
            "truncated": result.truncated,
        }
        return NumpyJSONResponse(payload, headers=_result_headers(result, started))

    @app.post(
        "/v1/embeddings",
        tags=["embeddings"],
        response_model=OpenAIEmbeddingResponse,
        responses={404: {"model": ErrorResponse, "description": "Unknown `model`"}, **ERRORS},
        openapi_extra=body_doc(OpenAIEmbeddingRequest, "input", settings),
    )
    async def embeddings(request: Request, backend: Annotated[Backend, Depends(backend_of)]) -> Response:
        """OpenAI-compatible embeddings (the official `openai` client works unchanged)."""
        started = time.perf_counter()
        body = await read_body(request, OpenAIEmbeddingRequest)
        engine: Engine = request.app.state.engine
        if body.model is not None and body.model not in _model_aliases(engine, settings):
            raise APIError(
                404,
                f"model `{body.model}` is not served here; this server serves `{engine.model_name}`"
                " (send that name, or list yours in MODEL_ALIASES)",
                param="model",
                type="model_not_found",
            )
        if body.dimensions is not None and body.dimensions != engine.dimensions:
            raise APIError(
                422,
                f"`dimensions` must be {engine.dimensions} for this model (got {body.dimensions})",
                param="dimensions",
            )
        texts = [body.input] if isinstance(body.input, str) else body.input
        result = await run_job(request, backend, started, texts, param="input")
        vectors: Any = result.vectors  # orjson writes a (n, 384) float32 array row by row
        if body.encoding_format == "base64":
            vectors = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in result.vectors]
        n_tokens = sum(result.n_tokens)
        payload = {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "model": engine.model_name,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
        return NumpyJSONResponse(payload, headers=_result_headers(result, started))

    @app.get("/v1/models", tags=["meta"], response_model=ModelList)
    async def models(request: Request) -> Response:
        """The served model, in the OpenAI shape (its `id` is what `model` accepts)."""
        engine: Engine | None = getattr(request.app.state, "engine", None)
        data = []
        if engine is not None:
            data.append({"id": engine.model_name, "object": "model", "created": 0, "owned_by": "embedserve"})
        return NumpyJSONResponse({"object": "list", "data": data})

    @app.get("/health", tags=["meta"], response_model=Status)
    async def health(request: Request) -> Response:
        """Liveness: the process answers."""
        return NumpyJSONResponse({"status": "ok"})

    @app.get("/ready", tags=["meta"], response_model=Status, responses={503: {"model": ErrorResponse}})
    async def ready(request: Request) -> Response:
        """Readiness: 503 until the model is loaded and warmed, and again while draining."""
        backend: Backend | None = request.app.state.backend
        if backend is not None and not backend.draining:
            return NumpyJSONResponse({"status": "ready"})
        return error_response(not_ready())


def _model_aliases(engine: Engine, settings: Settings) -> set[str]:
    """The names ``model`` may take: the served model's own, and the operator's MODEL_ALIASES."""
    extra = {name.strip() for name in (settings.model_aliases or "").split(",") if name.strip()}
    return {
        engine.model_name,
        engine.model_id,
        f"{engine.model_id}-int8",
        f"sentence-transformers/{engine.model_id}",
        *extra,
    }
