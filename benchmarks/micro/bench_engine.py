"""The engine alone: the model call at several batch sizes, and tokenization on its own."""

from __future__ import annotations

import pytest

from common.engine import Engine

BATCH_SIZES = (1, 8, 32, 64)


@pytest.mark.parametrize("batch", BATCH_SIZES)
def bench_model_call(
    benchmark: pytest.FixtureRequest, engine: Engine, sentences: list[str], batch: int
) -> None:
    """`Engine.run` on pre-tokenized sentences: what one batch costs, padding included."""
    ids = [t.ids for t in engine.tokenize(sentences[:batch])]
    benchmark.group = "engine: model call, wall, default threads"
    benchmark.extra_info["texts"] = batch
    vectors = benchmark(engine.run, ids)
    assert vectors.shape == (batch, engine.dimensions)


@pytest.mark.parametrize("batch", (1, 32))
def bench_tokenize(
    benchmark: pytest.FixtureRequest, engine: Engine, sentences: list[str], batch: int
) -> None:
    """Tokenization alone (it runs on the event loop in every server stage)."""
    texts = sentences[:batch]
    benchmark.group = "engine: tokenize"
    benchmark.extra_info["texts"] = batch
    tokens = benchmark(engine.tokenize, texts)
    assert len(tokens) == batch


def bench_embed_one(benchmark: pytest.FixtureRequest, engine: Engine, sentences: list[str]) -> None:
    """Tokenize + model + normalize for one sentence: stage 1's work per request, without HTTP."""
    benchmark.group = "engine: embed, wall, default threads"
    out = benchmark(engine.embed, sentences[:1])
    assert out.vectors.shape == (1, engine.dimensions)
