"""Faults injected under load, against the stages that have a cache and a drain (4 and 5).

The scenarios live in ``loadtests/faults.py`` (the reliability report runs the same ones).
Every Redis here is a private redis-server on a spare port; the shared one is never touched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SERVER_STAGES

from benchmarks.reliability import faults, reliability

STAGES = [s for s in SERVER_STAGES if s in ("stage4_cache_backpressure", "stage5_metrics")]


def test_the_fault_stages_exist() -> None:
    assert STAGES == ["stage4_cache_backpressure", "stage5_metrics"]


@pytest.mark.parametrize("stage", STAGES)
def test_redis_killed_and_restarted_under_load(stage: str, tmp_path: Path) -> None:
    result = faults.redis_restart(stage, tmp_path, phase_s=2.0)
    assert result["failed"] == 0, result
    assert result["during_outage"] > 0, "no request was sent while Redis was down"
    assert result["redis_errors"] > 0, "the outage was not noticed: was Redis in the path at all?"
    assert result["redis_hits_after_restart"] > 0, "Redis never served again after its restart"


@pytest.mark.parametrize("stage", STAGES)
def test_sigterm_loses_no_admitted_request(stage: str, tmp_path: Path) -> None:
    result = faults.sigterm_drain(stage, tmp_path, burst=8, texts_per_request=12)
    assert result["admitted_before_sigterm"] >= 8
    assert result["lost"] == 0, result
    assert result["answered_200"] == 8
    # After the signal: served in the moment before the listener closes, then refused at the door;
    # never cut off, never a 500.
    assert set(result["after_sigterm"]) <= {"200", "refused", "reset", "503"}, result
    assert result["exit_code"] in (0, -15), result  # uvicorn re-raises SIGTERM after a clean drain
    assert not result["traceback_in_log"]


def test_sigterm_drain_survives_redis_dying_mid_drain(tmp_path: Path) -> None:
    """Two faults at once: SIGTERM with requests admitted, then Redis SIGKILLed while the drain
    writes their answers to it. The writes fail open; every admitted request still gets its 200."""
    result = faults.sigterm_drain("stage5_metrics", tmp_path, burst=8, texts_per_request=12, redis_dies=True)
    assert result["redis_killed_during_drain"] and result["redis_failure_logged"], result
    assert result["admitted_before_sigterm"] >= 8
    assert result["lost"] == 0, result
    assert set(result["after_sigterm"]) <= {"200", "refused", "reset", "503"}, result
    assert result["exit_code"] in (0, -15), result
    assert not result["traceback_in_log"]


@pytest.mark.parametrize("stage", STAGES)
def test_sigkill_and_restart_comes_back_warm(stage: str, tmp_path: Path) -> None:
    result = faults.sigkill_restart(stage, tmp_path, with_redis=True)
    assert result["requests_during_kill"] > 0
    assert result["cache_before"] == "miss"
    assert result["keys_in_redis_before_kill"] >= result["texts"]
    assert result["cache_after_restart"] == "hit", result  # the memory tier died; Redis did not
    assert result["cache_hits_after_restart"] == result["texts"]
    assert result["same_vectors"]


def test_sigkill_and_restart_without_redis_comes_back_cold(tmp_path: Path) -> None:
    result = faults.sigkill_restart(STAGES[-1], tmp_path, with_redis=False)
    assert result["cache_after_restart"] == "miss"  # nothing survived the process, as expected
    assert result["same_vectors"]


def test_the_reliability_tables_in_the_docs_match_their_json() -> None:
    results = Path(__file__).resolve().parent.parent / "docs" / "results"
    report = json.loads((results / "reliability.json").read_text())
    assert (results / "reliability.md").read_text() == reliability.markdown(report), (
        "rerun `make results ONLY=reliability`"
    )
    summary = report["summary"]
    assert summary["server_errors"] == summary["unexpected_answers"] == summary["requests_lost"] == 0
    assert summary["stages"] == SERVER_STAGES  # a stage added later needs a fresh report
