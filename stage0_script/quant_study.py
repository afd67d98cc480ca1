"""How good can static INT8 get? Quantize recipes and measure each against fp32 and dynamic INT8.

    python -m stage0_script.quant_study      (prints the table; STS-B pairs from data/stsb/)

Each static recipe (calibration method, padding, format, activation type, nodes kept in fp32)
is quantized from the built fp32 model into a temporary folder and measured like the build's
quality gate measures (mean and minimum cosine to fp32, STS-B Spearman), plus file size, load
time, texts/s at batch 1 and 32, and batch invariance (a text alone against the same text in a
padded batch of mixed lengths). Rounds build on each other: calibrations first, then format and
activation type on the best calibration, then nodes kept in fp32 on the best so far.

Prints one line per variant and the decision (``--out`` also writes the figures as JSON);
``make results ONLY=quantization RECORD=1`` (benchmarks/quantization.py) records the same study,
stamped, with the tables and the plot the docs show. Needs a built model (`make model`); takes
about ten minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from common.engine import Engine
from common.settings import get_settings
from stage0_script import quality, quantize, speed
from stage0_script.build_model import STSB_CSV
from stage0_script.quantize import StaticRecipe

SPEED_MARGIN = 1.05  # static must beat dynamic by this factor to become the default (beyond noise)
# Node families that may stay fp32 (regexes over the ONNX node names of a BERT export).
FAMILIES: dict[str, tuple[str, ...]] = {
    "ffn-out": (r"/layer\.\d+/output/dense/MatMul$",),  # the MatMul after GELU: widest activations
    "attn-scores": (r"/attention/self/MatMul(_1)?$",),  # QK^T and softmax x V: activation x activation
    "first-last": (r"/layer\.0/", r"/layer\.{last}/"),  # {last}: the encoder's last layer
}


def _families(fp32: Path) -> dict[str, tuple[str, ...]]:
    """FAMILIES with the number of the encoder's last layer read from the graph."""
    import onnx

    names = [n.name for n in onnx.load(str(fp32), load_external_data=False).graph.node]
    last = max(int(m.group(1)) for n in names if (m := re.search(r"/layer\.(\d+)/", n)))
    return {k: tuple(p.replace("{last}", str(last)) for p in v) for k, v in FAMILIES.items()}


class _Study:
    def __init__(self, model_dir: Path, workdir: Path, stsb: Path | None, stsb_limit: int | None) -> None:
        # A model folder the Engine can load any variant from: the built files plus our static ones.
        self.dir = workdir / "model"
        self.dir.mkdir()
        for name in ("manifest.json", "tokenizer.json"):
            shutil.copyfile(model_dir / name, self.dir / name)
        for variant in ("fp32", "int8-dynamic", "int8-static"):
            (self.dir / variant).symlink_to((model_dir / variant).resolve())
        self.fp32 = self.dir / "fp32" / "model.onnx"
        self.max_tokens = int(json.loads((self.dir / "manifest.json").read_text())["max_tokens"])
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
        if kind != "fp32":
            cos = quality.cosines(self.reference, quality.embed_all(engine, self.sentences))
            entry |= {"mean_cosine_to_fp32": float(cos.mean()), "min_cosine_to_fp32": float(cos.min())}
        if self.pairs is not None:
            entry["stsb_spearman_x100"] = quality.stsb_spearman(engine, self.pairs)
        entry["batch_invariance_min_cosine"] = quality.batch_invariance(engine)
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


def _line(entry: dict[str, Any]) -> str:
    keys = ("mean_cosine_to_fp32", "min_cosine_to_fp32", "stsb_spearman_x100", "batch_invariance_min_cosine")
    return "  ".join(f"{k.split('_to')[0]}={entry[k]:.4f}" for k in keys if k in entry)


def decide(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The fastest static recipe that passes the gates, if it beats dynamic at batch 32."""
    dynamic = results["int8-dynamic"]
    passing = [r for r in results.values() if r["kind"] == "static" and r.get("gate_failures") == []]
    if not passing:
        return {"default": "int8-dynamic", "static": None, "why": "no static recipe passes the quality gates"}
    fastest = max(passing, key=lambda r: r["texts_per_cpu_s_b32"])
    if fastest["texts_per_cpu_s_b32"] < SPEED_MARGIN * dynamic["texts_per_cpu_s_b32"]:
        why = (
            f"no static recipe that passes the gates is {SPEED_MARGIN - 1:.0%} faster than dynamic"
            " at batch 32 (texts per CPU-second)"
        )
        return {"default": "int8-dynamic", "static": fastest["name"], "why": why}
    return {"default": "int8-static", "static": fastest["name"], "why": "passes the gates and is faster"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = StaticRecipe(pad_calibration=False)
    with tempfile.TemporaryDirectory(prefix="quant-study-") as tmp:
        study = _Study(args.model_dir, Path(tmp), args.stsb, args.stsb_limit)
        print("reference variants", flush=True)
        study.measure_quality("fp32", "fp32", None, "export, no quantization")
        study.measure_quality("int8-dynamic", "dynamic", None, "weights per-channel, activations per call")
        built = json.loads((study.dir / "manifest.json").read_text())["quantization"]["int8-static"]
        study.measure_quality("int8-static", "static", None, f"as built: {built['activations']}")
        print("round 1: calibration", flush=True)
        round1 = {
            "s-pct99.999": (base, "Percentile 99.999"),
            "s-pct99.99": (replace(base, percentile=99.99), "Percentile 99.99"),
            "s-pct99.999-asym": (
                replace(base, symmetric_ranges=False),
                "Percentile 99.999, asymmetric ranges",
            ),
            "s-pct99.99-asym": (
                replace(base, percentile=99.99, symmetric_ranges=False),
                "Percentile 99.99, asymmetric ranges",
            ),
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
        round3: dict[str, tuple[StaticRecipe, str]] = {}
        families = _families(study.fp32)
        for fam in ("ffn-out", "attn-scores", "first-last"):
            round3[f"{best}+fp32-{fam}"] = (
                replace(best_recipe, exclude=families[fam]),
                f"{best_note}, {fam} kept fp32",
            )
        round3[f"{best}+smooth-ffn-out"] = (
            replace(best_recipe, smooth_alpha=0.5),
            f"{best_note}, SmoothQuant (alpha 0.5) on the ffn-out inputs",
        )
        both = families["ffn-out"] + families["attn-scores"]
        round3[f"{best}+fp32-ffn-attn"] = (
            replace(best_recipe, exclude=both),
            f"{best_note}, ffn-out and attn-scores kept fp32",
        )
        if args.quick:
            round3 = dict(list(round3.items())[:1])
        for name, (recipe, note) in round3.items():
            study.static(name, recipe, note)
        candidates |= round3
        best = study.best(list(candidates))
        best_recipe, best_note = candidates[best]
        if not args.quick:
            print(f"round 4: more calibration texts, on {best}", flush=True)
            name = f"{best}-512texts"
            study.static(name, replace(best_recipe, calibration_texts=512), f"{best_note}, 512 texts")
        print("speed (interleaved rounds, median)", flush=True)
        names = [n for n, r in study.results.items() if "error" not in r]
        for name, figures in speed.variants(study.dir, names, rounds=1 if args.quick else 3).items():
            study.results[name] |= figures
        results = study.results
    report: dict[str, Any] = {
        "gates": {"mean_cosine": quality.GATE_MEAN_COSINE, "stsb_points": quality.GATE_STSB_POINTS},
        "sentences": len(study.sentences),
        "stsb_pairs": len(study.pairs[2]) if study.pairs is not None else 0,
        "build_recipe": asdict(quantize.STATIC_RECIPE),
        "variants": list(results.values()),
    }
    report["decision"] = decide(results)
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The study's options (benchmarks/quantization.py takes the same)."""
    parser.add_argument("--model-dir", type=Path, default=get_settings().model_dir)
    parser.add_argument(
        "--stsb", type=Path, default=STSB_CSV, help="STS-benchmark csv (sentence1,sentence2,score)"
    )
    parser.add_argument("--stsb-limit", type=int, help="use only the first N pairs (quick checks)")
    parser.add_argument("--quick", action="store_true", help="a few recipes, one speed round (smoke test)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--out", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.stsb is not None and not args.stsb.exists():
        parser.error(f"--stsb {args.stsb}: no such file")
    t0 = time.perf_counter()
    report = run(args)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    for entry in report["variants"]:
        print(
            f"{entry['name']:32s} " + (_line(entry) if "error" not in entry else f"failed: {entry['error']}")
        )
    print(f"decision: {report['decision']} ({report['seconds']} s)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
