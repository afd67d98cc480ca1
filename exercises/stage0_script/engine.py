"""Exercise for stage 0: from the model's numbers per token to one vector of length 1 per text.

ONNX Runtime gives one vector of 384 numbers for every token of every text in a call, the
padding included: a call's texts are padded to the longest, and the attention mask says which
positions are real tokens (1) and which are padding (0). Write the two steps that turn them into
what every stage answers (chapter: docs/stage0.md#the-idea):

- the end of ``Engine.run``, mean pooling: a text's vector is the average of its real tokens'
  vectors. Padding must not count: otherwise a text's vector would change with the texts it is
  padded beside.
- ``l2_normalize``: each vector divided by its length, so that every vector has length 1 and
  the cosine of two vectors is their dot product.

Your ``Engine`` extends the stage's own (``common/engine.py``, the engine every stage uses),
which gives everything else: the tokenizer, the ONNX Runtime session, ``embed`` (tokenize,
``run``, normalize) and the first half of ``run`` below (pad the batch, run the model).

Check your work (stage 0's own engine tests, ``tests/test_engine.py``, run against this file):

    make exercise STAGE=0

The first test names what is still to write. The others compare your vectors with those of
sentence-transformers (a library no one here wrote), check that a text's vector is the same
alone and padded in a batch, and that ``l2_normalize`` of the raw vectors gives the served ones.
``make exercise STAGE=0 SOLUTION=1`` runs the same tests against ``common/engine.py``.

Hints:
- ``hidden`` has the shape (texts, tokens, 384) and ``mask`` (texts, tokens); ``mask[:, :, None]``
  is (texts, tokens, 1), which numpy multiplies with ``hidden`` position by position.
- ``array.sum(axis=1)`` adds up over the tokens; ``np.linalg.norm(vectors, axis=1, keepdims=True)``
  is each row's length.
- Return float32 (``.astype(np.float32)``), as the model does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common import engine as stage
from common.engine import pad_batch


def l2_normalize(vectors: np.ndarray) -> np.ndarray:
    """Each row of ``vectors`` (texts, 384) divided by its length: rows of length 1, same shape.

    TODO: divide every row by its L2 norm (the square root of the sum of its squares).
    """
    raise NotImplementedError(
        "TODO (exercises/stage0_script/engine.py): write l2_normalize, each row divided by its length"
    )


class Engine(stage.Engine):
    def run(self, token_ids: Sequence[np.ndarray]) -> np.ndarray:
        """Mean-pooled, *not* normalized vectors (rows, dim) float32 for pre-tokenized texts."""
        if not token_ids:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        ids, mask = pad_batch(token_ids, self.pad_id)  # given: (texts, longest), padding 0 in mask
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._input_names:
            feeds["token_type_ids"] = np.zeros_like(ids)
        # given: the model's numbers, (texts, longest, 384); yours to use below
        (hidden,) = self.session.run(["last_hidden_state"], feeds)  # noqa: RUF059
        # TODO: mean pooling. For each text, the sum of ``hidden`` over the positions where
        # ``mask`` is 1, divided by how many there are; one row of 384 numbers per text.
        raise NotImplementedError(
            "TODO (exercises/stage0_script/engine.py): write the end of Engine.run, mean pooling:"
            " average each text's token vectors over its real tokens (attention mask 1), not the padding"
        )
