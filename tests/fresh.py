"""Texts for the per-stage suites that no stage has seen before (so no cache answers them)."""

from __future__ import annotations

import random

from common.corpus import texts as corpus_texts
from common.engine import Engine


def fresh_texts(n: int, kind: str = "mixed") -> list[str]:
    """``n`` corpus texts from a random seed."""
    return corpus_texts(n, seed=random.randrange(1, 10**9), kind=kind)


def full_length_texts(engine: Engine, n: int) -> list[str]:
    """``n`` fresh texts that all fill the model's token limit, so all have the same length.

    A batching stage may split a request into model calls of similar lengths (stage 3);
    texts of one length stay in one call, so the server's call is the engine's call.
    """
    texts = []
    for passage in fresh_texts(n, "passage"):  # a passage repeated until it passes the limit
        text = passage
        while not engine.tokenize([text])[0].truncated:  # (six times was too few for a short one)
            text = f"{text} {passage}"
        texts.append(text)
    assert all(t.truncated and t.n_tokens == engine.max_tokens for t in engine.tokenize(texts))
    return texts
