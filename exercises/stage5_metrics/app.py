"""Stage 5 exercise: count what each request and each batch did, once, in the registry.

Stage 4 answers well but tells little: no durations, no last minute, no line per request. Stage 5
fills one Prometheus registry three ways; you write two of them, in ``MetricsBackend``:

- ``embed``: once per request, from stage 4's typed result. Its texts and tokens, its queue time
  when it reached the model, and the model time its cache hits saved go into the registry
  (``self.metrics.observe_result``); the same figures go into the request's log record, which the
  middleware put in the ``current_record`` ContextVar and writes as the request's log line.
- ``on_batch``: once per batch. Stage 3's batcher calls it after every model call with the
  batch's ``BatchRecord``; it goes into the registry (``self.metrics.observe_batch``).

Chapter: docs/stage5.md#the-idea and docs/stage5.md#the-code; the lab notes: docs/lab/stage5.md.

Your class extends the stage's ``MetricsBackend`` (``stage5_metrics/backend.py``), which gives the
rest: stage 4's backend it wraps (``self.inner``), the registry (``self.metrics``), the window, the
price of a model call measured at start (``self.cost``, a ``CostModel``, ``savings.py``) and the
counts read when collected (``stage_counts``). Stage 4's answer is ``await self.inner.embed(job)``.
The app factory at the bottom is stage 5's, with your backend, so this file is a server too:
``python -m common.serve exercises.stage5_metrics``.

Check your work (stage 5's own tests, run against this file):

    make exercise STAGE=5

The first tests call your backend in-process (``tests/test_stage5_units.py``, the two
``test_the_backend_counts_...``); then a server of this file is scraped after known traffic, and
its log lines are read (``tests/test_stage5_metrics.py``). ``make exercise STAGE=5 SOLUTION=1``
runs the same tests against ``stage5_metrics/app.py``, one solution.

Hints:
- ``self.metrics.observe_batch(size, padded, real, tier, seconds, failed)`` takes seconds, where
  the record holds ``inference_ms``; a batch whose model call raised has an ``error``.
- ``record = current_record.get()`` is None outside a request (a test, a script): check it.
- ``result.cache_hits`` is None without a cache tier, and a request that skipped the cache
  (``result.cache_bypassed``) has neither hits nor misses, and saved nothing.
- ``self.cost.cache_saved_ms(hits, texts, tokens)`` prices the hits; ``self.cost`` is None until
  ``start`` has measured it.
"""

from __future__ import annotations

from fastapi import FastAPI

from common.api import EmbedJob, EmbedResult
from common.batch_stats import BatchRecord
from stage5_metrics import app as stage5
from stage5_metrics import backend as stage
from stage5_metrics.logs import current_record  # noqa: F401 (given: this request's log record)


class MetricsBackend(stage.MetricsBackend):
    async def embed(self, job: EmbedJob) -> EmbedResult:
        """Stage 4's answer (``await self.inner.embed(job)``), counted once per request.

        TODO, in this order:
        1. the log record first gets the text count, so a request refused with 503 or 504 is
           logged with it too (stage 4's ``embed`` raises then);
        2. the registry gets the request's texts, tokens (``sum(result.n_tokens)``), queue time in
           seconds (None when no text reached the model: ``result.queue_ms`` is None) and the
           model seconds its cache hits saved: ``self.metrics.observe_result``;
        3. the log record gets the tokens, ``queue_ms``, ``inference_ms``, and the cache hits and
           misses when the result has them;
        4. return the result unchanged.
        """
        raise NotImplementedError(
            "TODO (exercises/stage5_metrics/app.py): write MetricsBackend.embed, count the request's"
            " result in the registry and its log record"
        )

    def on_batch(self, batch: BatchRecord) -> None:
        """Called by stage 3's batcher after each batch (one model call or several): count it once.

        TODO: ``self.metrics.observe_batch`` with the batch's size, padded and real tokens, tier,
        model time in seconds, and whether the model call raised.
        """
        raise NotImplementedError(
            "TODO (exercises/stage5_metrics/app.py): write MetricsBackend.on_batch, count the batch"
            " in the registry"
        )


def create_app() -> FastAPI:  # uvicorn --factory, as stage 5's
    return stage5.create_app(backend=MetricsBackend)  # stage 5's app, with your backend
