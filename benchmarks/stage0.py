"""`make results ONLY=stage0`: stage 0's questions from one run, stamped and rendered for the docs.

    python -m benchmarks.stage0            # about 4 minutes on 2 cores
    python -m benchmarks.stage0 --quick    # two recipes, 200 STS-B pairs, one speed round
    python -m benchmarks.stage0 --record   # docs/results/stage0.json and .md

What the build made (its manifest: sizes, the INT8 mode served as `int8` and why); fp32 and the
three INT8 files side by side (quality against fp32, size, one-thread speed, and the largest
difference between a text's vector alone and in a batch); the wall-clock baseline of
``python -m stage0_script --bench``; and the quantization study of static recipes. The study and
the measurements are stage 0's own (``benchmarks/quant_study.py``, which measures the built
files beside its recipes, and ``stage0_script/__main__.py``); this module stamps and renders them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import quant_study
from loadtests import evidence
from loadtests.tables import num, page, table
from stage0_script.__main__ import measure
from stage0_script.quality import INVARIANCE_ATOL


def facts(model_dir: Path) -> dict[str, Any]:
    """What the build recorded in its manifest, less paths, checksums and its own quality run."""
    manifest = json.loads((model_dir / "manifest.json").read_text())
    keep = ("model_id", "dimensions", "max_tokens", "pooling", "normalize", "int8_default")
    return {
        **{key: manifest[key] for key in keep},
        "int8_default_why": manifest.get("int8_default_why"),
        "build_seconds": manifest.get("build_seconds"),
        "gate": manifest.get("gate"),
        "quantization": manifest["quantization"],
    }


def _difference(value: float | None) -> str:
    """0 when a batch changes nothing (bitwise), else the largest difference of one component."""
    if value is None:
        return "–"
    return "0 (identical)" if value == 0 else f"{value:.1e}"


def _ratio(row: dict[str, Any], base: dict[str, Any], key: str) -> str:
    return num(row[key] / base[key], 2) if row.get(key) and base.get(key) else "–"


def _cos(row: dict[str, Any], key: str) -> str:
    return num(row.get(key), 4) if row["kind"] != "fp32" else "—"


def _cost(row: dict[str, Any], dynamic: dict[str, Any], fp32: dict[str, Any], every: dict[str, Any]) -> str:
    """What one INT8 file costs against dynamic INT8, in ratios, as words the docs can quote; ``every``:
    the speed table's texts/s with every thread, by variant and batch size."""
    drop = fp32["stsb_spearman_x100"] - row["stsb_spearman_x100"]
    moved = row["max_batch_difference"]
    same = "the same vector" if moved <= INVARIANCE_ATOL else "a different vector"
    b1, b16 = _ratio(row, dynamic, "texts_per_cpu_s_b1"), _ratio(row, dynamic, "texts_per_cpu_s_b16")
    mine, theirs = every.get(row["name"], {}), every.get("int8-dynamic", {})
    w1, w16 = (
        _ratio(row, dynamic, "texts_per_s_b1_wall_best"),
        _ratio(row, dynamic, "texts_per_s_b16_wall_best"),
    )
    return (
        f"{same} for a text alone and in a batch (largest difference {f'{moved:.1e}' if moved else 0}),"
        f" {row['bytes'] / dynamic['bytes']:.2f}× its file size, {b1}×"
        f" and {b16}× its texts per CPU-second at batch 1 and 16 ({w1}× and {w16}× by the wall clock on"
        " the same one thread, the best round of each; with every thread,"
        f" {_ratio(mine, theirs, '1')}× and {_ratio(mine, theirs, '16')}× by the speed table's wall clock),"
        f" STS-B {abs(drop):.2f} points {'below' if drop > 0 else 'above'} fp32"
    )


def markdown(result: dict[str, Any]) -> str:
    """stage0.md: the build, the four files side by side, what invariance cost, the wall-clock
    baseline, the study's recipes and its best static recipe, as named sections."""
    build, study = result["build"], result["study"]
    rows = {r["name"]: r for r in study["variants"] if "error" not in r}
    fp32, dynamic = rows["fp32"], rows["int8-dynamic"]
    built = [rows[name] for name in quant_study.BUILT]
    note = f"{study['sentences']} gate sentences, {study['stsb_pairs']} STS-B dev pairs."
    served = (
        f"`{build['model_id']}`: {build['dimensions']} dimensions, at most {build['max_tokens']} tokens,"
        f" {build['pooling']} pooling, {build['normalize']} normalized. `make model` built it in"
        f" {num(build['build_seconds'], 0)} s and serves `{build['int8_default']}` as `int8`:"
        f" {build['int8_default_why'] or 'the build recorded no reason'}."
    )
    variants = table(
        ["variant", "file MB", f"STS-B Spearman ×100, {study['stsb_pairs']} pairs", "mean cosine to fp32",
         "min cosine to fp32",
         "texts/CPU-s, 1 text", "× int8-dynamic", "texts/CPU-s, batch 16", "× int8-dynamic",
         "max difference, alone vs in a batch"],
        [(r["name"], num(r["bytes"] / 1e6), num(r["stsb_spearman_x100"], 2), _cos(r, "mean_cosine_to_fp32"),
          _cos(r, "min_cosine_to_fp32"), num(r["texts_per_cpu_s_b1"], 0),
          _ratio(r, dynamic, "texts_per_cpu_s_b1"),
          num(r["texts_per_cpu_s_b16"], 0), _ratio(r, dynamic, "texts_per_cpu_s_b16"),
          _difference(r["max_batch_difference"]))
         for r in built],
    )  # fmt: skip
    baseline = result["baseline"]["variants"]
    every = {r["variant"]: r["items_per_s"] for r in baseline}
    invariance = (
        f"Against dynamic INT8 (largest difference {dynamic['max_batch_difference']:.1e}), row-wise"
        f" INT8 gives {_cost(rows['int8-rowwise'], dynamic, fp32, every)}; static INT8 gives"
        f" {_cost(rows['int8-static'], dynamic, fp32, every)}."
    )
    sizes = [b for b in baseline[0]["items_per_s"] if b in ("1", "8", "16", "32", "64")]
    speed = table(
        ["variant", "load s", "p50 wall ms, 1 text, every thread", *(f"items/s b{b}" for b in sizes)],
        [(r["variant"], num(r["load_s"], 2), num(r["latency_ms_batch1"]["p50"], 2),
          *(num(r["items_per_s"][b], 0) for b in sizes)) for r in baseline],
    )  # fmt: skip
    recipes = table(
        ["variant", "recipe", "MB", "mean cos", "min cos", "STS-B", "max difference", "texts/CPU-s b1",
         "texts/CPU-s b16", "gates"],
        [(r["name"], r["note"], num(r["bytes"] / 1e6), _cos(r, "mean_cosine_to_fp32"),
          _cos(r, "min_cosine_to_fp32"), num(r.get("stsb_spearman_x100"), 2),
          _difference(r["max_batch_difference"]), num(r.get("texts_per_cpu_s_b1"), 0),
          num(r.get("texts_per_cpu_s_b16"), 0),
          "" if r["kind"] == "fp32" else ", ".join(r["gate_failures"]) or "pass")
         for r in rows.values()],
        align="llrrrrrrrl",
    )  # fmt: skip
    failed = [f"`{r['name']}` ({r['note']}): {r['error'][:80]}" for r in study["variants"] if "error" in r]
    if failed:
        recipes += ["", "Failed to build: " + "; ".join(failed) + "."]
    sections = {
        "build": [served],
        "variants": variants,
        "invariance": [invariance],
        "speed": speed,
        "recipes": recipes,
        "decision": [_decision(study, rows)],
    }
    return page(result["stamp"], sections, note)


def _decision(study: dict[str, Any], rows: dict[str, dict[str, Any]]) -> str:
    static = [r for r in study["variants"] if r["kind"] == "static"]
    passing = [r for r in static if r.get("gate_failures") == []]
    default = rows[study["int8_default"]]
    twins = [
        r["name"] for r in static if r["name"] != "int8-static" and r.get("recipe") == study["build_recipe"]
    ]
    text = (
        f"Served as `int8`: `{default['name']}`. {len(passing)} of {len(static)} static files pass the gates"
        + (f" (`{twins[0]}` is the build's own recipe, `int8-static`, rebuilt by the study)" if twins else "")
    )
    if not study["best_static"]:
        return text + "."
    best = rows[study["best_static"]]
    return (
        f"{text}; the highest median at batch 16 of them in this run, `{best['name']}` ({best['note']}), does"
        f" {_ratio(best, default, 'texts_per_cpu_s_b16')}× the texts per CPU-second of `{default['name']}`"
        f" at batch 16, and its file is {best['bytes'] / default['bytes']:.2f}× the size."
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    quant_study.add_arguments(parser)  # --model-dir, --stsb, --stsb-limit and --quick
    parser.add_argument(
        "--seconds", type=float, help="seconds per wall-clock point (default 0.5, quick 0.05)"
    )
    parser.add_argument("--out", type=Path, help="folder for stage0.json and .md (out/results, docs/results)")
    evidence.add_arguments(parser, quick=False)
    args = parser.parse_args(argv)
    if args.stsb is not None and not args.stsb.exists():
        parser.error(f"--stsb {args.stsb}: no such file")
    if args.quick and args.stsb_limit is None:
        args.stsb_limit = 200
    run = evidence.start("benchmarks.stage0", args, argv)
    seconds = args.seconds or (0.05 if args.quick else 0.5)
    result: dict[str, Any] = {"stamp": {}, "build": facts(args.model_dir)}
    result["baseline"] = measure(seconds, args.model_dir)
    result["study"] = quant_study.run(args)
    result["stamp"] = run.stamp()
    evidence.publish(run, "stage0", result, markdown, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
