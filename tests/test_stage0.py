"""Stage 0, the plain script: arguments, file and stdin in; vectors or a summary out; --bench; and
its recorded step, which stamps the bench beside the quantization study."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from common.engine import Engine
from common.settings import Settings
from stage0_script.quality import INVARIANCE_ATOL

REPO = Path(__file__).resolve().parent.parent


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stage0_script", *args],
        cwd=REPO,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_texts_as_arguments_give_the_engine_vectors(engine: Engine) -> None:
    proc = _run("A man is playing guitar.", "A river floods the valley.")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    vectors = np.asarray(out["embeddings"], dtype=np.float32)
    assert vectors.shape == (2, 384)
    expected = engine.embed(["A man is playing guitar.", "A river floods the valley."]).vectors
    assert np.allclose(vectors, expected, atol=1e-5)
    assert out["tokens"] == [8, 8] and out["truncated"] == [False, False]


def test_stdin_and_file(tmp_path: Path) -> None:
    proc = _run("--summary", stdin="first line\n\nsecond line\n")
    assert proc.returncode == 0, proc.stderr
    assert "2 texts -> (2, 384)" in proc.stdout
    f = tmp_path / "texts.txt"
    f.write_text("one\ntwo\nthree\n")
    proc = _run("--file", str(f))
    assert proc.returncode == 0 and len(json.loads(proc.stdout)["embeddings"]) == 3


def test_no_texts_is_a_clear_error() -> None:
    proc = _run(stdin="")
    assert proc.returncode == 2 and "no texts" in proc.stderr


def test_bench_prints_and_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "stage0.json"
    proc = _run("--bench", "--seconds", "0.05", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "int8-dynamic" in proc.stdout and "items/s by batch size" in proc.stdout
    result = json.loads(out.read_text())
    assert "stamp" not in result and "machine" not in result  # stage 0 measures; benchmarks/ records
    names = [v["variant"] for v in result["variants"]]
    assert names == ["fp32", "int8-dynamic", "int8-static", "int8-rowwise"]
    for v in result["variants"]:
        assert v["size_mb"] > 0 and v["load_s"] > 0 and v["latency_ms_batch1"]["p50"] > 0
        assert set(v["items_per_s"]) == {"1", "2", "4", "8", "16", "32", "64"}
        assert all(x > 0 for x in v["items_per_s"].values())
    sizes = {v["variant"]: v["size_mb"] for v in result["variants"]}
    assert sizes["int8-dynamic"] < sizes["fp32"] / 3  # INT8 weights: about a quarter of fp32
    assert "stsb_spearman_x100" in result["variants"][0]["quality"]


def test_the_recorded_step_is_stamped_and_rendered(tmp_path: Path, settings: Settings) -> None:
    """`make results ONLY=stage0`: the build's facts, the four files and the quantization study from
    one run, stamped, with the tables the chapters include."""
    args = ["--quick", "--seconds", "0.05", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.stage0", *args],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "stage0.json").read_text())
    stamp = result["stamp"]
    assert stamp["quick"] is True and stamp["machine"]["logical_cores"] >= 1 and stamp["commit"]
    assert stamp["command"] == "python -m benchmarks.stage0 " + " ".join(args)
    manifest = json.loads((settings.model_dir / "manifest.json").read_text())
    assert result["build"]["int8_default"] == manifest["int8_default"] == result["study"]["int8_default"]
    measured = {r["name"]: r for r in result["study"]["variants"]}
    for name in ("fp32", "int8-dynamic", "int8-static", "int8-rowwise"):
        assert measured[name]["texts_per_cpu_s_b1"] > 0 and measured[name]["texts_per_cpu_s_b16"] > 0
        assert measured[name]["bytes"] == manifest["files"][f"{name}/model.onnx"]["bytes"]
    moved = {name: r["max_batch_difference"] for name, r in measured.items()}
    assert moved["int8-rowwise"] <= INVARIANCE_ATOL < moved["int8-dynamic"]
    assert any(r["kind"] == "static" and r["name"].startswith("s-") for r in measured.values())  # the study
    page = (tmp_path / "stage0.md").read_text()
    for section in ("machine", "build", "variants", "invariance", "speed", "recipes", "decision"):
        assert f"[start:{section}]" in page and f"[end:{section}]" in page
    variants = page.split("[start:variants]")[1].split("[end:variants]")[0]
    assert [line.split("|")[1].strip() for line in variants.splitlines() if line.startswith("| ")][1:] == [
        "fp32", "int8-dynamic", "int8-static", "int8-rowwise",
    ]  # fmt: skip
