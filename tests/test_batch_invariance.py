"""Row-wise INT8 gives a text the same vector alone and in any batch: through the engine, through a
real stage 3 server that batches it with other requests' texts, and out of stage 4's cache.

Dynamic INT8 is the control: on the same texts it must differ, or these texts would not show
anything. ``ATOL`` is the largest difference of one component that still counts as "the same"
(float rounding); row-wise INT8 measures 0 on this machine.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from conftest import run_server
from fresh import fresh_texts

from common.corpus import texts as corpus_texts
from common.engine import Engine
from common.settings import Settings

ATOL = 1e-5
ROWWISE = {"MODEL_VARIANT": "int8-rowwise"}


def mixed(n: int, seed: int) -> list[str]:
    """``n`` new texts of mixed length: a word to a paragraph, so every batch is padded."""
    return [f"{t} [{i}]" for i, t in enumerate(corpus_texts(n, seed=seed, kind="mixed"))]


def alone_and_batched(engine: Engine, texts: list[str], size: int) -> float:
    alone = np.concatenate([engine.embed([t]).vectors for t in texts])
    batched = np.concatenate([engine.embed(texts[i : i + size]).vectors for i in range(0, len(texts), size)])
    return float(np.abs(alone - batched).max())


@pytest.mark.parametrize("size", [8, 32])
def test_the_engine_gives_a_text_the_same_vector_alone_and_in_a_batch(settings: Settings, size: int) -> None:
    texts = mixed(32, seed=31)
    assert alone_and_batched(Engine(settings.model_dir, variant="int8-rowwise"), texts, size) <= ATOL
    # The control: per-call scales move the same texts' vectors by far more than rounding.
    assert alone_and_batched(Engine(settings.model_dir, variant="int8-dynamic"), texts, size) > 100 * ATOL


def embed(client: httpx.Client, texts: list[str]) -> tuple[np.ndarray, httpx.Response]:
    response = client.post("/v1/embed", json={"inputs": texts})
    assert response.status_code == 200, response.text
    return np.asarray(response.json()["embeddings"], dtype=np.float32), response


async def _at_once(url: str, texts: list[str]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await asyncio.gather(*(client.post("/v1/embed", json={"inputs": [t]}) for t in texts))


def test_a_stage3_server_gives_the_same_vector_alone_and_batched_with_other_requests(tmp_path) -> None:  # type: ignore[no-untyped-def]
    texts = mixed(32, seed=37)
    with run_server("stage3_batching", tmp_path, {**ROWWISE, "MAX_BATCH_SIZE": "8"}) as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            alone = np.concatenate([embed(client, [t])[0] for t in texts])
            one_request, response = embed(client, texts)  # one request, four batches of 8
        assert response.headers["x-batch-size"].split(",") == ["8"] * 4
        assert float(np.abs(alone - one_request).max()) <= ATOL
        answers = asyncio.run(_at_once(server.url, texts))  # 32 requests, batched by the server
    assert all(r.status_code == 200 for r in answers)
    sizes = [int(r.headers["x-batch-size"]) for r in answers]
    assert max(sizes) > 1, f"the requests were never batched together: {sizes}"
    together = np.asarray([r.json()["embeddings"][0] for r in answers], dtype=np.float32)
    assert float(np.abs(alone - together).max()) <= ATOL


def test_a_cached_vector_equals_a_fresh_one_whatever_batch_made_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    texts = [*fresh_texts(1), *mixed(31, seed=41)]
    with (
        run_server("stage3_batching", tmp_path / "fresh", ROWWISE) as fresh,
        httpx.Client(base_url=fresh.url, timeout=120) as client,
    ):
        computed_alone = embed(client, texts[:1])[0]
    with (
        run_server("stage4_cache_backpressure", tmp_path / "cached", ROWWISE) as cached,
        httpx.Client(base_url=cached.url, timeout=120) as client,
    ):
        _, first = embed(client, texts)  # the text's vector is made in a batch of 32
        assert first.headers["x-cache"] == "miss"
        from_cache, again = embed(client, texts[:1])
    assert again.headers["x-cache"] == "hit"
    assert float(np.abs(from_cache - computed_alone).max()) <= ATOL
