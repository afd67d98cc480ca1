"""The API contract, checked the same way against every server stage that exists.

Each stage runs once as a real uvicorn process (``stage_server``) and every test talks to
it over a real socket. A stage added later is picked up by ``available_stages()`` and has
to pass all of this the day it appears.
"""

from __future__ import annotations

import base64
import importlib
import subprocess
import sys
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from conftest import SERVER_STAGES, Server
from fastapi import FastAPI

from common.engine import Engine
from common.serve import app_of
from common.settings import Settings

ROUTES = [("/v1/embed", "inputs"), ("/v1/embeddings", "input")]
LONG_TEXT = "the quick brown fox jumps over the lazy dog " * 80  # ~720 tokens, past the 256 limit


@pytest.fixture(scope="module", params=SERVER_STAGES)
def server(request: pytest.FixtureRequest, stage_server) -> Server:  # type: ignore[no-untyped-def]
    return stage_server(request.param)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120.0) as c:
        yield c


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> str:
    """The OpenAI error shape, with the expected status and (when given) the field it names."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"type", "message", "param", "code"}
    assert isinstance(error["type"], str) and error["type"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param
        assert param in error["message"]
    return str(error["message"])


def norms(vectors: list[list[float]]) -> np.ndarray:
    return np.linalg.norm(np.asarray(vectors, dtype=np.float64), axis=1)


# --- the stage module ----------------------------------------------------------------
@pytest.mark.parametrize("stage", SERVER_STAGES)
def test_stage_module_exposes_a_fastapi_app_with_the_contract_routes(stage: str) -> None:
    """``app.py`` holds the app, or (stage 5) the factory uvicorn calls (``common.serve``)."""
    target, factory = app_of(stage)
    module = importlib.import_module(f"{stage}.app")
    app = module.create_app() if factory else module.app
    assert target.endswith(":create_app" if factory else ":app")
    assert isinstance(app, FastAPI)
    paths = {getattr(r, "path", None) for r in app.routes}
    assert {"/v1/embed", "/v1/embeddings", "/v1/models", "/health", "/ready"} <= paths


# --- POST /v1/embed ----------------------------------------------------------------------
def test_embed_one_string(client: httpx.Client, engine: Engine) -> None:
    r = client.post("/v1/embed", json={"inputs": "a single sentence"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"embeddings", "model", "dimensions", "truncated"}
    assert body["dimensions"] == engine.dimensions == 384
    assert body["model"] == engine.model_name
    assert len(body["embeddings"]) == 1 and len(body["embeddings"][0]) == 384
    assert body["truncated"] == [False]


def test_embed_list_keeps_order_and_normalizes(client: httpx.Client) -> None:
    texts = ["first text", "a second, longer text about cooking", "third"]
    r = client.post("/v1/embed", json={"inputs": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["embeddings"]) == 3
    assert body["truncated"] == [False, False, False]
    np.testing.assert_allclose(norms(body["embeddings"]), 1.0, atol=1e-5)
    # order: each row equals the vector of its own text asked alone (one row per request)
    alone = [client.post("/v1/embed", json={"inputs": t}).json()["embeddings"][0] for t in texts]
    similarity = np.asarray(body["embeddings"]) @ np.asarray(alone).T
    assert list(similarity.argmax(axis=1)) == [0, 1, 2]


def test_embed_normalize_false_returns_raw_mean_pooled_vectors(client: httpx.Client) -> None:
    texts = ["raw vectors please", "and another one"]
    raw = client.post("/v1/embed", json={"inputs": texts, "normalize": False}).json()["embeddings"]
    unit = client.post("/v1/embed", json={"inputs": texts, "normalize": True}).json()["embeddings"]
    raw_norms = norms(raw)
    assert np.all(np.abs(raw_norms - 1.0) > 0.05), raw_norms  # MiniLM's pooled norms are far from 1
    np.testing.assert_allclose(np.asarray(raw) / raw_norms[:, None], unit, atol=1e-5)


def test_truncate_true_reports_which_texts_were_cut(client: httpx.Client, engine: Engine) -> None:
    assert engine.tokenize([LONG_TEXT])[0].truncated
    r = client.post("/v1/embed", json={"inputs": ["short", LONG_TEXT, "also short"], "truncate": True})
    assert r.status_code == 200, r.text
    assert r.json()["truncated"] == [False, True, False]


def test_truncate_false_names_the_index_of_the_long_text(client: httpx.Client) -> None:
    r = client.post("/v1/embed", json={"inputs": ["short", LONG_TEXT], "truncate": False})
    message = assert_error(r, 422, "inputs[1]")
    assert "token" in message
    ok = client.post("/v1/embed", json={"inputs": ["short", "fits"], "truncate": False})
    assert ok.status_code == 200 and ok.json()["truncated"] == [False, False]


def test_timing_headers(client: httpx.Client) -> None:
    """x-total-time and x-inference-time in ms; the model ran (no cache), so its time is above 0."""
    for path, field in ROUTES:
        r = client.post(path, json={field: "timing"}, headers={"cache-control": "no-cache"})
        assert r.status_code == 200, r.text
        total = float(r.headers["x-total-time"])
        inference = float(r.headers["x-inference-time"])
        assert inference > 0
        assert total + 0.01 >= inference  # the total includes the model call (2-decimal rounding)
        if "x-queue-time" in r.headers:
            assert float(r.headers["x-queue-time"]) >= 0


# --- POST /v1/embeddings (OpenAI) -------------------------------------------------------
def test_embeddings_openai_shape_and_usage(client: httpx.Client, engine: Engine) -> None:
    texts = ["how do I bake bread", "the central bank raises interest rates", LONG_TEXT]
    r = client.post("/v1/embeddings", json={"input": texts, "model": engine.model_name})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"object", "data", "model", "usage"}
    assert body["object"] == "list" and body["model"] == engine.model_name
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for item in body["data"]:
        assert set(item) == {"object", "index", "embedding"}
        assert item["object"] == "embedding" and len(item["embedding"]) == 384
    np.testing.assert_allclose(norms([d["embedding"] for d in body["data"]]), 1.0, atol=1e-5)
    # usage counts the tokens the model saw (special tokens included, after truncation)
    expected = sum(t.n_tokens for t in engine.tokenize(texts))
    assert expected == sum(len(engine.tokenizer.encode(t).ids) for t in texts)
    assert body["usage"] == {"prompt_tokens": expected, "total_tokens": expected}


def test_embeddings_one_string_and_model_aliases(client: httpx.Client, engine: Engine) -> None:
    for model in (engine.model_name, engine.model_id):
        r = client.post("/v1/embeddings", json={"input": "one string", "model": model})
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 1


def test_base64_decodes_to_the_same_floats(client: httpx.Client) -> None:
    texts = ["base64 please", "and this one too"]
    floats = client.post("/v1/embeddings", json={"input": texts, "encoding_format": "float"}).json()
    b64 = client.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"}).json()
    for f, b in zip(floats["data"], b64["data"], strict=True):
        assert isinstance(b["embedding"], str)
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.shape == (384,)
        # the float answer is float32 printed shortest: it reads back to the very same float32
        np.testing.assert_array_equal(decoded, np.asarray(f["embedding"], dtype=np.float32))
    assert b64["usage"] == floats["usage"]


def test_unknown_model_is_404(client: httpx.Client) -> None:
    r = client.post("/v1/embeddings", json={"input": "x", "model": "text-embedding-3-large"})
    message = assert_error(r, 404, "model")
    assert "text-embedding-3-large" in message
    assert r.json()["error"]["type"] == "model_not_found"


def test_dimensions_must_match_the_model(client: httpx.Client) -> None:
    assert client.post("/v1/embeddings", json={"input": "x", "dimensions": 384}).status_code == 200
    r = client.post("/v1/embeddings", json={"input": "x", "dimensions": 256})
    message = assert_error(r, 422, "dimensions")
    assert "384" in message


def test_unknown_encoding_format_is_422(client: httpx.Client) -> None:
    assert_error(client.post("/v1/embeddings", json={"input": "x", "encoding_format": "int8"}), 422)


# --- limits, the same on both routes ------------------------------------------------------
@pytest.mark.parametrize(("path", "field"), ROUTES)
def test_empty_list(client: httpx.Client, path: str, field: str) -> None:
    assert "empty" in assert_error(client.post(path, json={field: []}), 422, field)


@pytest.mark.parametrize(("path", "field"), ROUTES)
def test_empty_string(client: httpx.Client, path: str, field: str) -> None:
    assert_error(client.post(path, json={field: ""}), 422, f"{field}[0]")
    assert_error(client.post(path, json={field: ["ok", ""]}), 422, f"{field}[1]")


@pytest.mark.parametrize(("path", "field"), ROUTES)
@pytest.mark.parametrize("item", [5, None, 1.5, True, ["nested"], {"text": "x"}])
def test_non_string_item(client: httpx.Client, path: str, field: str, item: object) -> None:
    message = assert_error(client.post(path, json={field: ["fine", item]}), 422, f"{field}[1]")
    assert "string" in message


@pytest.mark.parametrize(("path", "field"), ROUTES)
@pytest.mark.parametrize("value", [5, None, {"text": "x"}])
def test_input_of_the_wrong_type(client: httpx.Client, path: str, field: str, value: object) -> None:
    assert_error(client.post(path, json={field: value}), 422, field)


@pytest.mark.parametrize(("path", "field"), ROUTES)
def test_missing_input(client: httpx.Client, path: str, field: str) -> None:
    assert "required" in assert_error(client.post(path, json={}), 422, field)


@pytest.mark.parametrize(("path", "field"), ROUTES)
def test_more_than_max_items(client: httpx.Client, settings: Settings, path: str, field: str) -> None:
    at_limit = client.post(path, json={field: ["x"] * settings.max_items})
    assert at_limit.status_code == 200, at_limit.text
    message = assert_error(client.post(path, json={field: ["x"] * (settings.max_items + 1)}), 422, field)
    assert "MAX_ITEMS" in message


@pytest.mark.parametrize(("path", "field"), ROUTES)
def test_text_longer_than_max_chars(client: httpx.Client, settings: Settings, path: str, field: str) -> None:
    at_limit = client.post(path, json={field: ["a " * (settings.max_chars // 2)]})
    assert at_limit.status_code == 200, at_limit.text
    too_long = "a" * (settings.max_chars + 1)
    message = assert_error(client.post(path, json={field: ["ok", too_long]}), 422, f"{field}[1]")
    assert "MAX_CHARS" in message


@pytest.mark.parametrize(("path", "field"), ROUTES)
def test_body_larger_than_max_body_bytes_is_413(
    client: httpx.Client, settings: Settings, path: str, field: str
) -> None:
    big = b'{"%s": "%s"}' % (field.encode(), b"a" * settings.max_body_bytes)
    # with Content-Length: refused before the body is read
    message = assert_error(client.post(path, content=big), 413)
    assert "MAX_BODY_BYTES" in message
    assert client.get("/health").status_code == 200

    # chunked, no Content-Length: cut off once the count passes the limit
    def chunks() -> Iterator[bytes]:
        for i in range(0, len(big), 64 * 1024):
            yield big[i : i + 64 * 1024]

    with httpx.Client(base_url=str(client.base_url), timeout=120.0) as fresh:
        assert_error(fresh.post(path, content=chunks()), 413)


@pytest.mark.parametrize(("path", "field"), ROUTES)
@pytest.mark.parametrize(
    "body",
    [b'{"inputs": "unterminated', b"not json at all", b"", b'{"input": "\\ud800"}', b"\xff\xfe\x00"],
    ids=["unterminated", "not-json", "empty", "lone-surrogate", "not-utf8"],
)
def test_malformed_json_is_422(client: httpx.Client, path: str, field: str, body: bytes) -> None:
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert "JSON" in assert_error(r, 422)


@pytest.mark.parametrize(("path", "field"), ROUTES)
@pytest.mark.parametrize("body", [b'["a", "b"]', b'"a"', b"42", b"null"])
def test_body_that_is_not_an_object_is_422(client: httpx.Client, path: str, field: str, body: bytes) -> None:
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert "object" in assert_error(r, 422)


def test_wrong_types_for_options_are_422(client: httpx.Client) -> None:
    assert_error(client.post("/v1/embed", json={"inputs": "x", "normalize": "yes"}), 422, "normalize")
    assert_error(client.post("/v1/embed", json={"inputs": "x", "truncate": 0}), 422, "truncate")
    assert_error(client.post("/v1/embed", json={"inputs": "x", "unknown": 1}), 422, "unknown")
    assert_error(client.post("/v1/embeddings", json={"input": "x", "dimensions": "384"}), 422, "dimensions")


@pytest.mark.parametrize(("path", "field"), ROUTES)
def test_bad_request_timeout_header_is_400(client: httpx.Client, path: str, field: str) -> None:
    for value in ("soon", "-1", "0"):
        r = client.post(path, json={field: "x"}, headers={"x-request-timeout": value})
        assert_error(r, 400, "X-Request-Timeout")


def test_unknown_route_and_wrong_method_are_json_errors(client: httpx.Client) -> None:
    assert_error(client.get("/v1/nothing-here"), 404)
    assert_error(client.get("/v1/embed"), 405)
    assert_error(client.put("/v1/embeddings", json={"input": "x"}), 405)


def test_odd_but_valid_texts_are_embedded(client: httpx.Client) -> None:
    texts = [" ", "\u0000", "emoji 🙂 and 中文 and ümlauts", "\n\t", "a" * 3000]
    r = client.post("/v1/embed", json={"inputs": texts})
    assert r.status_code == 200, r.text
    assert len(r.json()["embeddings"]) == len(texts)


# --- meta routes ----------------------------------------------------------------------------
def test_health_and_ready(client: httpx.Client) -> None:
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = client.get("/ready")
    assert r.status_code == 200 and r.json() == {"status": "ready"}


def test_models_list_openai_shape(client: httpx.Client, engine: Engine) -> None:
    r = client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert len(body["data"]) == 1
    card = body["data"][0]
    assert set(card) >= {"id", "object", "created", "owned_by"}
    assert card["id"] == engine.model_name and card["object"] == "model"
    assert isinstance(card["created"], int)


def test_openapi_describes_both_request_bodies(client: httpx.Client) -> None:
    spec = client.get("/openapi.json").json()
    for path, field in ROUTES:
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert field in schema["properties"] and field in schema["required"]
        assert "422" in spec["paths"][path]["post"]["responses"]


def test_server_log_has_no_tracebacks(server: Server, client: httpx.Client) -> None:
    """After all of the above (module order), nothing was an unhandled error."""
    client.get("/health")
    log = server.log()
    assert "Traceback" not in log and "unhandled error" not in log, log[-3000:]


@pytest.mark.parametrize("stage", SERVER_STAGES)
def test_importing_a_stage_starts_nothing(stage: str) -> None:
    """Importing a stage's modules starts no thread, registers no exit hook, configures no
    logging and builds at most its own app: what has a lifetime starts in the lifespan."""
    probe = f"""
import atexit, gc, logging, threading
hooks = []
atexit.register = lambda f, *a, **k: hooks.append(f)
import fastapi
built = []
init = fastapi.FastAPI.__init__
fastapi.FastAPI.__init__ = lambda self, *a, **k: (built.append(k.get("title")), init(self, *a, **k))[1]
before = {{t.name for t in threading.enumerate()}}
import importlib, pkgutil, {stage}
for info in pkgutil.iter_modules({stage}.__path__):
    importlib.import_module("{stage}." + info.name)
after = {{t.name for t in threading.enumerate()}}
handlers = {{n: logging.getLogger(n).handlers for n in ("embedserve", "uvicorn", "")}}
print(sorted(after - before), hooks, built, handlers)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.startswith("[] [] "), out  # no new thread, no atexit hook
    assert out.count("'stage") <= 1, out  # at most one app, its own
    assert "Handler" not in out, out  # no logging handler installed
