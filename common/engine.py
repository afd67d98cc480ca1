"""The embedding engine every stage shares: tokenizer + ONNX session + mean pooling.

Two halves, so a batcher can sit between them:

* ``tokenize(texts)`` runs on the request path: it gives token counts (for usage,
  for the token limit, for length grouping) before any model work is queued.
* ``run(token_ids)`` pads a batch and runs the model; it is thread safe.

``embed(texts)`` does both, for scripts and the simple stages.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from common.settings import Settings


@dataclass(frozen=True, slots=True)
class TokenizedText:
    """One text's token ids (special tokens included, no padding)."""

    ids: np.ndarray
    truncated: bool

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])


@dataclass(slots=True)
class EmbedOutput:
    vectors: np.ndarray  # (n, dim) float32
    truncated: list[bool]
    n_tokens: list[int]
    timings: dict[str, float] = field(default_factory=dict)


def intra_threads_for(calls_at_once: int) -> int:
    """Intra-op threads per call when ``calls_at_once`` model calls run side by side.

    One call at a time: 0, ONNX Runtime's own default (a thread per physical core). Several:
    the cores this process may use, shared out, at least one each, so calls side by side do not
    oversubscribe the cores. Which layout does more texts per second is stage 2's thread sweep
    (docs/lab/stage2.md).
    """
    if calls_at_once <= 1:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // calls_at_once)


def load_manifest(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `make model` first")
    return dict(json.loads(path.read_text()))


def l2_normalize(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)


def pad_batch(token_ids: Sequence[np.ndarray], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad a list of id arrays into (ids, attention_mask), both int64 (rows, longest)."""
    longest = max(len(t) for t in token_ids)
    ids = np.full((len(token_ids), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(token_ids), longest), dtype=np.int64)
    for row, t in enumerate(token_ids):
        ids[row, : len(t)] = t
        mask[row, : len(t)] = 1
    return ids, mask


class Engine:
    """Tokenizer and ONNX Runtime session for one built model folder."""

    def __init__(
        self,
        model_dir: Path,
        variant: str = "int8",
        intra_threads: int = 0,
        spinning: bool = False,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.manifest = load_manifest(self.model_dir)
        # "int8" means the INT8 mode the build chose (see the manifest and docs/lab/stage0.md).
        self.variant = self.manifest.get("int8_default", "int8-dynamic") if variant == "int8" else variant
        self.model_id: str = self.manifest["model_id"]
        self.dimensions: int = int(self.manifest["dimensions"])
        self.max_tokens: int = int(self.manifest["max_tokens"])

        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=self.max_tokens)
        self.pad_id = self.tokenizer.token_to_id("[PAD]") or 0

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = intra_threads
        options.inter_op_num_threads = 1
        spin = "1" if spinning else "0"
        options.add_session_config_entry("session.intra_op.allow_spinning", spin)
        options.add_session_config_entry("session.inter_op.allow_spinning", spin)
        path = self.model_dir / self.variant / "model.onnx"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run `make model` first")
        start = time.perf_counter()
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.load_seconds = time.perf_counter() - start
        self._input_names = {i.name for i in self.session.get_inputs()}

    @classmethod
    def from_settings(cls, settings: Settings, calls_at_once: int = 1) -> Engine:
        """The engine as ``settings`` describe it, for a server that runs ``calls_at_once`` model
        calls side by side: with ONNX_INTRA_THREADS=0 the cores are shared out among them."""
        return cls(
            settings.model_dir,
            variant=settings.model_variant,
            # with WORKERS processes, each has its share: the calls of all of them run at once
            intra_threads=settings.onnx_intra_threads or intra_threads_for(calls_at_once * settings.workers),
            spinning=settings.onnx_spinning,
        )

    @property
    def model_name(self) -> str:
        return f"{self.model_id}-{self.variant}"

    @property
    def model_sha256(self) -> str:
        """Digest of the served ONNX file: in every cache key, so a new model never serves old vectors."""
        return str(self.manifest["files"][f"{self.variant}/model.onnx"]["sha256"])

    # -- tokenization (cheap, on the request path) ---------------------------
    def tokenize(self, texts: Sequence[str]) -> list[TokenizedText]:
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=True)
        return [
            TokenizedText(np.asarray(e.ids, dtype=np.int64), truncated=bool(e.overflowing)) for e in encodings
        ]

    # -- the model call (expensive, thread safe) -----------------------------
    # --8<-- [start:run]
    def run(self, token_ids: Sequence[np.ndarray]) -> np.ndarray:
        """Mean-pooled, *not* normalized vectors (rows, dim) float32 for pre-tokenized texts."""
        if not token_ids:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        ids, mask = pad_batch(token_ids, self.pad_id)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._input_names:
            feeds["token_type_ids"] = np.zeros_like(ids)
        (hidden,) = self.session.run(["last_hidden_state"], feeds)
        weights = mask[:, :, None].astype(np.float32)
        summed = (hidden * weights).sum(axis=1)
        counts = np.maximum(weights.sum(axis=1), 1e-9)
        return (summed / counts).astype(np.float32, copy=False)

    # --8<-- [end:run]

    def embed(self, texts: Sequence[str], normalize: bool = True) -> EmbedOutput:
        """Tokenize and run in one go (the stage 0 script and the simple stages)."""
        t0 = time.perf_counter()
        tokens = self.tokenize(texts)
        t1 = time.perf_counter()
        vectors = self.run([t.ids for t in tokens])
        t2 = time.perf_counter()
        if normalize:
            vectors = l2_normalize(vectors)
        return EmbedOutput(
            vectors=vectors,
            truncated=[t.truncated for t in tokens],
            n_tokens=[t.n_tokens for t in tokens],
            timings={"tokenize_ms": (t1 - t0) * 1e3, "inference_ms": (t2 - t1) * 1e3},
        )

    def warmup(self) -> None:
        """One short and one long call, so the first request does not pay for allocation."""
        self.embed(["warm up"])
        self.embed(["warm up " * 100] * 4)
