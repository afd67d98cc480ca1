"""Properties of the stage 3 batcher, for any interleaving hypothesis can find.

Submissions of one to four texts, cancellations at any point, deadlines that pass before,
during or after the model call, and a model that fails on a poisoned token id. Whatever
the order:

* every request is answered exactly once (a result, or one error), none left pending;
* a result holds the vectors of that request's own texts, in order, as the model gives
  them for each text alone;
* a model failure reaches only the requests holding the poisoned text;
* the queue is empty and nothing is in flight afterwards.

The fake model is deterministic per text, so "as the model gives them alone" is exact;
one more property runs the real (static, batch-invariant) INT8 engine. The textbook batcher
(no failure isolation) is held to the same properties, except that a model failure may reach
every request of the failed batch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from common.engine import Engine, TokenizedText, l2_normalize
from common.limits import DeadlineExceeded
from common.settings import Settings
from stage3_batching.batcher import Batcher
from stage3_batching.refined import refined

# `make test` runs a bounded number of examples; `make fuzz` sets FUZZ_EXAMPLES much higher.
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))
POISON = 999
DIM = 6


class PoisonedInput(ValueError):
    pass


def fake_vector(ids: np.ndarray) -> np.ndarray:
    """A vector that depends on every id and its position, so a swapped row is caught."""
    weights = np.arange(1, len(ids) + 1)
    return np.array(
        [len(ids), ids.sum(), (ids * weights).sum(), ids[0], ids[-1], (ids**2).sum() % 97],
        dtype=np.float32,
    )


class FakeModel:
    """Stands in for ``Engine.run``: fails a whole batch holding POISON, like a model that chokes."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, ids: list[np.ndarray]) -> np.ndarray:
        with self.lock:
            self.calls.append(len(ids))
        if self.delay_s:
            time.sleep(self.delay_s)
        if any(POISON in row for row in ids):
            raise PoisonedInput(f"poison in a batch of {len(ids)}")
        return np.stack([fake_vector(row) for row in ids])


@dataclass(frozen=True)
class Submission:
    texts: tuple[tuple[int, ...], ...]
    deadline_ms: float | None  # from submission; 0: already past
    cancel_after: int | None  # event-loop ticks before the caller gives up
    pause: int  # ticks before the next submission


_ids = st.lists(st.integers(1, 50) | st.just(POISON), min_size=1, max_size=12).map(tuple)
_submission = st.builds(
    Submission,
    texts=st.lists(_ids, min_size=1, max_size=4).map(tuple),
    deadline_ms=st.none() | st.sampled_from([0.0, 0.5, 2.0, 20.0, 1_000.0]),
    cancel_after=st.none() | st.integers(0, 20),
    pause=st.integers(0, 3),
)
_settings = st.fixed_dictionaries(
    {
        "max_batch_size": st.integers(1, 8),
        "max_batch_tokens": st.integers(12, 64),
        "batch_window_ms": st.sampled_from([0.0, 0.5, 2.0]),
        "batch_concurrency": st.integers(1, 3),
        "batch_low_threshold": st.integers(1, 4),
        "batch_high_threshold": st.integers(4, 10),
        "group_by_length": st.booleans(),
        "group_window": st.integers(1, 32),
    }
)


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _tokens(texts: Sequence[Sequence[int]]) -> list[TokenizedText]:
    return [TokenizedText(np.asarray(t, dtype=np.int64), truncated=False) for t in texts]


async def _caller(batcher: Batcher, sub: Submission) -> np.ndarray:
    deadline = None if sub.deadline_ms is None else time.monotonic() + sub.deadline_ms / 1e3
    outcome = await batcher.submit(_tokens(sub.texts), deadline=deadline)
    return outcome.vectors


async def _scenario(
    config: dict[str, object], subs: list[Submission], delay_s: float, kind: type[Batcher] = refined
) -> None:
    model = FakeModel(delay_s)
    batcher = kind(model, Settings.model_validate(config))
    isolated = kind is refined
    any_poison = any(POISON in t for sub in subs for t in sub.texts)
    errors = _Errors()
    logging.getLogger("embedserve.batcher").addHandler(errors)
    try:
        await batcher.start()
        tasks: list[asyncio.Task[np.ndarray]] = []
        for sub in subs:
            task = asyncio.create_task(_caller(batcher, sub))
            tasks.append(task)
            if sub.cancel_after is not None:
                _cancel_later(task, sub.cancel_after)
            for _ in range(sub.pause):
                await asyncio.sleep(0)
        _, pending = await asyncio.wait(tasks, timeout=30)
        assert not pending, f"{len(pending)} requests never answered"
        for sub, task in zip(subs, tasks, strict=True):
            _check_answer(sub, task, innocent_may_fail=any_poison and not isolated)
        # Texts of callers that gave up are dropped when the loop reaches them, and a batch whose
        # callers all gave up still finishes in the model: both drain without new submissions.
        await asyncio.wait_for(_until(lambda: batcher.queue_depth == 0 and batcher.in_flight == 0), 10)
        await asyncio.wait_for(batcher.close(), timeout=10)
        # A future resolved twice, or any other surprise in the loop, is logged as an error.
        assert not errors.records, [r.getMessage() for r in errors.records]
        assert all(0 < n <= batcher.settings.max_batch_size for n in model.calls)
    finally:
        logging.getLogger("embedserve.batcher").removeHandler(errors)
        if batcher._pool is not None:
            batcher._pool.shutdown(wait=True)


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.001)


def _cancel_later(task: asyncio.Task[np.ndarray], ticks: int) -> None:
    async def cancel() -> None:
        for _ in range(ticks):
            await asyncio.sleep(0)
        task.cancel()

    asyncio.get_running_loop().create_task(cancel())


# --8<-- [start:check]
def _check_answer(sub: Submission, task: asyncio.Task[np.ndarray], innocent_may_fail: bool = False) -> None:
    poisoned = any(POISON in t for t in sub.texts)
    if task.cancelled():
        assert sub.cancel_after is not None, "cancelled without its caller asking"
        return
    exc = task.exception()
    if exc is None:
        assert not poisoned, "a request holding the poisoned text got vectors"
        want = np.stack([fake_vector(np.asarray(t, dtype=np.int64)) for t in sub.texts])
        np.testing.assert_array_equal(task.result(), want)
    elif isinstance(exc, DeadlineExceeded):
        assert sub.deadline_ms is not None, "504 without a deadline"
        assert exc.status == 504
    else:
        assert isinstance(exc, PoisonedInput), f"unexpected error {exc!r}"
        assert poisoned or innocent_may_fail, "an innocent request failed with its neighbour's model error"


# --8<-- [end:check]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=_settings, subs=st.lists(_submission, min_size=1, max_size=25), delay=st.sampled_from([0, 0.001])
)
def test_any_interleaving_answers_everyone_once_with_their_own_vectors(
    config: dict[str, object], subs: list[Submission], delay: float
) -> None:
    note(f"config={config} delay={delay}")
    note(f"subs={subs}")
    asyncio.run(_scenario(config, subs, delay))


@settings(max_examples=max(EXAMPLES // 2, 10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=_settings, subs=st.lists(_submission, min_size=1, max_size=25))
def test_the_textbook_batcher_answers_everyone_once_too(
    config: dict[str, object], subs: list[Submission]
) -> None:
    note(f"config={config}")
    note(f"subs={subs}")
    asyncio.run(_scenario(config, subs, 0.0, Batcher))


def test_poison_fails_only_the_guilty_request() -> None:
    """A poisoned batch, written out: eight callers in one batch, one of them poisoned."""
    subs = [Submission(((i + 1, i + 2),), None, None, 0) for i in range(8)]
    subs[5] = Submission(((3, POISON, 4),), None, None, 0)
    config = {"max_batch_size": 8, "batch_window_ms": 50.0, "batch_low_threshold": 1}

    async def run() -> list[BaseException | None]:
        model = FakeModel(0)
        batcher = refined(model, Settings.model_validate(config))
        await batcher.start()
        results = await asyncio.gather(*(_caller(batcher, s) for s in subs), return_exceptions=True)
        await batcher.close()
        assert model.calls[0] == 8  # they really shared one batch before it was split
        return [r if isinstance(r, BaseException) else None for r in results]

    errors = asyncio.run(run())
    assert [e is not None for e in errors] == [i == 5 for i in range(8)]
    assert isinstance(errors[5], PoisonedInput)


# --- the real engine ---------------------------------------------------------------------
_words = st.sampled_from(["cat", "dog", "a", "the", "embedding", "server", "🙂", "naïve", "東京", "x" * 40])
_text = st.lists(_words, min_size=1, max_size=30).map(" ".join)


@pytest.fixture(scope="module")
def real_engine() -> Engine:
    # Static INT8 is batch invariant (tests/test_engine.py), so "the same vectors as alone" is
    # exact here; dynamic INT8 rescales activations per batch and would blur the comparison.
    engine = Engine(Settings().model_dir, variant="int8-static")
    engine.warmup()
    return engine


@settings(max_examples=max(EXAMPLES // 5, 5), deadline=None, suppress_health_check=list(HealthCheck))
@given(requests=st.lists(st.lists(_text, min_size=1, max_size=4), min_size=1, max_size=8))
def test_real_engine_batched_equals_alone(real_engine: Engine, requests: list[list[str]]) -> None:
    async def run() -> list[np.ndarray]:
        batcher = refined(real_engine.run, Settings.model_validate({"batch_window_ms": 5.0}))
        await batcher.start()
        outs = await asyncio.gather(*(batcher.submit(real_engine.tokenize(r)) for r in requests))
        assert batcher.queue_depth == 0
        await batcher.close()
        return [o.vectors for o in outs]

    for texts, got in zip(requests, asyncio.run(run()), strict=True):
        alone = real_engine.embed(texts).vectors
        cosine = (l2_normalize(got) * alone).sum(axis=1)
        assert cosine.min() > 0.9999, (texts, cosine)
