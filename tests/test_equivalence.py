"""Every server stage returns the stage 0 engine's vectors for the same input.

Tolerance. The INT8 model is *dynamically* quantized: each model call picks its activation
scales from the whole padded batch, so a text's vector depends on its batch mates (the
first test measures by how much: about as much as INT8 differs from fp32), while the same
batch always gives the same answer, in any order. So:

* where the server's model call is known, the comparison puts exactly the same texts in
  one engine call, and ``ATOL = 1e-5`` leaves room for float summation order only: a
  single-text request against the engine on that text alone; a request of texts that all
  fill the 256-token limit (one length, so even a stage that groups texts by length runs
  them in one call) against ``engine.embed`` of the same list;
* a list of mixed lengths may be run as several calls (stage 3 groups by length), so its
  vectors are only held to the batch-mates bound, ``BATCH_MATES_COS``, measured below.
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

ATOL = 1e-5
BATCH_MATES_COS = 0.97  # lowest cosine seen between "alone" and "in a batch" here: ~0.98


@pytest.fixture(scope="module", params=SERVER_STAGES)
def client(request: pytest.FixtureRequest, stage_server) -> Iterator[httpx.Client]:  # type: ignore[no-untyped-def]
    server: Server = stage_server(request.param)
    with httpx.Client(base_url=server.url, timeout=120.0) as c:
        yield c


def test_batch_mates_change_int8_vectors_within_a_bound(engine: Engine) -> None:
    """Why the comparisons below are like-for-like (and why 1e-5 is not vacuous)."""
    texts = corpus_texts(12, seed=5, kind="mixed")
    alone = np.stack([engine.embed([t]).vectors[0] for t in texts])
    together = engine.embed(texts).vectors
    assert np.abs(alone - together).max() > 100 * ATOL
    assert (alone * together).sum(axis=1).min() > BATCH_MATES_COS
    np.testing.assert_allclose(engine.embed(texts[::-1]).vectors[::-1], together, atol=ATOL)


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


def test_a_mixed_list_stays_within_the_batch_mates_bound(client: httpx.Client, engine: Engine) -> None:
    texts = fresh_texts(8, "mixed")
    expected = engine.embed(texts).vectors
    r = client.post("/v1/embed", json={"inputs": texts})
    assert r.status_code == 200, r.text
    got = np.asarray(r.json()["embeddings"], dtype=np.float32)
    similarity = got @ expected.T
    assert np.diagonal(similarity).min() > BATCH_MATES_COS
    assert list(similarity.argmax(axis=1)) == list(range(len(texts)))  # each row is its own text
