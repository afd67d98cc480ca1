"""Stage 4 exercise, part 3 of 3: write ``Admission.check``, the bounded queue that says no at once.

Stage 3's queue is unbounded: under overload every request is accepted and waits, the wait
grows without limit and every client times out together. Here a request whose texts would push
the queue past MAX_QUEUE is refused before it queues, at once, with 503 (or 429, by
OVERLOAD_STATUS) and a ``Retry-After`` header that says when the queue should have drained.
Chapter: docs/stage4.md#the-idea (admission) and docs/stage4.md#the-bounded-queue-and-why-503;
the lab notes: docs/lab/stage4.md#admission-exactly.

Your class extends the stage's ``Admission`` (``stage4_cache_backpressure/admission.py``), which
gives everything else: ``depth`` (texts queued now), ``full``, ``overloaded`` (the refusal, with
its message and ``Retry-After``), ``retry_after`` and ``observe`` (how fast the model drains the
queue, fed every batch). Write only ``check``.

Check your work (stage 4's backend built with your three pieces; the section "the bounded
queue" of ``tests/test_stage4_backend.py`` is the one about this part):

    make exercise STAGE=4

``make exercise STAGE=4 SOLUTION=1`` runs the same tests against ``stage4_cache_backpressure/``,
one solution.

Hints:
- ``self.depth()`` is the batcher's queue depth now, in texts; ``self.max_queue`` the bound.
- Refuse with ``raise self.overloaded(depth, n)``.
- A request larger than the whole queue must still go when the queue is empty: otherwise it
  could never be served (a test sends one).
"""

from __future__ import annotations

from stage4_cache_backpressure import admission as stage


class Admission(stage.Admission):
    def check(self, n: int) -> None:
        """Raise the overload error if ``n`` more texts would overflow the queue; never wait.

        TODO: with ``depth`` texts queued, ``n`` more overflow when ``depth + n > max_queue``;
        then raise ``self.overloaded(depth, n)``, unless the queue is empty.
        """
        raise NotImplementedError(
            "TODO (exercises/stage4_cache_backpressure/admission.py): write Admission.check,"
            " refuse at once when the queue would overflow"
        )
