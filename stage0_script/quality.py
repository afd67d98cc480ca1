"""Stage 0's quality gate: is an INT8 model close enough to fp32 to serve?

Two checks, both against fp32: the cosine of each project sentence's vector (mean at least
GATE_MEAN_COSINE), and, with the STS-benchmark pairs, the Spearman correlation with human scores
(at most GATE_STSB_POINTS below fp32). ``build_model`` serves a variant only when it passes.
Beside them, for every variant, batch invariance: the largest difference between a text's vector
alone and in a padded batch of mixed lengths (the build prefers a file for which it is at most
INVARIANCE_ATOL, float rounding).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common import corpus

if TYPE_CHECKING:
    from common.engine import Engine

QUALITY_SENTENCES = 240
GATE_MEAN_COSINE = 0.99
GATE_STSB_POINTS = 1.0
INVARIANCE_ATOL = 1e-5  # the largest difference of one component that still counts as "the same vector"


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.asarray((a * b).sum(axis=1), dtype=np.float64)  # both L2-normalized


def quality_sentences() -> list[str]:
    """The quality gate's project sentences: varied length and topic, no duplicates."""
    sentences = list(dict.fromkeys(corpus.texts(QUALITY_SENTENCES * 2, seed=2024, unique=False)))
    return sentences[:QUALITY_SENTENCES]


def load_stsb(path: Path) -> tuple[list[str], list[str], np.ndarray]:
    """STS-benchmark pairs and gold scores from a csv with sentence1, sentence2, score."""
    import csv

    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    return (
        [r["sentence1"] for r in rows],
        [r["sentence2"] for r in rows],
        np.asarray([float(r["score"]) for r in rows]),
    )


def embed_all(engine: Engine, texts: list[str], batch: int = 32) -> np.ndarray:
    return np.concatenate([engine.embed(texts[i : i + batch]).vectors for i in range(0, len(texts), batch)])


def stsb_spearman(engine: Engine, pairs: tuple[list[str], list[str], np.ndarray]) -> float:
    """Spearman x100 between the cosine of each pair and its gold score."""
    from scipy.stats import spearmanr

    sims = cosines(embed_all(engine, pairs[0]), embed_all(engine, pairs[1]))
    return float(spearmanr(sims, pairs[2]).statistic * 100)


def measure(
    engine: Engine,
    reference: np.ndarray | None,
    sentences: list[str],
    pairs: tuple[list[str], list[str], np.ndarray] | None,
) -> dict[str, Any]:
    """One variant's figures: cosine to the fp32 ``reference`` vectors of ``sentences`` (none for
    fp32 itself), batch invariance, and STS-B Spearman x100 when there are ``pairs``."""
    entry: dict[str, Any] = {}
    if reference is not None:
        cos = cosines(reference, embed_all(engine, sentences))
        entry |= {"mean_cosine_to_fp32": float(cos.mean()), "min_cosine_to_fp32": float(cos.min())}
    entry["max_batch_difference"] = batch_difference(engine)
    if pairs is not None:
        entry["stsb_spearman_x100"] = stsb_spearman(engine, pairs)
    return entry


def quality(out: Path, variants: list[str], stsb: Path | None) -> dict[str, Any]:
    """Every variant of the model folder ``out`` measured against its fp32 file."""
    from common.engine import Engine

    sentences = quality_sentences()
    engines = {v: Engine(out, variant=v) for v in ["fp32", *variants]}
    ref = embed_all(engines["fp32"], sentences)
    report: dict[str, Any] = {"sentences": len(sentences), "variants": {}}
    pairs = load_stsb(stsb) if stsb is not None else None
    if pairs is not None:
        report["stsb_pairs"] = len(pairs[2])
    for name, engine in engines.items():
        report["variants"][name] = measure(engine, None if name == "fp32" else ref, sentences, pairs)
    return report


# --8<-- [start:gate]
def gate_failures(report: dict[str, Any], variant: str) -> list[str]:
    entry = report["variants"][variant]
    failures = []
    if entry["mean_cosine_to_fp32"] < GATE_MEAN_COSINE:
        short = GATE_MEAN_COSINE - entry["mean_cosine_to_fp32"]
        failures.append(
            f"{variant}: mean cosine to fp32 {entry['mean_cosine_to_fp32']:.4f} < {GATE_MEAN_COSINE}"
            f" (short by {short:.4f})"
        )
    if "stsb_spearman_x100" in entry:
        drop = report["variants"]["fp32"]["stsb_spearman_x100"] - entry["stsb_spearman_x100"]
        if drop > GATE_STSB_POINTS:
            failures.append(
                f"{variant}: STS-B Spearman {drop:.2f} points below fp32 (gate {GATE_STSB_POINTS})"
            )
    return failures


# --8<-- [end:gate]


# --8<-- [start:invariance]
def batch_difference(engine: Engine, sizes: tuple[int, ...] = (8, 32)) -> float:
    """The largest |difference| of one component between a text's vector embedded alone and the
    same text's inside a batch of ``sizes`` mixed-length texts (0.0: the batch changes nothing)."""
    texts = corpus.texts(max(sizes), seed=11, kind="mixed")
    alone = np.concatenate([engine.embed([t]).vectors for t in texts])
    worst = 0.0
    for size in sizes:
        batched = embed_all(engine, texts, batch=size)
        worst = max(worst, float(np.abs(alone - batched).max()))
    return worst


# --8<-- [end:invariance]
