"""WORKERS: a stage as several uvicorn worker processes on one socket (the chapter "Beyond one machine").

Each worker imports the app and loads its own model; the supervisor only watches them. Started as a
reader starts it (``WORKERS=2 make stage5``), with a Redis tier, and answered over real sockets.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import psutil
from fresh import fresh_texts
from redis_support import any_redis

from loadtests.load import settle
from loadtests.procs import running_stage


def test_two_workers_each_load_the_model_and_answer_on_one_port(tmp_path: Path) -> None:
    with any_redis(tmp_path) as redis_url:
        env = {"WORKERS": "2", "LOG_LEVEL": "INFO", "CACHE_URL": redis_url}
        with running_stage("stage5_metrics", tmp_path, env) as server:
            settle(server.pid, server.url)
            kids = psutil.Process(server.pid).children()
            workers = [p for p in kids if "spawn_main" in " ".join(p.cmdline())]
            texts = fresh_texts(20)
            with httpx.Client(base_url=server.url, timeout=60) as client:
                answers = [client.post("/v1/embed", json={"inputs": [text]}) for text in texts]
            log = server.log()
    assert len(workers) == 2, [" ".join(p.cmdline()) for p in kids]
    assert [r.status_code for r in answers] == [200] * len(texts)
    assert log.count("ready: model") == 2, log[-3000:]  # each worker loaded its own
    assert "(2 worker processes)" in log
