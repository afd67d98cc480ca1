"""The quantization study's tools on the real fp32 model: node families and SmoothQuant."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx

from benchmarks.quant_study import FAMILIES
from common import corpus
from common.engine import Engine
from common.settings import Settings
from stage0_script.quantize import FFN_OUT, _CalibrationReader, excluded_nodes
from stage0_script.smooth import smooth_matmul_inputs

LAYERS = 6  # all-MiniLM-L6-v2


def test_node_families_match_the_exported_graph(settings: Settings) -> None:
    fp32 = settings.model_dir / "fp32" / "model.onnx"
    ffn = excluded_nodes(fp32, FAMILIES["ffn-out"])
    attn = excluded_nodes(fp32, FAMILIES["attn-scores"])
    assert len(ffn) == LAYERS and all(n.endswith("/output/dense/MatMul") for n in ffn)
    assert not any("attention/output" in n for n in ffn)  # the attention projection is not the FFN
    assert len(attn) == 2 * LAYERS and all("/attention/self/MatMul" in n for n in attn)


def test_smoothing_changes_the_weights_but_not_the_vectors(settings: Settings, tmp_path: Path) -> None:
    model = tmp_path / "model"
    (model / "smoothed").mkdir(parents=True)
    for name in ("manifest.json", "tokenizer.json"):
        shutil.copyfile(settings.model_dir / name, model / name)
    (model / "fp32").symlink_to((settings.model_dir / "fp32").resolve())
    fp32, smoothed = model / "fp32" / "model.onnx", model / "smoothed" / "model.onnx"

    texts = corpus.texts(8, seed=7, kind="mixed", unique=False)
    feeds = _CalibrationReader(model / "tokenizer.json", 256, texts, pad=False)
    names = smooth_matmul_inputs(fp32, smoothed, iter(feeds.get_next, None), 0.5, FFN_OUT)
    assert names and all(n.endswith("/output/dense/MatMul") for n in names)
    graph = onnx.load(str(smoothed)).graph
    assert sum(n.op_type == "Mul" and n.name.endswith("/smooth") for n in graph.node) == len(names)

    sentences = corpus.texts(16, seed=5, kind="mixed")
    before = Engine(model, "fp32").embed(sentences).vectors
    after = Engine(model, "smoothed").embed(sentences).vectors
    assert float((before * after).sum(axis=1).min()) > 0.99999  # same function, rescaled inside
    assert smoothed.read_bytes() != fp32.read_bytes()
    assert np.isfinite(after).all()
