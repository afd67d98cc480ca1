"""Fixtures for the microbenchmarks (`make bench`); the normal test run never collects this folder."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from common import corpus
from common.engine import Engine
from common.settings import Settings


@pytest.fixture(scope="session")
def settings() -> Settings:
    return Settings()


@pytest.fixture(scope="session")
def engine(settings: Settings) -> Engine:
    engine = Engine.from_settings(settings)
    engine.warmup()
    return engine


@pytest.fixture(scope="session")
def sentences() -> list[str]:
    return corpus.texts(256, seed=11, kind="sentence")  # the load tests' texts, a fixed seed


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop per module, so an async call can be timed with run_until_complete."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()
