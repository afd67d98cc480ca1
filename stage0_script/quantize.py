"""Static INT8 for stage 0's model build: the recipe, calibration, and ONNX Runtime's quantizer.

Dynamic INT8 is one library call (``build_model.quantize_dynamic``); static INT8 calibrates
activation ranges on project sentences first, and the recipe names every choice that took.
``make results ONLY=stage0`` compares recipes (benchmarks/quant_study.py) (docs/lab/stage0.md).
"""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common import corpus


# --8<-- [start:recipe]
@dataclass(frozen=True)
class StaticRecipe:
    """How static INT8 is made; `make results ONLY=stage0` compares recipes."""

    calibration: str = "Percentile"  # MinMax, Entropy or Percentile (ORT CalibrationMethod)
    percentile: float = 99.999
    calibration_texts: int = 128
    quant_format: str = "QOperator"  # QOperator or QDQ
    activations: str = "QUInt8"  # QUInt8 (asymmetric) or QInt8 (symmetric)
    exclude: tuple[str, ...] = ()  # regexes of node names that stay fp32
    pad_calibration: bool = True  # calibrate on texts padded to the longest, or each at its length
    symmetric_ranges: bool | None = None  # calibrated ranges symmetric around 0 (None: ORT's default)
    smooth_alpha: float | None = None  # SmoothQuant on the MatMuls after GELU (stage0_script/smooth.py)

    def describe(self) -> str:
        calib = self.calibration + (f" p{self.percentile}" if self.calibration == "Percentile" else "")
        if self.symmetric_ranges is not None:
            calib += " symmetric" if self.symmetric_ranges else " asymmetric"
        kept = f", fp32: {' '.join(self.exclude)}" if self.exclude else ""
        kept += f", SmoothQuant alpha {self.smooth_alpha} after GELU" if self.smooth_alpha is not None else ""
        padded = "padded" if self.pad_calibration else "unpadded"
        return (
            f"{self.activations} activations, {calib} calibration on {self.calibration_texts}"
            f" {padded} project sentences, {self.quant_format}{kept}"
        )


# Static INT8 recipe, chosen by the measurements in docs/lab/stage0.md (`make results ONLY=stage0`):
# Entropy calibration on unpadded texts, with the MatMul after GELU kept in fp32, is the
# simplest recipe that passes both gates; calibration choices alone do not pass them.
STATIC_RECIPE = StaticRecipe(
    calibration="Entropy", pad_calibration=False, exclude=(r"/layer\.\d+/output/dense/MatMul$",)
)
# --8<-- [end:recipe]


class _CalibrationReader:
    """Feeds tokenized calibration sentences, one at a time, to ONNX Runtime's calibrator
    (``progress``: a tqdm bar advanced a sentence at a time)."""

    def __init__(
        self, tokenizer_path: Path, max_tokens: int, texts: list[str], pad: bool, progress: Any = None
    ) -> None:
        from tokenizers import Tokenizer

        from common.engine import pad_batch

        tok = Tokenizer.from_file(str(tokenizer_path))
        tok.no_padding()
        tok.enable_truncation(max_length=max_tokens)
        rows = [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch(texts)]
        if pad:
            # One shape for every call: the histogram calibrators stack a whole pass. But then
            # most calibrated activations belong to padding, which mean pooling later ignores.
            ids, mask = pad_batch(rows)
            rows_ids, rows_mask = list(ids), list(mask)
        else:
            # Each text at its own length; the calibrator then runs one text per pass
            # (`set_range`), so histograms merge across shapes.
            rows_ids, rows_mask = rows, [np.ones_like(r) for r in rows]
        self._feeds = [
            {"input_ids": i[None, :], "attention_mask": m[None, :], "token_type_ids": 0 * i[None, :]}
            for i, m in zip(rows_ids, rows_mask, strict=True)
        ]
        self._iter = iter(self._feeds)
        self._progress = progress

    def __len__(self) -> int:
        return len(self._feeds)

    def set_range(self, start_index: int, end_index: int) -> None:
        self._iter = iter(self._feeds[start_index:end_index])

    def get_next(self) -> dict[str, np.ndarray] | None:
        feed = next(self._iter, None)
        if feed is not None and self._progress is not None:
            self._progress.update(1)
        return feed

    def rewind(self) -> None:
        self._iter = iter(self._feeds)


def excluded_nodes(fp32: Path, patterns: tuple[str, ...]) -> list[str]:
    """Names of the nodes of `fp32` that match any of the regexes (these stay fp32)."""
    import onnx

    if not patterns:
        return []
    graph = onnx.load(str(fp32), load_external_data=False).graph
    return [n.name for n in graph.node if any(re.search(p, n.name) for p in patterns)]


# --8<-- [start:static]
def quantize_static(
    fp32: Path,
    out: Path,
    tokenizer_path: Path,
    max_tokens: int,
    recipe: StaticRecipe = STATIC_RECIPE,
    calibration_cache: Path | None = None,
) -> None:
    """Static INT8: calibrated activation scales, so a text's vector does not depend on its batch.

    `calibration_cache` (a json file) keeps the calibrated ranges, so recipes that differ only
    in format, activation type or excluded nodes calibrate once.
    """
    # Calibration texts: a seed the quality gate does not use, every length bucket.
    texts = corpus.texts(recipe.calibration_texts, seed=7, kind="mixed", unique=False)
    from tqdm import tqdm  # transformers' own progress bars: the build extra has it

    out.parent.mkdir(parents=True, exist_ok=True)
    # A bar on a terminal only (disable=None): a build log gets the step's line, not its frames.
    with (
        tqdm(total=len(texts), desc="  calibrating", unit="text", leave=False, disable=None) as bar,
        tempfile.TemporaryDirectory(prefix="smooth-") as tmp,
    ):
        reader = _CalibrationReader(tokenizer_path, max_tokens, texts, recipe.pad_calibration, bar)
        source = fp32
        if recipe.smooth_alpha is not None:
            from stage0_script.smooth import smooth_matmul_inputs

            source = Path(tmp) / "smoothed.onnx"
            feeds = _CalibrationReader(tokenizer_path, max_tokens, texts, pad=False)
            smooth_matmul_inputs(fp32, source, iter(feeds.get_next, None), recipe.smooth_alpha, FFN_OUT)
        _ort_quantize_static(source, out, reader, recipe, calibration_cache)


# The MatMul after GELU in every layer (`/encoder/layer.N/output/dense/MatMul` in an optimum export).
FFN_OUT = r"/layer\.\d+/output/dense/MatMul$"


def _ort_quantize_static(
    fp32: Path, out: Path, reader: _CalibrationReader, recipe: StaticRecipe, calibration_cache: Path | None
) -> None:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType
    from onnxruntime.quantization import quantize_static as ort_quantize_static

    # ORT's calibrator prints a line for every pass (one text a pass, unpadded) and its settings
    # after; the reader's progress bar says it once.
    with contextlib.redirect_stdout(io.StringIO()):
        ort_quantize_static(
            fp32,
            out,
            reader,
            quant_format=getattr(QuantFormat, recipe.quant_format),
            op_types_to_quantize=["MatMul"],
            per_channel=True,
            activation_type=getattr(QuantType, recipe.activations),
            weight_type=QuantType.QInt8,
            nodes_to_exclude=excluded_nodes(fp32, recipe.exclude),
            calibrate_method=getattr(CalibrationMethod, recipe.calibration),
            extra_options={
                "CalibPercentile": recipe.percentile,
                "ActivationSymmetric": recipe.activations == "QInt8",
                **(
                    {}
                    if recipe.symmetric_ranges is None
                    else {"CalibTensorRangeSymmetric": recipe.symmetric_ranges}
                ),
                # One text per calibration pass when unpadded (ORT's name says MinMax; it serves all).
                **({} if recipe.pad_calibration else {"CalibStridedMinMax": 1}),
            },
            calibration_cache_path=calibration_cache,
        )


# --8<-- [end:static]
