"""What the API contract costs per request, apart from the model.

    python -m benchmarks.stage2_overhead            # about 2 minutes
    python -m benchmarks.stage2_overhead --quick    # about 30 s, to see that it works
    python -m benchmarks.stage2_overhead --record   # written to docs/results/stage2_overhead.*
    python -m benchmarks.stage2_overhead --profile  # only print a cProfile of the /v1/embed path

Three parts:

* ``components``: CPU microseconds per call of each step on the request path (tokenize one
  text, validate a body, encode 384 floats, ...), next to one model call for scale.
* ``in_process``: CPU microseconds per request through the real app (``common.api.create_app``)
  called directly as ASGI, with a *null backend* that answers without the model; and the
  same small job done four ways, to compare body parsing, routing and JSON encoding
  (FastAPI's defaults against ``read_body``, ``LeanRoute`` and orjson).
* ``sockets``: requests/s over real sockets at 8 clients for the null-backend server
  (``benchmarks/null_backend``: the HTTP ceiling of this machine), stage 1 and stage 2, each
  with ``/health`` probed during the run; and the engine alone for the same texts.

Writes stage2_overhead.json and .md (the tables the stage 1 and 2 chapters include).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import cProfile
import json
import pstats
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from benchmarks.null_backend.app import app as null_app
from common import corpus
from common.api import json_response, lean_route, read_body
from common.engine import Engine, l2_normalize
from common.schemas import EmbedRequest
from common.settings import Settings
from loadtests import evidence
from loadtests.harness import settle
from loadtests.httpload import post_requests, run_load
from loadtests.procs import running_stage
from loadtests.tables import page, table

NULL_STAGE = "benchmarks.null_backend"  # served by `python -m common.serve`, like a stage


def _variants_app(vectors: np.ndarray) -> FastAPI:
    """The same small job (parse a body, answer with its vectors) done four ways."""
    app = FastAPI()

    def answer(body: EmbedRequest) -> Response:
        n = 1 if isinstance(body.inputs, str) else len(body.inputs)
        return json_response({"embeddings": vectors[:n]})

    @app.post("/fastapi-body")  # FastAPI's default: stdlib json, dependency walk, validate objects
    async def fastapi_body(body: EmbedRequest) -> Response:
        return answer(body)

    @app.post("/read-body")  # pydantic-core validates the bytes, still a regular APIRoute
    async def read_body_route(request: Request) -> Response:
        return answer(await read_body(request, EmbedRequest))

    @lean_route(app, "POST", "/lean")  # what common.api does: read_body on a LeanRoute
    async def lean(request: Request) -> Response:
        return answer(await read_body(request, EmbedRequest))

    @app.post("/fastapi-encode")  # FastAPI's default both ways: a returned dict is jsonable_encoder + json
    async def fastapi_encode(body: EmbedRequest) -> dict[str, Any]:
        n = 1 if isinstance(body.inputs, str) else len(body.inputs)
        return {"embeddings": vectors[:n].tolist()}

    return app


# --- timing ------------------------------------------------------------------------------
Case = Callable[[], Awaitable[object]]


async def cpu_us(cases: dict[str, Case], seconds: float, rounds: int = 7) -> dict[str, float]:
    """CPU microseconds per call of each case, measured in interleaved rounds.

    CPU time (``time.process_time``), not wall time: on a shared 2-core machine the wall
    clock also counts the time other processes held the core. Rounds alternate between the
    cases so a busy spell hits them all alike; each case keeps its best (least disturbed) round.
    """
    sizes = {}
    for name, case in cases.items():  # calibrate: about seconds / rounds / len(cases) per round
        await case()
        n, start = 0, time.process_time()
        while time.process_time() - start < 0.02:
            await case()
            n += 1
        per_call = (time.process_time() - start) / n
        sizes[name] = max(3, int(seconds / rounds / len(cases) / per_call))
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for name, case in cases.items():
            start = time.process_time()
            for _ in range(sizes[name]):
                await case()
            best[name] = min(best[name], (time.process_time() - start) / sizes[name] * 1e6)
    return {name: round(us, 1) for name, us in best.items()}


def _sync(fn: Callable[[], object]) -> Case:
    async def case() -> object:
        return fn()

    return case


async def asgi_call(app: Any, method: str, path: str, body: bytes = b"") -> int:
    """One request straight into the ASGI app, no sockets; returns the status."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"x"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    received = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


def _asgi(app: Any, method: str, path: str, body: bytes = b"") -> Case:
    async def case() -> object:
        status = await asgi_call(app, method, path, body)
        assert status == 200, (path, status)
        return status

    return case


# --- the three parts ------------------------------------------------------------------
def components(engine: Engine, seconds: float) -> dict[str, float]:
    text = corpus.texts(1, seed=7, kind="query")[0]
    body = orjson.dumps({"inputs": [text]})
    vector = engine.embed([text]).vectors
    ids = [engine.tokenize([text])[0].ids]
    cases = {
        "tokenize_1_text": _sync(lambda: engine.tokenize([text])),
        "validate_json_pydantic_core": _sync(lambda: EmbedRequest.model_validate_json(body)),
        "json_loads_then_validate": _sync(lambda: EmbedRequest.model_validate(json.loads(body))),
        "orjson_384_float32": _sync(lambda: orjson.dumps({"e": vector}, option=orjson.OPT_SERIALIZE_NUMPY)),
        "stdlib_json_384_floats": _sync(lambda: json.dumps({"e": vector.tolist()})),
        "base64_384_float32": _sync(lambda: base64.b64encode(vector[0].tobytes()).decode()),
        "l2_normalize_1_vector": _sync(lambda: l2_normalize(vector)),
        "model_call_1_text": _sync(lambda: engine.run(ids)),
    }
    return {f"{k}_us": v for k, v in asyncio.run(cpu_us(cases, seconds)).items()}


def in_process(seconds: float) -> dict[str, Any]:
    short = corpus.texts(32, seed=11, kind="query")
    one = orjson.dumps({"inputs": short[0]})
    many = orjson.dumps({"inputs": short})
    openai_one = orjson.dumps({"input": [short[0]], "encoding_format": "float"})
    openai_b64 = orjson.dumps({"input": [short[0]], "encoding_format": "base64"})
    contract = {
        "health": _asgi(null_app, "GET", "/health"),
        "embed_1_text": _asgi(null_app, "POST", "/v1/embed", one),
        "embed_32_texts": _asgi(null_app, "POST", "/v1/embed", many),
        "embeddings_1_text_float": _asgi(null_app, "POST", "/v1/embeddings", openai_one),
        "embeddings_1_text_base64": _asgi(null_app, "POST", "/v1/embeddings", openai_b64),
    }
    variants = _variants_app(l2_normalize(np.random.default_rng(0).standard_normal((64, 384))))
    ways = {
        f"{route.strip('/')}_{label}": _asgi(variants, "POST", route, body)
        for label, body in (("1_text", one), ("32_texts", many))
        for route in ("/fastapi-body", "/read-body", "/lean", "/fastapi-encode")
    }

    async def run() -> dict[str, Any]:
        async with null_app.router.lifespan_context(null_app):
            out = {"contract_null_backend": await cpu_us(contract, seconds)}
        out["parse_and_encode"] = await cpu_us(ways, seconds)
        return {part: {f"{k}_us": v for k, v in values.items()} for part, values in out.items()}

    return asyncio.run(run())


def _engine_texts_per_s(engine: Engine, texts: list[str], batch: int, seconds: float) -> float:
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        i = done % len(texts)
        chunk = texts[i : i + batch]
        engine.embed(chunk if len(chunk) == batch else texts[:batch])
        done += batch
    return round(done / (time.perf_counter() - start), 1)


def sockets(engine: Engine, seconds: float, clients: int, logs: Path) -> dict[str, Any]:
    """Requests/s at ``clients`` clients, one text each, with /health probed every 50 ms."""
    texts = corpus.texts(4000, seed=21, kind="query")
    requests = post_requests("/v1/embed", [orjson.dumps({"inputs": [t]}) for t in texts])
    out: dict[str, Any] = {"clients": clients, "text_kind": "query", "texts_per_request": 1}
    for name, stage in (("null_backend", NULL_STAGE), ("stage1_naive", "stage1_naive"),
                        ("stage2_threadpool", "stage2_threadpool")):  # fmt: skip
        with running_stage(stage, logs) as server:
            settle(server.pid, server.url)
            out[name] = run_load(server.host, server.port, requests, clients, seconds, probe="/health")
    out["engine_alone_texts_per_s"] = {
        str(batch): _engine_texts_per_s(engine, texts, batch, seconds) for batch in (1, 32)
    }
    return out


# --- the results page --------------------------------------------------------------------
def _label(key: str) -> str:
    return key.removesuffix("_us").replace("_", " ")


def markdown(result: dict[str, Any]) -> str:
    """stage2_overhead.md: one snippet section per table, for the chapters."""
    comp = result["components"]
    contract = result["in_process"]["contract_null_backend"]
    ways = result["in_process"]["parse_and_encode"]
    sock = result["sockets"]
    sections: dict[str, list[str]] = {
        "components": table(["step", "CPU µs per call"], [(_label(k), v) for k, v in comp.items()]),
        "contract": table(
            ["request (null backend, no model)", "CPU µs"], [(_label(k), v) for k, v in contract.items()]
        ),
    }
    sections["parse_and_encode"] = table(
        ["body", "FastAPI body param + orjson", "read_body + orjson", "read_body on a LeanRoute + orjson",
         "FastAPI body param + returned dict"],
        [
            (label.replace("_", " "),
             *(ways[f"{way}_{label}_us"] for way in ("fastapi-body", "read-body", "lean", "fastapi-encode")))
            for label in ("1_text", "32_texts")
        ],
    )  # fmt: skip
    engine = sock["engine_alone_texts_per_s"]
    sections["sockets"] = [
        f"{sock['clients']} closed-loop clients, one short query per request, `/health` probed every"
        " 50 ms on its own connection:",
        "",
        *table(
            ["server", "req/s", "p50 ms", "p99 ms", "/health p50 ms", "/health max ms", "errors"],
            [
                (name.replace("_", " "), r["requests_per_s"], r["p50_ms"], r["p99_ms"], r["probe_p50_ms"],
                 r["probe_max_ms"], r["errors"])
                for name in ("null_backend", "stage1_naive", "stage2_threadpool")
                for r in [sock[name]]
            ],
        ),
        "",
        f"The engine alone, same texts, no HTTP: {engine['1']} texts/s one at a time,"
        f" {engine['32']} texts/s in batches of 32.",
    ]  # fmt: skip
    return page(result["stamp"], sections)


def headline(result: dict[str, Any]) -> dict[str, float]:
    sock = result["sockets"]
    out = {
        f"{n} req/s": sock[n]["requests_per_s"] for n in ("null_backend", "stage1_naive", "stage2_threadpool")
    }
    out["embed 1 text, null backend, CPU µs"] = result["in_process"]["contract_null_backend"][
        "embed_1_text_us"
    ]
    return out


def profile_embed(seconds: float) -> None:
    body = orjson.dumps({"inputs": corpus.texts(1, seed=7, kind="query")})

    async def run() -> None:
        async with null_app.router.lifespan_context(null_app):
            profiler = cProfile.Profile()
            start = time.perf_counter()
            profiler.enable()
            while time.perf_counter() - start < seconds:
                await asgi_call(null_app, "POST", "/v1/embed", body)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)

    asyncio.run(run())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of /v1/embed and stop")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--out", type=Path, help="folder for stage2_overhead.json and .md")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.profile:
        profile_embed(3.0 if args.quick else 10.0)
        return
    run = evidence.start("benchmarks.stage2_overhead", args, argv)
    seconds = 1.0 if args.quick else 5.0
    engine = Engine.from_settings(Settings())
    engine.warmup()
    result: dict[str, Any] = {
        "components": components(engine, seconds),
        "in_process": in_process(seconds),
        "sockets": sockets(engine, 3.0 if args.quick else 15.0, args.clients, run.logs("stage2_overhead")),
    }
    result["stamp"] = run.stamp()
    evidence.publish(run, args.out, "stage2_overhead", result, markdown, headline)


if __name__ == "__main__":
    main()
