"""Stage 3 over real sockets: shared batches, the batcher routes, headers, limits, deadlines.

The contract and equivalence suites run against stage 3 too (test_contract.py,
test_equivalence.py); this file checks what batching adds. To make "requests share a
batch" deterministic over HTTP, the servers here run with BATCH_LOW_THRESHOLD=1 (every
batch waits) and a long window, so a batch goes exactly when MAX_BATCH_SIZE texts are in.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from common import corpus
from common.engine import Engine

STAGE = "stage3_batching"
# SPLIT_BY_LENGTH=false: the four texts run as one model call, so each vector can be compared
# exactly with the engine on the same four (dynamic INT8 depends on batch mates).
WAITING = {
    "BATCH_LOW_THRESHOLD": "1",
    "BATCH_WINDOW_MS": "20000",
    "MAX_BATCH_SIZE": "4",
    "SPLIT_BY_LENGTH": "false",
}


def post(url: str, texts: list[str], **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/embed", json={"inputs": texts}, headers=headers, timeout=60.0)


def test_concurrent_requests_share_one_batch(server_factory, engine: Engine) -> None:  # type: ignore[no-untyped-def]
    texts = corpus.texts(4, seed=301, kind="sentence")
    with server_factory(STAGE, WAITING) as srv, ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda t: post(srv.url, [t]), texts))
        metrics = httpx.get(f"{srv.url}/v1/batcher/metrics").json()
    for r in responses:
        assert r.status_code == 200, r.text
        assert r.headers["x-batch-size"] == "4"  # the window is 20 s: only a full batch went
        assert float(r.headers["x-queue-time"]) >= 0
    assert metrics["batches"] == 1 and metrics["texts"] == 4
    assert metrics["batch_size_distribution"] == {"4": 1}
    assert metrics["tiers"]["low"] == 0 and metrics["queue_depth"] == 0
    # Four texts in one model call: each gets what the engine gives for the same batch.
    together = engine.embed(texts).vectors
    got = np.array([r.json()["embeddings"][0] for r in responses])
    np.testing.assert_allclose(got, together, atol=1e-5)


def test_a_request_larger_than_a_batch_is_answered_whole_and_in_order(server_factory, engine: Engine) -> None:  # type: ignore[no-untyped-def]
    texts = corpus.texts(10, seed=302, kind="query")
    env = {"MAX_BATCH_SIZE": "4", "GROUP_BY_LENGTH": "false", "SPLIT_BY_LENGTH": "false"}
    with server_factory(STAGE, env) as srv:
        r = post(srv.url, texts)
        metrics = httpx.get(f"{srv.url}/v1/batcher/metrics").json()
    assert r.status_code == 200, r.text
    assert r.headers["x-batch-size"] == "4,4,2"
    expected = np.concatenate([engine.embed(texts[i : i + 4]).vectors for i in (0, 4, 8)])
    np.testing.assert_allclose(np.array(r.json()["embeddings"]), expected, atol=1e-5)
    assert metrics["batches"] == 3 and metrics["texts"] == 10


def test_config_route_reports_the_live_settings(server_factory) -> None:  # type: ignore[no-untyped-def]
    env = {
        "MAX_BATCH_SIZE": "12",
        "MAX_BATCH_TOKENS": "3000",
        "BATCH_WINDOW_MS": "7.5",
        "GROUP_BY_LENGTH": "false",
        "BATCH_CONCURRENCY": "3",
    }
    with server_factory(STAGE, env) as srv:
        config = httpx.get(f"{srv.url}/v1/batcher/config").json()
    assert config["max_batch_size"] == 12 and config["max_batch_tokens"] == 3000
    assert config["batch_concurrency"] == 3
    assert config["batch_window_ms"] == 7.5 and config["group_by_length"] is False
    assert {"batch_low_threshold", "batch_high_threshold", "group_window"} <= set(config)


def test_batcher_textbook_serves_with_the_textbook_batcher(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A lone request under a window: the textbook batcher makes it wait the whole window, the
    refined one sends it at once (LOW tier). The window is long enough to leave no doubt."""
    window = {"BATCH_WINDOW_MS": "1500"}
    waited = {}
    for kind in ("textbook", "refined"):
        with server_factory(STAGE, {**window, "BATCHER": kind}) as srv:
            assert httpx.get(f"{srv.url}/v1/batcher/config").json()["batcher"] == kind
            r = post(srv.url, corpus.texts(1, seed=305, kind="sentence"))
            assert r.status_code == 200, r.text
            waited[kind] = float(r.headers["x-queue-time"])
    assert waited["textbook"] >= 1400 and waited["refined"] < 700, waited


def test_the_token_budget_splits_long_texts(server_factory) -> None:  # type: ignore[no-untyped-def]
    passages = corpus.texts(6, seed=303, kind="passage")
    env = {"MAX_BATCH_TOKENS": "600", "MAX_BATCH_SIZE": "64"}
    with server_factory(STAGE, env) as srv:
        r = post(srv.url, passages)
        metrics = httpx.get(f"{srv.url}/v1/batcher/metrics").json()
    assert r.status_code == 200, r.text
    sizes = [int(s) for s in r.headers["x-batch-size"].split(",")]
    assert sum(sizes) == 6 and len(sizes) > 1
    assert metrics["padded_tokens"] <= 600 * metrics["batches"]
    assert 0 <= metrics["padding_ratio"] < 1


def test_a_deadline_that_passes_in_the_queue_is_a_504(server_factory) -> None:  # type: ignore[no-untyped-def]
    long = corpus.texts(64, seed=304, kind="passage")
    with server_factory(STAGE, {"MAX_BATCH_SIZE": "8"}) as srv, ThreadPoolExecutor(1) as pool:
        busy = pool.submit(post, srv.url, long)  # 8 batches of long passages hold the model
        deadline = time.monotonic() + 30
        while httpx.get(f"{srv.url}/v1/batcher/metrics").json()["queue_depth"] == 0:
            assert time.monotonic() < deadline and not busy.done(), "the long request never queued"
        r = post(srv.url, ["too late"], **{"X-Request-Timeout": "0.001"})
        assert busy.result().status_code == 200
    assert r.status_code == 504, r.text
    assert r.json()["error"]["type"] == "timeout_error"


@pytest.mark.parametrize("path", ["/v1/batcher/config", "/v1/batcher/metrics"])
def test_batcher_routes_are_json(server_factory, path: str) -> None:  # type: ignore[no-untyped-def]
    with server_factory(STAGE, {}) as srv:
        post(srv.url, ["warm"])
        r = httpx.get(f"{srv.url}{path}")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    if path.endswith("metrics"):
        body = r.json()
        expected = {
            "batches",
            "texts",
            "average_batch_size",
            "batch_size_distribution",
            "tiers",
            "padding_ratio",
            "queue_depth",
            "in_flight",
        }
        assert expected <= set(body)
        assert body["batches"] >= 1 and body["tiers"]["low"] >= 1
