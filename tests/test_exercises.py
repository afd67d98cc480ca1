"""The exercises work both ways: each starting file fails its stage's own tests, each stage passes them.

``make exercise STAGE=N`` runs stage N's tests against ``exercises/`` (what a learner runs), and
``make exercise STAGE=N SOLUTION=1`` against the stage itself. Both are run here exactly so.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import REPO

EXERCISES = {2: "NotImplementedError"}  # stage -> what the untouched starting file fails with


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


@pytest.mark.parametrize("stage", sorted(EXERCISES))
def test_the_stage_itself_passes_the_same_tests(stage: int) -> None:
    result = _make_exercise(stage, "SOLUTION=1")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert " passed" in out and " failed" not in out, out[-3000:]


def test_an_unknown_stage_is_a_clear_error() -> None:
    result = _make_exercise(7)
    assert result.returncode != 0 and "exercises exist for stages" in result.stderr
