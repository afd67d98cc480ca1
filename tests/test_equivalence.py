"""Every server stage returns the stage 0 engine's vectors for the same input.

Tolerance. The served INT8 file (row-wise, the build's choice) gives a text the same vector alone
and in any batch, so every comparison holds to ``ATOL = 1e-5``, room for float summation order
only, whatever calls a stage splits a request into. The first test shows the tolerance is not
vacuous: dynamic INT8 (``MODEL_VARIANT=int8-dynamic``), which picks its activation scales from
the whole padded batch, moves a text's vector by far more with its batch mates.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from conftest import SERVER_STAGES, Server
from fresh import fresh_texts, full_length_texts

from common.corpus import texts as corpus_texts
from common.engine import Engine
from common.settings import Settings

ATOL = 1e-5


@pytest.fixture(scope="module", params=SERVER_STAGES)
def client(request: pytest.FixtureRequest, stage_server) -> Iterator[httpx.Client]:  # type: ignore[no-untyped-def]
    server: Server = stage_server(request.param)
    with httpx.Client(base_url=server.url, timeout=120.0) as c:
        yield c


def test_the_tolerance_tells_batch_mates_apart(settings: Settings, engine: Engine) -> None:
    """Why the comparisons below hold to 1e-5, and why 1e-5 is not vacuous."""
    texts = corpus_texts(12, seed=5, kind="mixed")
    for model, invariant in ((Engine(settings.model_dir, variant="int8-dynamic"), False), (engine, True)):
        alone = np.stack([model.embed([t]).vectors[0] for t in texts])
        together = model.embed(texts).vectors
        moved = float(np.abs(alone - together).max())
        assert moved <= ATOL if invariant else moved > 100 * ATOL, (model.variant, moved)
        np.testing.assert_allclose(model.embed(texts[::-1]).vectors[::-1], together, atol=ATOL)


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
        expected = engine.embed([text]).vectors[0]
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], expected, atol=ATOL)


def test_raw_vectors_match(client: httpx.Client, engine: Engine) -> None:
    text = fresh_texts(1)[0]
    r = client.post("/v1/embed", json={"inputs": text, "normalize": False})
    expected = engine.embed([text], normalize=False).vectors[0]
    np.testing.assert_allclose(r.json()["embeddings"][0], expected, atol=ATOL)


@pytest.mark.parametrize("normalize", [True, False])
def test_a_list_of_one_length_matches_the_engine_on_the_same_list(
    client: httpx.Client, engine: Engine, normalize: bool
) -> None:
    texts = full_length_texts(engine, 8)
    expected = engine.embed(texts, normalize=normalize).vectors
    r = client.post("/v1/embed", json={"inputs": texts, "normalize": normalize})
    assert r.status_code == 200, r.text
    assert r.json()["truncated"] == [True] * 8
    np.testing.assert_allclose(r.json()["embeddings"], expected, atol=ATOL)


def test_a_mixed_list_matches_the_engine(client: httpx.Client, engine: Engine) -> None:
    """Mixed lengths: a stage may run them as several calls (stage 3 groups by length)."""
    texts = fresh_texts(8, "mixed")
    expected = engine.embed(texts).vectors
    r = client.post("/v1/embed", json={"inputs": texts})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["embeddings"], expected, atol=ATOL)
