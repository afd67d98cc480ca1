"""Every server stage returns the stage 0 engine's vectors for the same input.

Tolerance: the INT8 model is *dynamically* quantized, so each model call picks its
activation scales from the whole padded batch. A text's vector therefore depends on its
batch mates (up to ~0.03 per component, see the first test), while the same batch always
gives the same answer (permutation included). So each comparison puts exactly the same
texts in one model call on both sides: a single-text request against the engine on that
text alone, a multi-text request against ``engine.embed`` of the same list. Then atol=1e-5
leaves room only for float summation order, not for a different computation.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from conftest import SERVER_STAGES, Server

from common.corpus import texts as corpus_texts
from common.engine import Engine

ATOL = 1e-5


def fresh_texts(n: int, kind: str = "mixed") -> list[str]:
    """Texts no stage has seen (no cache can answer them from an earlier batch)."""
    return corpus_texts(n, seed=random.randrange(1, 10**9), kind=kind)


@pytest.fixture(scope="module", params=SERVER_STAGES)
def client(request: pytest.FixtureRequest, stage_server) -> Iterator[httpx.Client]:  # type: ignore[no-untyped-def]
    server: Server = stage_server(request.param)
    with httpx.Client(base_url=server.url, timeout=120.0) as c:
        yield c


def test_batch_mates_change_int8_vectors(engine: Engine) -> None:
    """Why the comparisons below are like-for-like (and why 1e-5 is not vacuous)."""
    texts = corpus_texts(12, seed=5, kind="mixed")
    alone = np.stack([engine.embed([t]).vectors[0] for t in texts])
    together = engine.embed(texts).vectors
    assert np.abs(alone - together).max() > 100 * ATOL
    shuffled = [texts[i] for i in reversed(range(len(texts)))]
    np.testing.assert_allclose(engine.embed(shuffled).vectors[::-1], together, atol=ATOL)


def test_single_texts_match_the_engine_alone(client: httpx.Client, engine: Engine) -> None:
    for text in fresh_texts(3, "query") + fresh_texts(2, "sentence") + fresh_texts(1, "passage"):
        expected = engine.embed([text]).vectors[0]
        r = client.post("/v1/embed", json={"inputs": text})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["embeddings"][0], expected, atol=ATOL)


def test_single_texts_on_the_openai_route(client: httpx.Client, engine: Engine) -> None:
    for text in fresh_texts(3):
        r = client.post("/v1/embeddings", json={"input": text, "encoding_format": "float"})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(
            r.json()["data"][0]["embedding"], engine.embed([text]).vectors[0], atol=ATOL
        )


def test_raw_vectors_match(client: httpx.Client, engine: Engine) -> None:
    text = fresh_texts(1)[0]
    r = client.post("/v1/embed", json={"inputs": text, "normalize": False})
    np.testing.assert_allclose(
        r.json()["embeddings"][0], engine.embed([text], normalize=False).vectors[0], atol=ATOL
    )


@pytest.mark.parametrize("normalize", [True, False])
def test_a_list_matches_the_engine_on_the_same_list(
    client: httpx.Client, engine: Engine, normalize: bool
) -> None:
    texts = fresh_texts(8)
    expected = engine.embed(texts, normalize=normalize).vectors
    r = client.post("/v1/embed", json={"inputs": texts, "normalize": normalize})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["embeddings"], expected, atol=ATOL)
