"""Evidence you can trust: stamps, out/ against docs/, `make results`, and the checks on docs/.

The two checks on the committed docs (``test_the_committed_evidence_is_current`` and
``test_every_number_in_the_chapters_comes_from_a_results_file``) are the ones the lead acts on:
the first fails until `make results` has run at a clean commit (and after a default changes);
the second fails on a measured-looking number in a chapter that no results file holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from benchmarks import evidence_check, quant_study, results
from benchmarks.evidence_check import (
    Sources,
    prose_numbers,
    stale_evidence,
    stamp_problems,
    unsourced_numbers,
)
from common.settings import Settings
from loadtests import evidence, tables

REPO = Path(__file__).resolve().parent.parent


def _fresh_stamp(**changes: object) -> dict[str, object]:
    """A stamp as a clean, full run at this commit would write it."""
    run = evidence.Run("benchmarks.example", ["--record"], record=True, commit="0" * 40)
    return {**run.stamp(), **changes}


# --- the stamp ---------------------------------------------------------------------------
def test_a_stamp_has_every_field_and_one_machine_record() -> None:
    stamp = _fresh_stamp()
    assert {"commit", "dirty", "date", "command", "wall_s", "quick", "machine", "settings"} <= set(stamp)
    assert stamp["command"] == "python -m benchmarks.example --record"
    assert set(stamp["machine"]) == {
        "cpu_model",
        "isa",
        "logical_cores",
        "physical_cores",
        "memory_gib",
        "os",
        "python",
        "versions",
    }
    assert stamp["machine"]["logical_cores"] >= 1 and stamp["machine"]["versions"]["numpy"] != "missing"
    assert stamp["settings"]["defaults_fingerprint"] == evidence.defaults_fingerprint()


def test_the_settings_record_lists_what_differs_from_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper() in {n.upper() for n in Settings.model_fields}:
            monkeypatch.delenv(name)
    assert evidence.settings_record()["changed"] == {}
    monkeypatch.setenv("BATCH_WINDOW_MS", "2")
    monkeypatch.setenv("CACHE_URL", "redis://:hunter2@127.0.0.1:6379/0")
    record = evidence.settings_record({"MAX_QUEUE": "256", "PORT": "9999"})
    # the launchers pick HOST and PORT per server; a secret never reaches a results file
    assert record["changed"] == {"BATCH_WINDOW_MS": 2.0, "CACHE_URL": "<secret>", "MAX_QUEUE": 256}
    assert evidence.settings_record(without=("CACHE_URL",))["changed"] == {"BATCH_WINDOW_MS": 2.0}


def test_the_fingerprint_changes_with_any_default_and_only_then(monkeypatch: pytest.MonkeyPatch) -> None:
    before = evidence.defaults_fingerprint()
    assert before == evidence.defaults_fingerprint()
    monkeypatch.setenv("MAX_QUEUE", "7")  # the environment is a run's settings, not the defaults
    assert evidence.defaults_fingerprint() == before

    class Changed(Settings):
        max_queue: int = 2048

    assert evidence.defaults_fingerprint(Changed) != before
    # paths are recorded relative to the checkout, so every clone computes the same fingerprint
    assert evidence.defaults()["MODEL_DIR"] == "models/all-MiniLM-L6-v2"


def test_recording_refuses_a_dirty_tree_unless_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "code.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    commit, changed = evidence.git_state(tmp_path)
    assert len(commit) == 40 and changed == []
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "new.json").write_text("{}")  # what a run writes: not code
    assert evidence.git_state(tmp_path)[1] == []
    (tmp_path / "code.py").write_text("x = 2\n")
    (tmp_path / "new_module.py").write_text("")
    assert sorted(evidence.git_state(tmp_path)[1]) == ["code.py", "new_module.py"]

    monkeypatch.setattr(evidence, "git_state", lambda repo=tmp_path: ("1" * 40, ["code.py"]))
    args = type("Args", (), {"record": True, "allow_dirty": False, "quick": False})()
    with pytest.raises(evidence.DirtyTree, match="--allow-dirty"):
        evidence.start("benchmarks.example", args, ["--record"])
    args.allow_dirty = True
    run = evidence.start("benchmarks.example", args, ["--record", "--allow-dirty"])
    assert run.record and run.stamp()["dirty"] is True and run.results_dir == evidence.RESULTS
    args.record = args.allow_dirty = False  # a reader's run: out/, never refused, honestly stamped
    run = evidence.start("benchmarks.example", args, [])
    assert run.results_dir == evidence.OUT / "results" and run.img_dir == evidence.OUT / "img"
    assert run.stamp()["dirty"] is True


def test_pages_and_pictures_carry_the_provenance(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stamp = _fresh_stamp()
    text = tables.page(stamp, {"numbers": tables.table(["a", "b"], [("x", tables.num(1234.5))])})
    assert evidence.read_provenance(text) == evidence.provenance(stamp)
    assert "| x   | 1,234.5 |" in text and "|:----|--------:|" in text
    assert "[start:machine]" in text and evidence.describe(stamp) in text
    fig = plt.figure()
    plot = evidence.save_figure(fig, tmp_path / "plot.png", stamp)
    plt.close(fig)
    assert evidence.read_png_provenance(plot) == evidence.provenance(stamp)
    Image.new("RGB", (8, 8)).save(tmp_path / "shot.png")  # a browser's screenshot
    assert evidence.read_png_provenance(tmp_path / "shot.png") is None
    evidence.stamp_png(tmp_path / "shot.png", stamp)
    assert evidence.read_png_provenance(tmp_path / "shot.png") == evidence.provenance(stamp)


# --- staleness ---------------------------------------------------------------------------
def test_stamp_problems_name_every_reason() -> None:
    now = evidence.defaults()
    assert stamp_problems("a.json", _fresh_stamp(), now) == []
    assert stamp_problems("a.json", None, now) == ["a.json: no stamp (not written by a stamped run)"]
    assert "uncommitted" in stamp_problems("a.json", _fresh_stamp(dirty=True), now)[0]
    assert "QUICK" in stamp_problems("a.json", _fresh_stamp(quick=True), now)[0]
    assert "stamp without" in stamp_problems("a.json", {"date": "d"}, now)[0]
    old = _fresh_stamp(date="2001-01-01T00:00:00+00:00", commit="f" * 40)
    assert stamp_problems("a.json", old, now) == []  # age alone is never a reason


def test_a_build_that_serves_another_int8_file_makes_a_run_stale(tmp_path: Path) -> None:
    stamp = _fresh_stamp()
    served = stamp["model"]["variant"]  # type: ignore[index]
    assert served == evidence.served_variant("int8", evidence.REPO / "models" / "all-MiniLM-L6-v2")
    other = "int8-rowwise" if served != "int8-rowwise" else "int8-dynamic"
    (tmp_path / "manifest.json").write_text(json.dumps({"int8_default": other}))
    now = {**evidence.defaults(), "MODEL_DIR": str(tmp_path)}
    problems = stamp_problems("a.json", stamp, now)
    assert f"a.json: measured on {served}; MODEL_VARIANT=int8 serves {other} now" in problems
    unnamed = {k: v for k, v in stamp.items() if k != "model"}
    assert "which model" in stamp_problems("a.json", unnamed, evidence.defaults())[0]


def test_a_changed_or_removed_default_makes_a_run_stale_and_a_new_setting_does_not() -> None:
    stamp = _fresh_stamp()
    now = evidence.defaults()
    assert stamp_problems("a.json", stamp, {**now, "A_SETTING_ADDED_LATER": 1}) == []
    changed = stamp_problems("a.json", stamp, {**now, "MAX_QUEUE": 2048})
    assert changed == ["a.json: the default of MAX_QUEUE changed since it was measured (1024, now 2048)"]
    gone = stamp_problems("a.json", stamp, {k: v for k, v in now.items() if k != "SHED_DELAY_MS"})
    assert gone == [
        "a.json: the default of SHED_DELAY_MS changed since it was measured (50.0, the setting is gone)"
    ]
    # the recorded defaults and their fingerprint check each other: an edit by hand shows
    settings = stamp["settings"]
    assert isinstance(settings, dict)
    edited = {**stamp, "settings": {**settings, "defaults": {**settings["defaults"], "MAX_QUEUE": 2048}}}
    assert "edited by hand" in stamp_problems("a.json", edited, {**now, "MAX_QUEUE": 2048})[0]
    fingerprint_only = {"changed": {}, "defaults_fingerprint": settings["defaults_fingerprint"]}
    unrecorded = {**stamp, "settings": fingerprint_only}
    assert "does not record the defaults" in stamp_problems("a.json", unrecorded, now)[0]


def _write_page(results: Path, img: Path, stamp: dict[str, object]) -> None:
    """A small results folder laid out as `make results` leaves it (the stage 0 page and its picture)."""
    figures = {"bytes": 2e7, "mean_cosine_to_fp32": 0.99, "min_cosine_to_fp32": 0.98, "gate_failures": []}
    figures |= {"stsb_spearman_x100": 86.5, "max_batch_difference": 0.0}
    figures |= {"texts_per_cpu_s_b1": 250.0, "texts_per_cpu_s_b16": 60.0}
    rows = [{**figures, "name": n, "kind": n.removeprefix("int8-"), "note": ""} for n in quant_study.BUILT]
    build = {"model_id": "m", "dimensions": 384, "max_tokens": 256, "pooling": "mean", "normalize": "l2"}
    build |= {"int8_default": "int8-rowwise", "int8_default_why": "invariant", "build_seconds": 50.0}
    baseline = {"load_s": 0.1, "latency_ms_batch1": {"p50": 6.1}, "items_per_s": {"1": 170.0, "8": 177.0}}
    study = {"sentences": 2, "stsb_pairs": 2, "int8_default": "int8-rowwise", "best_static": None}
    result = {
        "stamp": stamp,
        "build": build,
        "baseline": {"variants": [{"variant": "fp32", **baseline}]},
        "study": {**study, "variants": rows},
    }
    evidence.write_json(results / "stage0.json", result)
    evidence.write_text(results / "stage0.md", results_page("stage0.json", results))


def results_page(name: str, folder: Path) -> str:
    step = next(s for s in results.STEPS if name in s.writes)
    return step.page(json.loads((folder / name).read_text()))


def test_changing_a_default_makes_the_evidence_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    res, img = tmp_path / "results", tmp_path / "img"
    img.mkdir()
    monkeypatch.setattr(evidence_check, "STEPS", tuple(s for s in results.STEPS if s.name == "stage0"))
    _write_page(res, img, _fresh_stamp())
    assert stale_evidence(res, img) == []

    # A default changes in common/settings.py, and nobody reruns the measurement:
    monkeypatch.setattr(Settings.model_fields["max_queue"], "default", 2048)
    problems = stale_evidence(res, img)
    assert problems == [
        "stage0.json: the default of MAX_QUEUE changed since it was measured (1024, now 2048)"
    ]
    _write_page(res, img, _fresh_stamp())  # ... until it is rerun
    assert stale_evidence(res, img) == []


def test_the_staleness_check_catches_each_kind_of_stale_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    res, img = tmp_path / "results", tmp_path / "img"
    img.mkdir()
    monkeypatch.setattr(evidence_check, "STEPS", tuple(s for s in results.STEPS if s.name == "stage0"))
    assert stale_evidence(res, img) == ["stage0.json: missing (make results writes it)"]
    _write_page(res, img, _fresh_stamp(dirty=True))
    assert stale_evidence(res, img) == ["stage0.json: measured with uncommitted changes (--allow-dirty)"]
    _write_page(res, img, _fresh_stamp())
    page = (res / "stage0.md").read_text()
    (res / "stage0.md").write_text(page.replace('"commit": "000', '"commit": "111'))  # from another run
    assert stale_evidence(res, img) == [
        "stage0.md: provenance differs from its JSON's stamp (rendered from another run)"
    ]
    (res / "stage0.md").write_text(page)
    data = json.loads((res / "stage0.json").read_text())
    del data["stamp"]
    (res / "stage0.json").write_text(json.dumps(data))
    (res / "old_table.md").write_text("| typed | by hand |\n")
    Image.new("RGB", (8, 8)).save(img / "orphan.png")
    assert stale_evidence(res, img) == [
        "stage0.json: no stamp (not written by a stamped run)",
        "old_table.md: no step of make results writes it (remove it, or add a step)",
        f"orphan.png: no step of make results draws it ({evidence_check.HAND_DRAWN})",
    ]


def test_every_results_page_is_rendered_from_its_json() -> None:
    """A page typed (or edited) by hand, or rendered by an older format, fails here."""
    stale = [
        name
        for step in results.STEPS
        if step.stamped
        for name in step.writes
        if (evidence.RESULTS / name).is_file()
        and (evidence.RESULTS / name.replace(".json", ".md")).read_text()
        != step.page(json.loads((evidence.RESULTS / name).read_text()))
    ]
    assert not stale, f"pages that are not what their JSON renders to (edited by hand?): {stale}"


def test_the_committed_evidence_is_current() -> None:
    """Every results file stamped, clean, full, with today's defaults. Fails until `make results`
    has rerun the measurements at a clean commit (and after any change of a default)."""
    problems = stale_evidence()
    assert not problems, "run `make results` at a clean commit and commit docs/:\n" + "\n".join(problems)


# --- numbers in prose --------------------------------------------------------------------
PROSE = """# Stage 3

Stage 3 answered 512 req/s at 32 clients, 1.55x stage 2 and 92% of the ceiling; p99 45 ms.
It ran 61,568 requests in 10 minutes on Python 3.11.7 with int8 and fp32, `MAX_BATCH_SIZE=32`.

```bash
curl -d '{"inputs": ["x"]}' localhost:8000   # took 123.4 ms
```

A vendor quotes 900 req/s for a bigger machine. <!-- quoted -->
--8<-- "docs/results/stage3.md:targets"
The window was 2.0 ms <!-- 77.7 ms in a comment -->, see [the run](results/x.json).
"""


def test_prose_numbers_are_the_measured_looking_ones() -> None:
    found = [(line, typed) for line, typed, _, _ in prose_numbers(PROSE)]
    assert found == [
        (3, "512 req/s"),
        (3, "1.55x"),
        (3, "92%"),
        (3, "45 ms"),
        (4, "61,568"),
        (4, "10 minutes"),
        (12, "2.0 ms"),
    ]


def test_a_number_no_results_file_holds_is_reported(tmp_path: Path) -> None:
    chapter = tmp_path / "stage3.md"
    chapter.write_text(PROSE)
    # 511.7 rounds to 512; 0.92 is 92%; 600 s are 10 minutes; 61568 with its separator
    sources = Sources([511.7, 1.55, 0.92, 45.2, 61568, 600, 2])
    assert unsourced_numbers([chapter], sources) == []
    sources = Sources([511.7, 1.55, 0.92, 61568, 600, 2])  # nobody measured the 45 ms
    assert unsourced_numbers([chapter], sources) == ["stage3.md:3: '45 ms' is in no results file"]
    chapter.write_text(PROSE.replace("512 req/s", "510 req/s"))  # rounded by hand: no longer the result
    assert unsourced_numbers([chapter], Sources([511.7, 1.55, 0.92, 45.2, 61568, 600, 2])) == [
        "stage3.md:3: '510 req/s' is in no results file"
    ]


def test_known_numbers_come_from_json_values_and_pages(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"rps": 511.7, "label": "64 texts", "ok": True}))
    (tmp_path / "a.md").write_text("| x | 1,234.5 |\n")
    assert sorted(evidence_check.known_numbers(tmp_path)) == [64.0, 511.7, 1234.5]


def test_every_number_in_the_chapters_comes_from_a_results_file() -> None:
    problems = unsourced_numbers(evidence_check.chapters(), Sources(evidence_check.known_numbers()))
    assert not problems, (
        "quote results through snippets, or mark a figure from elsewhere with <!-- quoted -->:\n"
        + "\n".join(problems)
    )


# --- the pipeline ------------------------------------------------------------------------
def test_make_results_lists_every_step_in_order() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.results", "--list"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    names = [line.split()[0] for line in done.stdout.splitlines()]
    assert names == [s.name for s in results.STEPS]
    assert names.index("stage0") < names.index("stage3") < names.index("compare")
    assert names.index("compare") < names.index("soak") < names.index("settings")
    # every page the docs include, and every file generated from the code, has a step that writes it
    generated = {name for s in results.STEPS if not s.stamped for name in s.writes} | {"pipeline.md"}
    assert generated == set(results.FROM_CODE)


def test_the_timing_table_is_every_step_with_its_estimate_and_its_last_run() -> None:
    """pipeline.md is rebuilt from the steps and the stamps: a step added, an estimate changed or a
    file re-recorded without it fails here (`python -m benchmarks.results --list --record`)."""
    page = (evidence.RESULTS / "pipeline.md").read_text()
    assert page == results.markdown(), "run `python -m benchmarks.results --list --record` and commit"
    compare = next(s for s in results.STEPS if s.name == "compare")
    wall_s = json.loads((evidence.RESULTS / "compare.json").read_text())["stamp"]["wall_s"]
    row = next(line for line in page.splitlines() if line.startswith("| compare "))
    assert results._minutes(compare.minutes * 60) in row and row.rstrip(" |").endswith(
        results._minutes(wall_s)
    )


def test_make_results_quick_runs_the_pipeline_into_out(tmp_path: Path) -> None:
    """The pipeline's machinery on its two fastest steps: progress lines, the total, out/ not docs/."""
    before = {p: p.stat().st_mtime for p in evidence.RESULTS.glob("*")}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.results", "--quick", "--only", "settings,metrics"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "2 steps, QUICK" in lines[1] and "into out/results/ and out/img/" in lines[1]
    assert any(line.startswith("[1/2] settings: done in") for line in lines)
    assert any(line.startswith("[2/2] metrics: done in") for line in lines)
    assert "2 of 2 steps done in" in lines[-1]  # and no pipeline.md: not a recording run
    assert (evidence.OUT / "results" / "settings.md").is_file()
    assert (evidence.OUT / "results" / "stage5_metrics.md").is_file()
    assert {p: p.stat().st_mtime for p in evidence.RESULTS.glob("*")} == before  # docs/ untouched


def test_a_failed_step_does_not_stop_the_others(capsys: pytest.CaptureFixture[str]) -> None:
    broken = results.Step("broken", "fails", "benchmarks.no_such_module", ("x.md",), 0, 0, stamped=False)
    settings = next(s for s in results.STEPS if s.name == "settings")
    assert (
        results.pipeline([broken, settings], evidence.Run("benchmarks.results", ["--quick"], quick=True)) == 1
    )
    out = capsys.readouterr().out
    assert "[1/2] broken: FAILED" in out and "[2/2] settings: done" in out and "1 of 2 steps done" in out
    assert "run them again with --only broken" in out
    with pytest.raises(SystemExit, match="unknown step"):
        results.select("stage3,nope", None)
    from_soak = ["soak", "beyond", "image", "settings", "metrics"]
    assert [s.name for s in results.select(None, "soak")] == from_soak
