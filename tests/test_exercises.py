"""The exercises work both ways: each starting file fails its stage's own tests, each stage passes them.

``make exercise STAGE=N`` runs stage N's tests against ``exercises/`` (what a learner runs), and
``make exercise STAGE=N SOLUTION=1`` against the stage itself. Both are run here exactly so. A
starting file also keeps the interface of the stage's class it stands for, so a change to the
stage that the exercise misses fails here, not in a learner's hands.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess

import pytest
from conftest import REPO
from markdown.extensions.toc import slugify

EXERCISES = {  # stage -> what the untouched starting file fails with
    0: "NotImplementedError",
    1: "NotImplementedError",
    2: "NotImplementedError",
    3: "NotImplementedError",
    4: "NotImplementedError",
    5: "NotImplementedError",
}
# (module, name): each class or function a learner writes, in the stage's <module> and in
# exercises/<module> (stage 0's engine, which lives in common/, in exercises/stage0_script/engine.py)
PIECES = [
    ("common.engine", "Engine"),
    ("common.engine", "l2_normalize"),
    ("stage1_naive.backend", "NaiveBackend"),
    ("stage2_threadpool.backend", "ThreadPoolBackend"),
    ("stage3_batching.batcher", "Batcher"),
    ("stage3_batching.batcher", "Oldest"),
    ("stage4_cache_backpressure.cache", "MemoryCache"),
    ("stage4_cache_backpressure.singleflight", "SingleFlight"),
    ("stage4_cache_backpressure.admission", "Admission"),
    ("stage5_metrics.backend", "MetricsBackend"),
]
# else exercises.<module>; a stage's backend is written in the exercise's app.py, a server of its own
EXERCISE_MODULE = {
    "common.engine": "exercises.stage0_script.engine",
    "stage1_naive.backend": "exercises.stage1_naive.app",
    "stage2_threadpool.backend": "exercises.stage2_threadpool.app",
    "stage5_metrics.backend": "exercises.stage5_metrics.app",
}


def _make_exercise(stage: int, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("STAGES", "EXERCISE", "MAKEFLAGS", "MFLAGS")}
    return subprocess.run(
        ["make", "--no-print-directory", "exercise", f"STAGE={stage}", *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.parametrize("stage", sorted(EXERCISES))
def test_the_starting_file_fails_its_stage_tests(stage: int) -> None:
    result = _make_exercise(stage)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert " failed" in out and EXERCISES[stage] in out, out[-3000:]  # failed on the TODO, not on setup
    assert "Timeout" not in out, out[-3000:]  # at once: a learner's first run does not hang


@pytest.mark.parametrize("stage", sorted(EXERCISES))
def test_the_stage_itself_passes_the_same_tests(stage: int) -> None:
    result = _make_exercise(stage, "SOLUTION=1")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert " passed" in out and " failed" not in out, out[-3000:]


def test_an_unknown_stage_is_a_clear_error() -> None:
    result = _make_exercise(7)
    assert result.returncode != 0 and "exercises exist for stages" in result.stderr


@pytest.mark.parametrize(("module", "name"), PIECES, ids=[f"{m}.{n}" for m, n in PIECES])
def test_a_starting_file_keeps_the_interface_of_the_stage(module: str, name: str) -> None:
    """Every method and property the stage's class defines (its hooks too), with the same signature;
    a function, with the same signature."""
    stage = getattr(importlib.import_module(module), name)
    yours = getattr(importlib.import_module(EXERCISE_MODULE.get(module, f"exercises.{module}")), name)
    if inspect.isfunction(stage):
        assert inspect.signature(yours) == inspect.signature(stage), f"{name}: {inspect.signature(yours)}"
        return
    for attr, value in vars(stage).items():
        if attr.startswith("__") and attr != "__init__":
            continue
        assert hasattr(yours, attr), f"exercises/{module}: {name}.{attr} is missing"
        if inspect.isfunction(value):
            want, got = inspect.signature(value), inspect.signature(getattr(yours, attr))
            assert got == want, f"exercises/{module}: {name}.{attr}{got}, the stage has {want}"


def test_every_chapter_section_a_starting_file_points_to_exists() -> None:
    """``docs/<page>.md#<section>`` in exercises/: the page exists and has that heading (the anchor
    mkdocs makes of it), so a renamed section fails here, not in a learner's hands."""
    pointers = {
        (page, anchor)
        for path in sorted((REPO / "exercises").rglob("*.py"))
        for page, anchor in re.findall(r"(docs/[\w/]+\.md)(?:#([\w-]+))?", path.read_text())
    }
    assert any(anchor for _page, anchor in pointers)
    for page, anchor in sorted(pointers):
        text = re.sub(r"^```.*?^```", "", (REPO / page).read_text(), flags=re.MULTILINE | re.DOTALL)
        headings = {slugify(h, "-") for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}
        assert not anchor or anchor in headings, f"exercises point to {page}#{anchor}: no such section"
