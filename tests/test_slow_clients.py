"""Slow clients against a real server: a body that trickles in gets 408 at BODY_TIMEOUT_S,
headers that trickle in hold only their own connection, and ordinary requests keep their 200s.

Stage 1 (the model on the event loop) and stage 5 (the finished server); ``BodyGuard`` is the
same code in every stage (``common/limits.py``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from conftest import run_server

from benchmarks.reliability.slowclients import BODY, run

BODY_TIMEOUT_S = 2.0


@pytest.mark.parametrize("stage", ["stage1_naive", "stage5_metrics"])
def test_slow_clients(stage: str, tmp_path: Path) -> None:
    with run_server(stage, tmp_path, {"BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)}) as server:
        # A body that arrives slowly but within the deadline is answered normally.
        on_time = asyncio.run(run(server.url, slow_bodies=4, slow_headers=0, interval=0.01, ordinary=4))
        assert len(BODY) * 0.01 < BODY_TIMEOUT_S / 2
        assert on_time.body_statuses == {"200": 4}

        result = asyncio.run(run(server.url, slow_bodies=60, slow_headers=60, interval=0.25, ordinary=20))
        # Every trickled body: 408 in the OpenAI error shape, never before the deadline.
        assert result.body_statuses == {"408": 60}, result
        assert result.body_error_shape_ok
        assert min(result.body_answer_s) >= BODY_TIMEOUT_S
        # Meanwhile every ordinary request was answered.
        assert result.ordinary_ok == result.ordinary == 20, result
        assert httpx.get(f"{server.url}/health").status_code == 200
        # uvicorn has no header deadline: those connections stayed open, and cost only themselves.
        assert result.headers_still_open == 60
        assert "Traceback" not in server.log()
