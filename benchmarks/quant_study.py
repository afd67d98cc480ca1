"""How good can static INT8 get? Quantize recipes and measure each against fp32 and dynamic INT8.

    make results ONLY=stage0      (benchmarks/stage0.py runs this study; STS-B pairs from data/stsb/)

Each static recipe (calibration method, format, activation type, nodes kept in fp32) is
quantized from the built fp32 model into a temporary folder and measured as the build's quality
gate measures (stage0_script/quality.py: cosine to fp32, STS-B Spearman, batch invariance), plus
file size, load time and texts per CPU-second at batch 1 and 16 on one thread, beside the four
files the build made. Rounds build on each other: calibrations first, then format and
activation type on the best calibration, then nodes kept in fp32 on the best so far.

Speed is measured so that a shared machine cannot fool the comparison: each variant loaded with
one ONNX Runtime thread, the variants taken in turns, round after round, and the figure compared is
texts per CPU-second of the calling thread, which a neighbour on the machine does not change
(wall-clock texts/s is kept beside it). Needs a built model (`make model`); about three minutes
on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from common import corpus
from common.engine import Engine
from common.settings import get_settings
from stage0_script import quality, quantize
from stage0_script.build_model import STSB_CSV
from stage0_script.quantize import FFN_OUT, StaticRecipe

BUILT = ("fp32", "int8-dynamic", "int8-static", "int8-rowwise")  # the build's files, measured beside
# Node families that may stay fp32 (regexes over the ONNX node names of a BERT export).
FAMILIES: dict[str, tuple[str, ...]] = {
    "ffn-out": (FFN_OUT,),  # the MatMul after GELU: widest activations
    "attn-scores": (r"/attention/self/MatMul(_1)?$",),  # QK^T and softmax x V: activation x activation
}


class _Study:
    def __init__(self, model_dir: Path, workdir: Path, stsb: Path | None, stsb_limit: int | None) -> None:
        # A model folder the Engine can load any variant from: the built files plus our static ones.
        self.dir = workdir / "model"
        self.dir.mkdir()
        for name in ("manifest.json", "tokenizer.json"):
            shutil.copyfile(model_dir / name, self.dir / name)
        for variant in BUILT:
            (self.dir / variant).symlink_to((model_dir / variant).resolve())
        self.fp32 = self.dir / "fp32" / "model.onnx"
        self.manifest = json.loads((self.dir / "manifest.json").read_text())
        self.max_tokens = int(self.manifest["max_tokens"])
        self.cache_dir = workdir / "calibration"
        self.cache_dir.mkdir()
        self.sentences = quality.quality_sentences()
        self.pairs = quality.load_stsb(stsb) if stsb else None
        if self.pairs is not None and stsb_limit:
            self.pairs = (self.pairs[0][:stsb_limit], self.pairs[1][:stsb_limit], self.pairs[2][:stsb_limit])
        self.reference = quality.embed_all(Engine(self.dir, "fp32"), self.sentences)
        self.results: dict[str, dict[str, Any]] = {}

    def quantize(self, name: str, recipe: StaticRecipe) -> float:
        calib = recipe.calibration + (f"-{recipe.percentile}" if recipe.calibration == "Percentile" else "")
        calib += f"-{recipe.calibration_texts}-pad{int(recipe.pad_calibration)}-sym{recipe.symmetric_ranges}"
        calib += f"-smooth{recipe.smooth_alpha}"  # smoothing changes the graph that is calibrated
        cache = self.cache_dir / f"{calib}.json"
        t0 = time.perf_counter()
        quantize.quantize_static(
            self.fp32,
            self.dir / name / "model.onnx",
            self.dir / "tokenizer.json",
            self.max_tokens,
            recipe,
            cache,
        )
        return time.perf_counter() - t0

    def measure_quality(self, name: str, kind: str, recipe: StaticRecipe | None, note: str) -> dict[str, Any]:
        engine = Engine(self.dir, name)
        entry: dict[str, Any] = {"name": name, "kind": kind, "note": note}
        entry["recipe"] = asdict(recipe) if recipe else None
        entry["bytes"] = (self.dir / name / "model.onnx").stat().st_size
        reference = None if kind == "fp32" else self.reference
        entry |= quality.measure(engine, reference, self.sentences, self.pairs)
        self.results[name] = entry
        fp32 = self.results.get("fp32", entry)
        if kind != "fp32":
            failures = []
            if entry["mean_cosine_to_fp32"] < quality.GATE_MEAN_COSINE:
                failures.append("mean cosine")
            if self.pairs is not None:
                entry["stsb_drop"] = fp32["stsb_spearman_x100"] - entry["stsb_spearman_x100"]
                if entry["stsb_drop"] > quality.GATE_STSB_POINTS:
                    failures.append("STS-B")
            entry["gate_failures"] = failures
        print(f"  {name:28s} " + _line(entry), flush=True)
        return entry

    def static(self, name: str, recipe: StaticRecipe, note: str) -> dict[str, Any]:
        try:
            seconds = self.quantize(name, recipe)
        except Exception as exc:  # a recipe ORT rejects is a result too
            print(f"  {name:28s} failed: {exc}", flush=True)
            self.results[name] = {"name": name, "kind": "static", "note": note, "error": str(exc)}
            return self.results[name]
        entry = self.measure_quality(name, "static", recipe, note)
        entry["quantize_s"] = seconds
        return entry

    def best(self, names: list[str]) -> str:
        done = [n for n in names if "mean_cosine_to_fp32" in self.results[n]]
        return max(done, key=lambda n: self.results[n]["mean_cosine_to_fp32"])


def speeds(model_dir: Path, names: list[str], rounds: int, batch: int = 16) -> dict[str, dict[str, float]]:
    """Load time and model throughput at batch 1 and ``batch``, one ONNX thread, variants interleaved.

    The machine is shared, so wall-clock time measures the neighbours too. With one intra-op
    thread ONNX Runtime computes on the calling thread, and that thread's CPU time is what the
    model itself costs: texts per CPU-second (median of rounds) is what the decision uses.
    Wall-clock texts/s (best of rounds) is kept beside it.
    """
    tokenizer = Engine(model_dir, "fp32").tokenize
    # 96 single texts: a call of one text takes a few milliseconds, and fewer let a round's figure
    # swing by a tenth from one run to the next.
    singles = [t.ids for t in tokenizer(corpus.texts(96, seed=12, kind="sentence"))]
    mixed = [[t.ids for t in tokenizer(corpus.texts(32, seed=13 + i, kind="mixed"))] for i in range(2)]
    batches = [call[j : j + batch] for call in mixed for j in range(0, len(call), batch)]
    big = f"b{batch}"
    calls = {"b1": [[ids] for ids in singles], big: batches}
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    for _ in range(rounds):
        for name in names:
            engine = Engine(model_dir, name, intra_threads=1)
            samples[name].setdefault("load", []).append(engine.load_seconds)
            engine.run(batches[0][:4])  # warm-up
            for key, batch_list in calls.items():
                texts = sum(len(b) for b in batch_list)
                cpu, wall = time.thread_time(), time.perf_counter()
                for call in batch_list:
                    engine.run(call)
                samples[name].setdefault(f"{key}_cpu", []).append(texts / (time.thread_time() - cpu))
                samples[name].setdefault(f"{key}_wall", []).append(texts / (time.perf_counter() - wall))
            del engine
    out: dict[str, dict[str, float]] = {}
    for name in names:
        got = samples[name]
        r = out[name] = {
            "load_s": statistics.median(got["load"]),
            "texts_per_cpu_s_b1": statistics.median(got["b1_cpu"]),
            f"texts_per_cpu_s_{big}": statistics.median(got[f"{big}_cpu"]),
            "texts_per_s_b1_wall_best": max(got["b1_wall"]),
            f"texts_per_s_{big}_wall_best": max(got[f"{big}_wall"]),
        }
        print(
            f"  {name:28s} load={r['load_s']:.2f}s  per CPU-second: b1={r['texts_per_cpu_s_b1']:.0f}"
            f"  {big}={r[f'texts_per_cpu_s_{big}']:.0f}  wall best: b1={r['texts_per_s_b1_wall_best']:.0f}"
            f"  {big}={r[f'texts_per_s_{big}_wall_best']:.0f}",
            flush=True,
        )
    return out


def _line(entry: dict[str, Any]) -> str:
    keys = ("mean_cosine_to_fp32", "min_cosine_to_fp32", "stsb_spearman_x100", "max_batch_difference")
    return "  ".join(f"{k.split('_to')[0]}={entry[k]:.4g}" for k in keys if k in entry)


def best_static(results: dict[str, dict[str, Any]]) -> str | None:
    """The static recipe that passes the gates with the most texts per CPU-second at batch 16."""
    passing = [r for r in results.values() if r["kind"] == "static" and r.get("gate_failures") == []]
    return max(passing, key=lambda r: r["texts_per_cpu_s_b16"])["name"] if passing else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = StaticRecipe(pad_calibration=False)
    with tempfile.TemporaryDirectory(prefix="quant-study-") as tmp:
        study = _Study(args.model_dir, Path(tmp), args.stsb, args.stsb_limit)
        print("reference variants", flush=True)
        study.measure_quality("fp32", "fp32", None, "export, no quantization")
        built = study.manifest["quantization"]
        study.measure_quality(
            "int8-dynamic", "dynamic", None, "as built: " + built["int8-dynamic"]["activations"]
        )
        study.measure_quality(
            "int8-static", "static", None, "as built: " + built["int8-static"]["activations"]
        )
        study.measure_quality(
            "int8-rowwise", "rowwise", None, "as built: " + built["int8-rowwise"]["activations"]
        )
        print("round 1: calibration", flush=True)
        round1 = {
            "s-pct99.999": (base, "Percentile 99.999"),
            "s-pct99.99": (replace(base, percentile=99.99), "Percentile 99.99"),
            "s-minmax": (replace(base, calibration="MinMax"), "MinMax"),
            "s-entropy": (replace(base, calibration="Entropy"), "Entropy"),
        }
        if args.quick:
            round1 = dict(list(round1.items())[:1])
        for name, (recipe, note) in round1.items():
            study.static(name, recipe, note)
        best = study.best(list(round1))
        best_recipe, best_note = round1[best]
        print(f"round 2: format and activation type on {best}", flush=True)
        round2 = {
            f"{best}-qdq": (replace(best_recipe, quant_format="QDQ"), f"{best_note}, QDQ"),
            f"{best}-qdq-s8": (
                replace(best_recipe, quant_format="QDQ", activations="QInt8"),
                f"{best_note}, QDQ, int8 symmetric activations",
            ),
        }
        if args.quick:
            round2 = {}
        for name, (recipe, note) in round2.items():
            study.static(name, recipe, note)
        candidates = {**round1, **round2}
        best = study.best(list(candidates))
        best_recipe, best_note = candidates[best]
        print(f"round 3: node families kept in fp32, on {best}", flush=True)
        round3 = {
            f"{best}+fp32-{fam}": (
                replace(best_recipe, exclude=FAMILIES[fam]),
                f"{best_note}, {fam} kept fp32",
            )
            for fam in ("ffn-out", "attn-scores")
        }
        round3[f"{best}+smooth-ffn-out"] = (
            replace(best_recipe, smooth_alpha=0.5),
            f"{best_note}, SmoothQuant (alpha 0.5) on the ffn-out inputs",
        )
        if args.quick:
            round3 = dict(list(round3.items())[:1])
        for name, (recipe, note) in round3.items():
            study.static(name, recipe, note)
        print("speed (interleaved rounds, median)", flush=True)
        names = [n for n, r in study.results.items() if "error" not in r]
        for name, figures in speeds(study.dir, names, rounds=1 if args.quick else 3).items():
            study.results[name] |= figures
        results = study.results
    return {
        "gates": {"mean_cosine": quality.GATE_MEAN_COSINE, "stsb_points": quality.GATE_STSB_POINTS},
        "sentences": len(study.sentences),
        "stsb_pairs": len(study.pairs[2]) if study.pairs is not None else 0,
        "build_recipe": asdict(quantize.STATIC_RECIPE),
        "int8_default": study.manifest["int8_default"],
        "variants": list(results.values()),
        "best_static": best_static(results),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The study's options (benchmarks/stage0.py takes the same)."""
    parser.add_argument("--model-dir", type=Path, default=get_settings().model_dir)
    parser.add_argument(
        "--stsb", type=Path, default=STSB_CSV, help="STS-benchmark csv (sentence1,sentence2,score)"
    )
    parser.add_argument("--stsb-limit", type=int, help="use only the first N pairs (quick checks)")
    parser.add_argument("--quick", action="store_true", help="a few recipes, one speed round (smoke test)")
