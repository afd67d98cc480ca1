"""`make results ONLY=quantization`: stage 0's quantization study, recorded: tables and a plot for the docs.

    python -m benchmarks.quantization            # every recipe, about ten minutes on 2 cores
    python -m benchmarks.quantization --quick    # three recipes, 200 STS-B pairs, about 2 minutes
    python -m benchmarks.quantization --record   # docs/results/quantization.*, docs/img/quantization.png

The study itself (recipes, measurements, the decision) is stage 0's lesson and lives in
``stage0_script/quant_study.py``; this module stamps what it found and renders it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtests import evidence
from loadtests.tables import num, page, table
from stage0_script import quant_study


def _gates(r: dict[str, Any]) -> str:
    if r["kind"] == "fp32":
        return ""
    return "pass" if not r["gate_failures"] else ", ".join(r["gate_failures"])


def markdown(report: dict[str, Any]) -> str:
    """quantization.md: quality (``table``), speed (``speed``) and the decision, as named sections."""
    rows = report["variants"]
    fp32_bytes = next(r["bytes"] for r in rows if r["name"] == "fp32")
    ok = [r for r in rows if "error" not in r]
    failed = [f"`{r['name']}` ({r['note']}) failed: {r['error'][:80]}" for r in rows if "error" in r]
    note = f"{report['sentences']} gate sentences, {report['stsb_pairs']} STS-B pairs."
    quality = table(
        ["variant", "recipe", "mean cos", "min cos", "STS-B", "batch inv. min cos", "gates"],
        [
            (r["name"], r["note"],
             "—" if r["kind"] == "fp32" else num(r["mean_cosine_to_fp32"], 4),
             "—" if r["kind"] == "fp32" else num(r["min_cosine_to_fp32"], 4),
             num(r.get("stsb_spearman_x100"), 2), num(r["batch_invariance_min_cosine"], 5), _gates(r))
            for r in ok
        ],
        align="llrrrrl",
    )  # fmt: skip
    if failed:
        quality += ["", "Failed to build: " + "; ".join(failed) + "."]
    speed = table(
        ["variant", "MB", "load s", "texts/CPU-s b1", "texts/CPU-s b32", "texts/s b32 (wall, best)"],
        [
            (r["name"], num(r["bytes"] / 1e6), num(r["load_s"], 2), num(r["texts_per_cpu_s_b1"], 0),
             num(r["texts_per_cpu_s_b32"], 0), num(r["texts_per_s_b32_wall_best"], 0))
            for r in ok
        ],
    )  # fmt: skip
    d = report["decision"]
    summary = [f"Default INT8 chosen from this run: **{d['default']}** ({d['why']})."]
    if d["static"]:
        s = next(r for r in rows if r["name"] == d["static"])
        summary.append(
            f"Best static recipe that passes the gates: `{s['name']}` ({s['note']}),"
            f" {s['texts_per_cpu_s_b32']:.0f} texts per CPU-second at batch 32,"
            f" {s['bytes'] / fp32_bytes:.0%} of the fp32 file size."
        )
    return page(report["stamp"], {"table": quality, "speed": speed, "decision": [" ".join(summary)]}, note)


def plot(report: dict[str, Any], path: Path) -> Path:
    """Two bar charts side by side, one row per variant: quality (with the gate) and speed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["variants"] if "error" not in r and r["kind"] != "fp32"][::-1]
    fp32 = next(r for r in report["variants"] if r["name"] == "fp32")
    names = [r["name"] for r in rows]
    colours = ["tab:green" if not r["gate_failures"] else "tab:red" for r in rows]
    fig, (cos_ax, speed_ax) = plt.subplots(1, 2, figsize=(11, 0.32 * len(rows) + 1.6), sharey=True)
    cos_ax.barh(names, [r["mean_cosine_to_fp32"] for r in rows], color=colours)
    gate = report["gates"]["mean_cosine"]
    cos_ax.axvline(gate, color="black", linestyle="--", linewidth=1)
    low = min(r["mean_cosine_to_fp32"] for r in rows)
    cos_ax.set_xlim(low - 0.01, 1.0)
    cos_ax.set_xlabel(f"mean cosine to fp32 (gate {gate}, dashed)")
    speed_ax.barh(names, [r["texts_per_cpu_s_b32"] for r in rows], color=colours)
    speed_ax.axvline(fp32["texts_per_cpu_s_b32"], color="tab:blue", linestyle=":", linewidth=1.5)
    speed_ax.set_xlabel("texts per CPU-second, batch 32, one thread (fp32 dotted)")
    for ax in (cos_ax, speed_ax):
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("INT8 variants against fp32: green passes both quality gates, red fails one")
    fig.tight_layout()
    evidence.save_figure(fig, path, report["stamp"])
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    quant_study.add_arguments(parser)  # --quick comes from here
    parser.add_argument("--out", type=Path, help="folder for quantization.json and .md")
    parser.add_argument("--img", type=Path, help="folder for quantization.png")
    evidence.add_arguments(parser, quick=False)
    args = parser.parse_args(argv)
    if args.stsb is not None and not args.stsb.exists():
        parser.error(f"--stsb {args.stsb}: no such file")
    if args.quick and args.stsb_limit is None:
        args.stsb_limit = 200
    run = evidence.start("benchmarks.quantization", args, argv)
    report: dict[str, Any] = {"stamp": {}, **quant_study.run(args)}
    report["stamp"] = run.stamp()
    out, img = args.out or run.results_dir, args.img or run.img_dir
    written = [
        evidence.write_json(out / "quantization.json", report),
        evidence.write_text(out / "quantization.md", markdown(report)),
        plot(report, img / "quantization.png"),
    ]
    print(f"decision: {report['decision']}")
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
