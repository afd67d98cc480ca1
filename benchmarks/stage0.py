"""`make results ONLY=stage0`: stage 0's baseline (fp32 against the INT8 variants), recorded for the docs.

    python -m benchmarks.stage0            # 2 s per measurement, about 1 minute
    python -m benchmarks.stage0 --quick    # 0.2 s per measurement, seconds
    python -m benchmarks.stage0 --record   # written to docs/results/stage0.json and stage0.md

The measurement is stage 0's own (``python -m stage0_script --bench`` prints the same table);
this module stamps it, writes the tables the chapters include, and compares a reader's figures
with the committed ones.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtests import evidence
from loadtests.tables import num, page, table
from stage0_script.__main__ import measure


def markdown(result: dict[str, Any]) -> str:
    """stage0.md: size, load, latency and items/s by batch size; quality from the build."""
    rows = result["variants"]
    batches = [b for b in rows[0]["items_per_s"] if b in ("1", "8", "32", "64")]
    note = (
        f"Texts: {result['texts']['count']} unique {result['texts']['kind']}s."
        f" The INT8 mode the build chose: `{result['int8_default']}`."
    )
    speed = table(
        ["variant", "file MB", "load s", "p50 ms, 1 text", *(f"items/s b{b}" for b in batches)],
        [
            (r["variant"], num(r["size_mb"]), num(r["load_s"], 2), num(r["latency_ms_batch1"]["p50"], 2),
             *(num(r["items_per_s"][b], 0) for b in batches))
            for r in rows
        ],
    )  # fmt: skip
    quality = table(
        ["variant", "mean cosine to fp32", "min cosine to fp32", "STS-B Spearman ×100",
         "max difference, alone vs in a batch"],
        [
            (r["variant"], num(q.get("mean_cosine_to_fp32"), 4), num(q.get("min_cosine_to_fp32"), 4),
             num(q.get("stsb_spearman_x100"), 2), _difference(q.get("max_batch_difference")))
            for r in rows
            for q in [r.get("quality", {})]
        ],
    )  # fmt: skip
    dynamic = next((r.get("one_thread", {}) for r in rows if r["variant"] == "int8-dynamic"), {})

    def per_cpu_s(row: dict[str, Any], key: str) -> tuple[str, str]:
        """Texts per CPU-second on one thread, and the ratio to dynamic INT8's."""
        value, base = row.get("one_thread", {}).get(key), dynamic.get(key)
        return num(value, 0), num(value / base if value and base else None, 2)

    one_thread = table(
        ["variant", "texts/CPU-s, 1 text", "× int8-dynamic", "texts/CPU-s, batch 16", "× int8-dynamic"],
        [
            (r["variant"], *per_cpu_s(r, "texts_per_cpu_s_b1"), *per_cpu_s(r, "texts_per_cpu_s_b16"))
            for r in rows
        ],
    )
    sections = {"speed": speed, "quality": quality, "one_thread": one_thread}
    return page(result["stamp"], sections, note)


def _difference(value: float | None) -> str:
    """0 when a batch changes nothing (bitwise), else the largest difference of one component."""
    if value is None:
        return "–"
    return "0 (identical)" if value == 0 else f"{value:.1e}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, help="seconds per measurement (default 2, quick 0.2)")
    parser.add_argument("--out", type=Path, help="folder for stage0.json and .md (out/results, docs/results)")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.stage0", args, argv)
    seconds = args.seconds or (0.2 if args.quick else 2.0)
    result = {"stamp": {}, **measure(seconds)}
    result["stamp"] = run.stamp()
    evidence.publish(run, "stage0", result, markdown, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
