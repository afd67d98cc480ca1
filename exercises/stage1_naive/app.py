"""Exercise for stage 1: the backend of the naive server.

Stage 0's script loads the model on every run. Stage 1 loads it once, in a server:
``common.api.create_app`` serves the HTTP contract every stage shares (routes, validation,
limits, errors, headers, JSON) and hands each valid request to the stage's *backend* as an
``EmbedJob``: the texts and the options ``normalize`` and ``truncate``. Write the backend's
``embed``, the one thing stage 1 decides (chapter: docs/stage1.md#the-code).

Your ``NaiveBackend`` extends the stage's own (``stage1_naive/backend.py``), which gives
``__init__`` (``self.engine``) and ``run_model`` (the model call, timed, on the event loop).
Write only ``embed``.

Check your work (stage 1's own server tests, run against this file):

    make exercise STAGE=1

The tests start this file as a server (``python -m common.serve exercises.stage1_naive``): one
short request is answered (while ``embed`` is still to write, that test says so); ``/health``
waits while a long request runs the model, as on stage 1 (``tests/test_event_loop.py``); the
API contract holds (``tests/test_contract.py``: vectors, ``normalize``, ``truncated``, token
counts, errors); the vectors equal the engine's (``tests/test_equivalence.py``).
``make exercise STAGE=1 SOLUTION=1`` runs the same tests against ``stage1_naive/app.py``.

Hints (all imported below):
- ``await tokenize(self.engine, job)``: one ``TokenizedText`` per text, with ``.ids``,
  ``.n_tokens`` and ``.truncated``; it raises the 422 itself when ``job.truncate`` is false
  and a text is too long.
- ``await self.run_model(ids)``: the raw vectors (texts, 384) and the model's time in ms.
- ``l2_normalize(vectors)`` gives each vector length 1; a job with ``normalize`` false wants
  the raw vectors.
- ``EmbedResult(vectors, n_tokens, truncated, inference_ms)``: two lists with one entry a text.
"""

from __future__ import annotations

from common.api import EmbedJob, EmbedResult, create_app, tokenize  # noqa: F401 (tokenize: yours to call)
from common.engine import Engine, l2_normalize  # noqa: F401 (l2_normalize: yours to call)
from common.settings import Settings
from stage1_naive import backend as stage


class NaiveBackend(stage.NaiveBackend):
    async def embed(self, job: EmbedJob) -> EmbedResult:
        """Tokenize ``job.texts``, run the model on their ids, normalize when ``job.normalize``,
        and answer with the vectors, each text's token count and truncation flag, and the
        model's time.

        TODO: the four steps above, in that order.
        """
        raise NotImplementedError(
            "TODO (exercises/stage1_naive/app.py): write NaiveBackend.embed: tokenize, run the model,"
            " normalize when asked, answer"
        )


def make_backend(engine: Engine, settings: Settings) -> NaiveBackend:
    return NaiveBackend(engine)


app = create_app("exercise: stage 1", make_backend, description=__doc__ or "")
