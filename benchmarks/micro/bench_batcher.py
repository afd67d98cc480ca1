"""The batcher's own cost per request, with a trivial model so only the queueing is measured."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from common.engine import Engine
from common.settings import Settings
from stage3_batching.refined import refined


def _trivial_model(ids: Sequence[np.ndarray]) -> np.ndarray:
    return np.zeros((len(ids), 384), dtype=np.float32)


@pytest.fixture(scope="module")
def batcher(loop: asyncio.AbstractEventLoop, settings: Settings) -> Iterator[refined]:
    batcher = refined(_trivial_model, settings)
    loop.run_until_complete(batcher.start())
    yield batcher
    loop.run_until_complete(batcher.close())


@pytest.mark.parametrize("concurrent", (1, 8, 64))
def bench_burst(
    benchmark: pytest.FixtureRequest,
    loop: asyncio.AbstractEventLoop,
    batcher: refined,
    engine: Engine,
    sentences: list[str],
    concurrent: int,
) -> None:
    """``concurrent`` one-text requests at once; one alone (LOW tier: no window) is the floor a
    batcher adds. Divide by ``requests`` for the cost of one."""
    tokens = engine.tokenize(sentences[:concurrent])

    async def burst() -> list[object]:
        return await asyncio.gather(*(batcher.submit(tokens[i : i + 1]) for i in range(concurrent)))

    benchmark.group = "batcher: overhead per request"
    benchmark.extra_info["requests"] = concurrent
    outs = benchmark(lambda: loop.run_until_complete(burst()))
    assert len(outs) == concurrent
