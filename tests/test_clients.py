"""The clients people use, unchanged, against a running stage 5 over a real socket.

LangChain's ``OpenAIEmbeddings`` and LlamaIndex's OpenAI-compatible classes talk to the
OpenAI-shaped route (the official ``openai`` client has its own suite, ``test_openai_client.py``).
Both send a default model name when none is given (``text-embedding-ada-002``): by default that
is a 404 naming the served model; ``MODEL_ALIASES`` lets an operator accept it on purpose.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from conftest import Server
from fresh import fresh_texts
from langchain_openai import OpenAIEmbeddings
from llama_index.embeddings.openai import OpenAIEmbedding
from llama_index.embeddings.openai_like import OpenAILikeEmbedding

from common.engine import Engine
from common.settings import Settings

STAGE = "stage5_metrics"
CLIENT_DEFAULTS = ["text-embedding-ada-002", "text-embedding-3-small"]  # what the clients send unasked


@pytest.fixture(scope="module")
def server(stage_server) -> Server:  # type: ignore[no-untyped-def]
    return stage_server(STAGE)


@pytest.fixture(scope="module")
def served_id(server: Server) -> str:
    return str(httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"])


@pytest.fixture
def aliased(server_factory) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    """Stage 5 with the clients' default names accepted as aliases of the served model."""
    with server_factory(STAGE, {"MODEL_ALIASES": ",".join(CLIENT_DEFAULTS)}) as srv:
        yield srv


def close(got: list[list[float]], engine: Engine, texts: list[str]) -> None:
    """The client's vectors are the texts' own, in order: each is nearest the engine's vector of
    its own text, cosine > 0.98. (Not allclose: dynamic INT8 moves a vector a little with its
    batch-mates, and the server batches as it likes; test_equivalence.py pins that down.)"""
    mine = np.asarray(got, dtype=np.float32)
    alone = np.stack([engine.embed([t]).vectors[0] for t in texts])
    cosines = mine @ alone.T  # both normalized
    assert list(cosines.argmax(axis=1)) == list(range(len(texts)))
    assert cosines.diagonal().min() > 0.98, cosines.diagonal()


# --- LangChain ----------------------------------------------------------------------------------
def langchain(url: str, **kwargs: object) -> OpenAIEmbeddings:
    # check_embedding_ctx_length=False: send the texts, not tiktoken ids of OpenAI's own tokenizer
    # (which this server does not read and whose files would be downloaded at first use).
    return OpenAIEmbeddings(
        base_url=f"{url}/v1", api_key="unused", check_embedding_ctx_length=False, max_retries=0, **kwargs
    )


def test_langchain_embeds_documents_and_a_query(server: Server, served_id: str, engine: Engine) -> None:
    texts = fresh_texts(5)
    client = langchain(server.url, model=served_id)
    documents = client.embed_documents(texts)  # one request
    assert len(documents) == 5 and all(len(v) == 384 for v in documents)
    close(documents, engine, texts)
    close([client.embed_query(texts[0])], engine, texts[:1])


def test_langchain_chunks_must_fit_max_items(server: Server, served_id: str, settings: Settings) -> None:
    texts = fresh_texts(settings.max_items + 6)
    # LangChain sends 1000 texts a request by default: past MAX_ITEMS that is a clear 422.
    with pytest.raises(openai.UnprocessableEntityError) as excinfo:
        langchain(server.url, model=served_id).embed_documents(texts)
    assert "MAX_ITEMS" in str(excinfo.value)
    # chunk_size=MAX_ITEMS: two requests, every text embedded, in order.
    vectors = langchain(server.url, model=served_id, chunk_size=settings.max_items).embed_documents(texts)
    assert len(vectors) == len(texts)


def test_langchain_default_model_is_a_404_naming_the_served_model(server: Server, served_id: str) -> None:
    with pytest.raises(openai.NotFoundError) as excinfo:
        langchain(server.url).embed_query("which model answers?")  # no model: the client's default
    message = str(excinfo.value)
    assert "text-embedding-ada-002" in message and served_id in message and "MODEL_ALIASES" in message


# --- LlamaIndex ---------------------------------------------------------------------------------
def test_llamaindex_openai_like(server: Server, served_id: str, engine: Engine) -> None:
    texts = fresh_texts(4)
    client = OpenAILikeEmbedding(
        model_name=served_id, api_base=f"{server.url}/v1", api_key="unused", embed_batch_size=2, max_retries=0
    )
    vectors = client.get_text_embedding_batch(texts)  # two requests of two
    assert len(vectors) == 4
    close(vectors, engine, texts)
    close([client.get_query_embedding(texts[1])], engine, texts[1:2])


def test_llamaindex_default_model_is_a_404(server: Server, served_id: str) -> None:
    client = OpenAIEmbedding(api_base=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.get_text_embedding("which model answers?")
    assert served_id in str(excinfo.value)


# --- MODEL_ALIASES: the clients' defaults accepted on purpose --------------------------------------
def test_aliases_let_the_clients_defaults_through(aliased: Server, served_id: str, engine: Engine) -> None:
    text = fresh_texts(1)
    close([langchain(aliased.url).embed_query(text[0])], engine, text)
    llama = OpenAIEmbedding(api_base=f"{aliased.url}/v1", api_key="unused", max_retries=0)
    close([llama.get_text_embedding(text[0])], engine, text)
    for name in CLIENT_DEFAULTS:  # the answer names the model that really served it
        body = httpx.post(f"{aliased.url}/v1/embeddings", json={"input": "x", "model": name}).json()
        assert body["model"] == served_id
    other = httpx.post(f"{aliased.url}/v1/embeddings", json={"input": "x", "model": "text-embedding-3-large"})
    assert other.status_code == 404 and served_id in other.json()["error"]["message"]
