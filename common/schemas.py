"""The bodies of the API contract: what a client sends and what it gets back.

Requests are strict (``"normalize": "yes"`` is an error, not a guess) and parsed straight
from bytes by pydantic-core (see ``common.routing.read_body``). The response models are only
documentation for ``/openapi.json`` (and for schemathesis, which checks answers against
them): the routes build their answers as plain dicts and encode them with orjson.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr


# --- requests -------------------------------------------------------------------
class EmbedRequest(BaseModel):
    """Body of ``POST /v1/embed``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    inputs: StrictStr | list[StrictStr] = Field(description="One text or a list of texts.")
    normalize: bool = Field(True, description="L2-normalize the vectors.")
    truncate: bool = Field(True, description="Cut texts at the model's token limit; false: 422.")
    cache: bool = Field(True, description="Let the server answer from its cache (stage 4+).")


class OpenAIEmbeddingRequest(BaseModel):
    """Body of ``POST /v1/embeddings``, the OpenAI embeddings request."""

    # Unknown fields are ignored, as OpenAI-compatible servers do: new client versions add some.
    model_config = ConfigDict(extra="ignore", strict=True)
    input: StrictStr | list[StrictStr] = Field(description="One text or a list of texts.")
    model: str | None = Field(None, description="The served model's id (see /v1/models).")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="`base64`: little-endian float32 bytes, as the `openai` client asks by default."
    )
    dimensions: int | None = Field(None, description="Must equal the model's dimensions.")
    user: str | None = None


# --- responses (documentation only) ---------------------------------------------
class EmbedResponse(BaseModel):
    embeddings: list[list[float]]
    model: str
    dimensions: int
    truncated: list[bool] = Field(description="Per text: was it cut at the token limit?")


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="Floats, or base64 of float32 bytes.")


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Status(BaseModel):
    status: str


class ErrorDetail(BaseModel):
    type: str
    message: str
    param: str | None
    code: int | None


class ErrorResponse(BaseModel):
    """Every error, on every route: the OpenAI error shape."""

    error: ErrorDetail
