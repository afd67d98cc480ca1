"""The official ``openai`` client, unchanged, against every server stage over a real socket."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from conftest import SERVER_STAGES, Server
from fresh import fresh_texts, full_length_texts
from openai import OpenAI

from common.engine import Engine


@pytest.fixture(scope="module", params=SERVER_STAGES)
def server(request: pytest.FixtureRequest, stage_server) -> Server:  # type: ignore[no-untyped-def]
    return stage_server(request.param)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def served_id(server: Server) -> str:
    """The id the server announces; a client would pick it from /v1/models too."""
    return str(httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"])


def test_models_list(client: OpenAI, served_id: str) -> None:
    assert [m.id for m in client.models.list()] == [served_id]


@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_embeddings_match_the_engine(
    client: OpenAI, served_id: str, engine: Engine, encoding_format: str | None
) -> None:
    # None: the client's default, which asks the server for base64 and decodes it itself.
    kwargs = {} if encoding_format is None else {"encoding_format": encoding_format}
    # Texts of one length: one model call on every stage (see test_equivalence.py).
    texts = full_length_texts(engine, 5)
    response = client.embeddings.create(model=served_id, input=texts, **kwargs)  # type: ignore[arg-type]
    assert response.model == served_id
    assert [d.index for d in response.data] == list(range(len(texts)))
    if encoding_format == "base64":  # asked for explicitly, the client hands the strings through
        got = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in response.data])
    else:
        got = np.asarray([d.embedding for d in response.data], dtype=np.float32)
    assert got.shape == (len(texts), 384)
    # the same list through the engine alone; see test_equivalence.py for the tolerance
    np.testing.assert_allclose(got, engine.embed(texts).vectors, atol=1e-5)
    expected_tokens = sum(t.n_tokens for t in engine.tokenize(texts))
    assert response.usage.prompt_tokens == response.usage.total_tokens == expected_tokens


def test_one_string(client: OpenAI, served_id: str, engine: Engine) -> None:
    text = fresh_texts(1)[0]
    response = client.embeddings.create(model=served_id, input=text)
    assert len(response.data) == 1
    np.testing.assert_allclose(response.data[0].embedding, engine.embed([text]).vectors[0], atol=1e-5)
    assert response.usage.prompt_tokens == engine.tokenize([text])[0].n_tokens


def test_bad_input_surfaces_as_the_clients_error_with_our_message(client: OpenAI, served_id: str) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as excinfo:
        client.embeddings.create(model=served_id, input=["fine", ""])
    assert excinfo.value.status_code == 422
    assert "`input[1]` is an empty string" in str(excinfo.value)


def test_bad_header_is_a_bad_request_error(client: OpenAI, served_id: str) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.embeddings.create(model=served_id, input="x", extra_headers={"X-Request-Timeout": "whenever"})
    assert "X-Request-Timeout" in str(excinfo.value)


def test_unknown_model_is_not_found(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.embeddings.create(model="text-embedding-3-small", input="x")
    assert "text-embedding-3-small" in str(excinfo.value)


def test_dimensions_mismatch(client: OpenAI, served_id: str) -> None:
    assert len(client.embeddings.create(model=served_id, input="x", dimensions=384).data[0].embedding) == 384
    with pytest.raises(openai.UnprocessableEntityError) as excinfo:
        client.embeddings.create(model=served_id, input="x", dimensions=128)
    assert "dimensions" in str(excinfo.value)
