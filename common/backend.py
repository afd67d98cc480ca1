"""What a stage's backend sees and returns: the job (validated texts and options), the result,
and the helpers every backend uses on the way (validation, tokenizing, the truncation check).

``common.api`` turns a request into an ``EmbedJob`` and an ``EmbedResult`` into the answer and
its headers; a stage supplies only the backend in between.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive

from common.engine import Engine, TokenizedText
from common.limits import APIError
from common.settings import Settings

# Tokenizing this many characters on the event loop would stall it; hand it to a thread.
_TOKENIZE_IN_THREAD_CHARS = 8_000


# --- what a backend sees and returns -------------------------------------------
@dataclass(slots=True)
class EmbedJob:
    """One validated request, handed to a stage's backend. The backend tokenizes (``tokenize``),
    so a stage with a cache can answer a hit before the tokenizer runs."""

    texts: list[str]
    normalize: bool = True
    truncate: bool = True  # false: a text over the model's token limit is a 422
    use_cache: bool = True
    deadline: float | None = None  # time.monotonic() after which the answer is useless
    param: str = "inputs"  # the body field the texts came from, for error messages
    # The request's ASGI channel, where a client hanging up arrives (stage 4 drops its work then).
    receive: Receive | None = None


@dataclass(slots=True)
class EmbedResult:
    """What a backend answers; the contract turns the optional fields into response headers."""

    vectors: np.ndarray  # (len(texts), dim) float32, normalized when the job asked
    n_tokens: list[int]  # per text, special tokens included (OpenAI `usage`)
    truncated: list[bool]  # per text: cut at the model's token limit?
    inference_ms: float = 0.0  # model time this request waited on (0: no model ran, a cache hit)
    queue_ms: float | None = None  # stages with a queue: the longest wait of the request's texts
    batch_sizes: list[int] | None = None  # stages that batch: the sizes of the request's batches
    cache_hits: int | None = None  # stages with a cache: texts answered from it (None: no cache)
    cache_bypassed: bool = False  # the client asked not to use the cache (`cache: false`, no-cache)


class Backend(Protocol):
    """What every stage's backend is: started and closed by the app's lifespan, asked to embed in
    between. ``draining`` is true from a drain's start (stage 4): ``/ready`` answers 503 then."""

    @property
    def draining(self) -> bool: ...

    async def start(self) -> None: ...

    async def embed(self, job: EmbedJob) -> EmbedResult: ...

    async def close(self) -> None: ...


BackendFactory = Callable[[Engine, Settings], Backend]


# --- what every backend does on the way -------------------------------------------
def validate_texts(texts: list[str], settings: Settings, param: str) -> None:
    if not texts:
        raise APIError(422, f"`{param}` is an empty list; send at least one text", param=param)
    if len(texts) > settings.max_items:
        raise APIError(
            422,
            f"`{param}` holds {len(texts)} texts; at most MAX_ITEMS={settings.max_items} per request",
            param=param,
        )
    for i, text in enumerate(texts):
        if not text:
            raise APIError(422, f"`{param}[{i}]` is an empty string", param=f"{param}[{i}]")
        if len(text) > settings.max_chars:
            raise APIError(
                422,
                f"`{param}[{i}]` has {len(text)} characters; at most MAX_CHARS={settings.max_chars}",
                param=f"{param}[{i}]",
            )


async def tokenize(engine: Engine, job: EmbedJob, rows: list[int] | None = None) -> list[TokenizedText]:
    """Token ids of the job's texts (or of those at ``rows``); 422 past the token limit when the
    job does not allow truncation. Short input is tokenized on the event loop (microseconds a
    text), long input in a thread so it cannot stall the loop."""
    rows = list(range(len(job.texts))) if rows is None else rows
    texts = [job.texts[i] for i in rows]
    if sum(len(t) for t in texts) > _TOKENIZE_IN_THREAD_CHARS:
        tokens = await run_in_threadpool(engine.tokenize, texts)
    else:
        tokens = engine.tokenize(texts)
    check_truncation(engine, job, zip(rows, (t.truncated for t in tokens), strict=True))
    return tokens


def check_truncation(engine: Engine, job: EmbedJob, flags: Iterable[tuple[int, bool]]) -> None:
    """For a job with ``truncate`` false: 422 naming the first text (row, was it cut?) that was cut."""
    if job.truncate:
        return
    for i, cut in flags:
        if cut:
            raise APIError(
                422,
                f"`{job.param}[{i}]` is longer than the model's {engine.max_tokens}-token limit"
                " and `truncate` is false",
                param=f"{job.param}[{i}]",
            )
