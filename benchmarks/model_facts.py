"""The model build's facts as a results file: sizes, quality against fp32, the INT8 mode chosen.

    python -m benchmarks.model_facts            # out/results/model.json and model.md
    python -m benchmarks.model_facts --record   # docs/results/model.json and model.md

`make model` writes them into the model folder's manifest.json (git-ignored); the docs quote them
from here, stamped like every other result, so a number such as the INT8 file size has a source.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.settings import get_settings
from loadtests import evidence
from loadtests.tables import num, page, table


def facts(model_dir: Path) -> dict[str, Any]:
    """What the build recorded, less its paths and checksums."""
    manifest = json.loads((model_dir / "manifest.json").read_text())
    quality = manifest.get("quality", {})
    return {
        "model_id": manifest["model_id"],
        "dimensions": manifest["dimensions"],
        "max_tokens": manifest["max_tokens"],
        "pooling": manifest["pooling"],
        "normalize": manifest["normalize"],
        "int8_default": manifest["int8_default"],
        "build_seconds": manifest.get("build_seconds"),
        "gate": manifest.get("gate"),
        "files_mb": {
            name.split("/")[0]: round(f["bytes"] / 1e6, 1)
            for name, f in manifest["files"].items()
            if name.endswith("model.onnx")
        },
        "quantization": manifest["quantization"],
        "quality": quality,
    }


def markdown(result: dict[str, Any]) -> str:
    q = result["quality"]
    note = (
        f"`{result['model_id']}`: {result['dimensions']} dimensions, at most {result['max_tokens']} tokens,"
        f" {result['pooling']} pooling, {result['normalize']} normalized; built in"
        f" {num(result['build_seconds'], 0)} s. The INT8 mode the build chose: `{result['int8_default']}`."
    )
    rows = []
    for variant, mb in result["files_mb"].items():
        v = q.get("variants", {}).get(variant, {})
        rows.append(
            (
                variant,
                num(mb),
                num(v.get("mean_cosine_to_fp32"), 4),
                num(v.get("min_cosine_to_fp32"), 4),
                num(v.get("stsb_spearman_x100"), 2),
            )
        )
    variants = [
        f"{q.get('sentences', '?')} gate sentences, {q.get('stsb_pairs', '?')} STS-B pairs:",
        "",
        *table(
            ["variant", "file MB", "mean cosine to fp32", "min cosine to fp32", "STS-B Spearman ×100"], rows
        ),
    ]
    return page(result["stamp"], {"variants": variants}, note)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=get_settings().model_dir)
    parser.add_argument("--out", type=Path, help="folder for model.json and model.md")
    evidence.add_arguments(parser)  # --quick is accepted and changes nothing: reading takes no time
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.model_facts", args, argv)
    run.quick = False  # reading the manifest has no short form: a QUICK run records the same facts
    result = {"stamp": run.stamp(), **facts(args.model_dir)}
    out = args.out or run.results_dir
    evidence.write_json(out / "model.json", result)
    evidence.write_text(out / "model.md", markdown(result))
    print(f"wrote {out / 'model.json'} and {out / 'model.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
