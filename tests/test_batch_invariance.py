"""The served default INT8 gives a text the same vector alone and in any batch: through the engine,
through a real stage 3 server that batches it with its own and other requests' texts, and out of
stage 4's cache, whatever batch first computed it.

The build serves row-wise INT8 as `int8` because it is batch invariant (tests/test_build_model.py);
these tests hold the default to it, with the default settings. Dynamic INT8 is the control: on the
same texts it must differ, or these texts would not show anything. ``INVARIANCE_ATOL`` is the largest
difference of one component that still counts as the same vector (float rounding); row-wise INT8
measures 0 on this machine.
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
from stage0_script.quality import INVARIANCE_ATOL


def mixed(n: int, seed: int) -> list[str]:
    """``n`` new texts of mixed length: a word to a paragraph, so every batch is padded."""
    return [f"{t} [{i}]" for i, t in enumerate(corpus_texts(n, seed=seed, kind="mixed"))]


def largest_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


def alone_and_batched(engine: Engine, texts: list[str], size: int) -> float:
    alone = np.concatenate([engine.embed([t]).vectors for t in texts])
    batched = np.concatenate([engine.embed(texts[i : i + size]).vectors for i in range(0, len(texts), size)])
    return largest_difference(alone, batched)


@pytest.mark.parametrize("size", [8, 32])
def test_the_served_engine_gives_a_text_the_same_vector_alone_and_in_a_batch(
    settings: Settings, engine: Engine, size: int
) -> None:
    texts = mixed(32, seed=31)
    assert alone_and_batched(engine, texts, size) <= INVARIANCE_ATOL, engine.variant
    # The control: per-call scales move the same texts' vectors by far more than rounding.
    dynamic = Engine(settings.model_dir, variant="int8-dynamic")
    assert alone_and_batched(dynamic, texts, size) > 100 * INVARIANCE_ATOL


def embed(client: httpx.Client, texts: list[str]) -> tuple[np.ndarray, httpx.Response]:
    response = client.post("/v1/embed", json={"inputs": texts})
    assert response.status_code == 200, response.text
    return np.asarray(response.json()["embeddings"], dtype=np.float32), response


async def _at_once(url: str, texts: list[str]) -> list[httpx.Response]:
    """One request per text, all sent at once: the batcher queues them while the model is busy."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await asyncio.gather(*(client.post("/v1/embed", json={"inputs": [t]}) for t in texts))


def test_a_stage3_server_gives_the_same_vector_alone_and_batched(tmp_path) -> None:  # type: ignore[no-untyped-def]
    texts = mixed(40, seed=37)
    with run_server("stage3_batching", tmp_path) as server:  # the default settings and model
        with httpx.Client(base_url=server.url, timeout=120) as client:
            alone = [embed(client, [t]) for t in texts]
            in_8, of_8 = embed(client, texts[:8])  # one request, one batch of 8 mixed lengths
            in_32, of_32 = embed(client, texts[8:])  # and one of 32
        answers = asyncio.run(_at_once(server.url, texts))  # 40 requests, batched by the server
    assert {r.headers["x-batch-size"] for _, r in alone} == {"1"}
    assert of_8.headers["x-batch-size"] == "8" and of_32.headers["x-batch-size"] == "32"
    vectors = np.concatenate([v for v, _ in alone])
    assert largest_difference(vectors[:8], in_8) <= INVARIANCE_ATOL
    assert largest_difference(vectors[8:], in_32) <= INVARIANCE_ATOL

    assert all(r.status_code == 200 for r in answers)
    sizes = [int(r.headers["x-batch-size"]) for r in answers]
    assert max(sizes) > 1, f"the requests were never batched together: {sizes}"
    together = np.asarray([r.json()["embeddings"][0] for r in answers], dtype=np.float32)
    assert largest_difference(vectors, together) <= INVARIANCE_ATOL


def test_a_cached_vector_equals_a_fresh_one_whatever_batch_made_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    texts = [*fresh_texts(2), *mixed(38, seed=41)]
    with (
        run_server("stage3_batching", tmp_path / "fresh") as fresh,
        httpx.Client(base_url=fresh.url, timeout=120) as client,
    ):
        computed_alone = np.concatenate([embed(client, [t])[0] for t in texts])
    with (
        run_server("stage4_cache_backpressure", tmp_path / "cached") as cached,
        httpx.Client(base_url=cached.url, timeout=120) as client,
    ):
        # Each text's vector is made in a batch: the first 8 in one of 8, the rest in one of 32.
        for batch in (texts[:8], texts[8:]):
            _, first = embed(client, batch)
            assert first.headers["x-cache"] == "miss" and first.headers["x-batch-size"] == str(len(batch))
        hits = [embed(client, [t]) for t in texts]
    assert {r.headers["x-cache"] for _, r in hits} == {"hit"}
    from_cache = np.concatenate([v for v, _ in hits])
    assert largest_difference(from_cache, computed_alone) <= INVARIANCE_ATOL
