"""The model build: manifest facts, rebuild-only-when-needed, gates, and `--model` for another encoder."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.settings import Settings
from stage0_script.build_model import (
    STSB_CSV,
    choose_default,
    packaged_model_dir,
    sha256_file,
    source_fingerprint,
    up_to_date,
)
from stage0_script.quality import GATE_MEAN_COSINE, INVARIANCE_ATOL, gate_failures

REPO = Path(__file__).resolve().parent.parent
STSB = STSB_CSV  # the STS-benchmark dev pairs in the repository (data/stsb/), what `make model` uses


def _manifest(settings: Settings) -> dict:  # type: ignore[type-arg]
    return json.loads((settings.model_dir / "manifest.json").read_text())


def test_manifest_records_the_build(settings: Settings) -> None:
    m = _manifest(settings)
    assert m["model_id"] == "all-MiniLM-L6-v2"
    assert m["dimensions"] == 384 and m["max_tokens"] == 256 and m["pooling"] == "mean"
    # Row-wise INT8 passes the gate and is batch invariant on this model: the build serves it, and says why.
    assert m["int8_default"] == "int8-rowwise" and m["quantization"]["mode"] == "rowwise"
    assert "same alone and in batches" in m["int8_default_why"]
    assert m["quality"]["variants"]["int8-rowwise"]["max_batch_difference"] <= INVARIANCE_ATOL
    for rel, meta in m["files"].items():
        path = settings.model_dir / rel
        assert path.stat().st_size == meta["bytes"]
        assert sha256_file(path) == meta["sha256"]
    assert m["gate"]["passed"] is True
    q = m["quality"]["variants"]
    assert q[m["int8_default"]]["mean_cosine_to_fp32"] >= GATE_MEAN_COSINE
    assert m["quality"]["sentences"] >= 200
    drop = q["fp32"]["stsb_spearman_x100"] - q[m["int8_default"]]["stsb_spearman_x100"]
    assert drop <= 1.0


def test_second_run_does_nothing(settings: Settings) -> None:
    before = {p: p.stat().st_mtime_ns for p in settings.model_dir.rglob("*") if p.is_file()}
    args = [sys.executable, "-m", "stage0_script.build_model", "--stsb", str(STSB)]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "up to date" in proc.stdout
    after = {p: p.stat().st_mtime_ns for p in settings.model_dir.rglob("*") if p.is_file()}
    assert before == after


def test_a_changed_or_missing_file_means_rebuild(settings: Settings, tmp_path: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(settings.model_dir, copy)
    fingerprint = _manifest(settings)["source"]["fingerprint"]
    assert up_to_date(copy, fingerprint)
    assert not up_to_date(copy, "another-source")
    (copy / "tokenizer.json").write_text("{}")
    assert not up_to_date(copy, fingerprint)
    (copy / "int8-static" / "model.onnx").unlink()
    assert not up_to_date(copy, fingerprint)


def test_fingerprint_follows_the_source_files(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(packaged_model_dir(), src)
    a = source_fingerprint(str(src), {"stsb": True})
    assert a == source_fingerprint(str(src), {"stsb": True})
    assert a != source_fingerprint(str(src), {"stsb": False})
    (src / "config.json").write_text((src / "config.json").read_text() + " ")
    assert a != source_fingerprint(str(src), {"stsb": True})


def test_gate_messages_say_which_and_by_how_much() -> None:
    report = {
        "variants": {
            "fp32": {"stsb_spearman_x100": 86.7},
            "int8-static": {
                "mean_cosine_to_fp32": 0.93,
                "min_cosine_to_fp32": 0.88,
                "stsb_spearman_x100": 85.0,
            },
        }
    }
    failures = gate_failures(report, "int8-static")
    assert len(failures) == 2
    assert "0.9300 < 0.99" in failures[0] and "short by 0.0600" in failures[0]
    assert "1.70 points below fp32" in failures[1]


def test_the_default_is_row_wise_only_while_it_passes_the_gate_and_is_batch_invariant() -> None:
    def report(rowwise_cosine: float, rowwise_moved: float) -> dict:  # type: ignore[type-arg]
        entry = {"mean_cosine_to_fp32": 0.995, "max_batch_difference": 0.03}
        return {
            "variants": {
                "int8-dynamic": entry,
                "int8-static": {**entry, "max_batch_difference": 0.0},
                "int8-rowwise": {
                    "mean_cosine_to_fp32": rowwise_cosine,
                    "max_batch_difference": rowwise_moved,
                },
            }
        }

    assert choose_default(report(0.997, 0.0))[0] == "int8-rowwise"
    variant, why = choose_default(report(0.997, 0.02))  # invariant no longer: the first that passes
    assert variant == "int8-dynamic" and "int8-rowwise: a batch moves a text's vector by 2.0e-02" in why
    variant, why = choose_default(report(0.95, 0.0))
    assert variant == "int8-dynamic" and "int8-rowwise: mean cosine to fp32 0.9500 < 0.99" in why


@pytest.mark.timeout(600)
def test_model_option_builds_another_bert_encoder(tmp_path: Path) -> None:
    """`--model PATH` takes any BERT-family checkpoint: a tiny random BERT, exported and quantized."""
    from transformers import BertConfig, BertModel

    src = tmp_path / "tiny-bert"
    config = BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    BertModel(config).save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(packaged_model_dir() / name, src / name)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "stage0_script.build_model",
            "--model",
            str(src),
            "--out-root",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    out = tmp_path / "out" / "tiny-bert"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model_id"] == "tiny-bert" and manifest["dimensions"] == 32
    for variant in ("fp32", "int8-dynamic", "int8-static", "int8-rowwise"):
        assert (out / variant / "model.onnx").stat().st_size > 0
    assert manifest["int8_default_why"]
    # A random model may or may not pass the gates; either way the exit code and message must say so.
    if manifest["gate"]["passed"]:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 1 and "quality gate FAILED" in proc.stderr
