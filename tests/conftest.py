"""Shared fixtures: the real engine, and real server processes on real sockets."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.engine import Engine
from common.serve import available_stages
from common.settings import Settings
from loadtests.procs import free_port, running_stage

__all__ = ["REPO", "SERVER_STAGES", "Server", "free_port", "run_server"]

REPO = Path(__file__).resolve().parent.parent
# STAGES=stage2_threadpool,stage3_batching narrows the per-stage suites (a targeted run, or a
# stage that is half-written in your checkout); unset, every stage that exists is tested.
SERVER_STAGES = os.environ["STAGES"].split(",") if os.environ.get("STAGES") else available_stages()


@pytest.fixture(scope="session")
def settings() -> Settings:
    return Settings()


@pytest.fixture(scope="session")
def engine(settings: Settings) -> Engine:
    """The real INT8 engine, as the servers load it."""
    return Engine.from_settings(settings)


@pytest.fixture(scope="session")
def fp32_engine(settings: Settings) -> Engine:
    return Engine(settings.model_dir, variant="fp32")


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def run_server(
    stage: str, tmp_path: Path, env: dict[str, str] | None = None, ready_timeout: float = 120.0
) -> Iterator[Server]:
    """Start a stage with the command `make stageN` runs, wait for /ready, stop it after."""
    with running_stage(stage, tmp_path, env, ready_timeout=ready_timeout) as server:
        assert server.process is not None
        yield Server(server.url, server.process, server.log_path)


@pytest.fixture
def server_factory(tmp_path: Path):  # type: ignore[no-untyped-def]
    """``with server_factory("stage3_batching", {"MAX_BATCH_SIZE": "8"}) as srv: ...``"""

    def factory(stage: str, env: dict[str, str] | None = None) -> contextmanager[Server]:  # type: ignore[valid-type]
        return run_server(stage, tmp_path, env)

    return factory


@pytest.fixture(scope="session")
def stage_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Server]]:
    """``stage_server("stage2_threadpool")``: that stage with default settings, started on first
    use and shared by every test of the session (the contract, client and equivalence suites)."""
    running: dict[str, Server] = {}
    with ExitStack() as stack:

        def get(stage: str) -> Server:
            server = running.get(stage)
            if server is None or server.process.poll() is not None:
                server = stack.enter_context(run_server(stage, tmp_path_factory.mktemp(stage)))
                running[stage] = server
            return server

        yield get


@pytest.fixture
def observe(record_property: Callable[[str, object], None]) -> Callable[..., None]:
    """``observe(stage=..., lost=0)``: what a test saw, kept as JSON in its JUnit XML properties.
    ``python -m benchmarks.reliability`` runs the reliability tests and writes these as the docs' counts."""

    def record(**values: object) -> None:
        for name, value in values.items():
            record_property(name, json.dumps(value))

    return record


# --- Redis (stage 4 and later): real servers, never a mock ------------------------
@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """The shared Redis at 127.0.0.1:6379 when it answers, else a private redis-server (fails if neither)."""
    from redis_support import any_redis

    with any_redis(tmp_path) as url:
        yield url


@pytest.fixture
def private_redis(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A redis-server of this test's own on a free port, for tests that stop or pause it."""
    from redis_support import own_redis

    with own_redis(tmp_path) as server:
        yield server
