"""Real Redis servers for the tests: the shared one at 127.0.0.1:6379 when it answers, else our own.

A test that stops, pauses or restarts Redis always gets a private ``redis-server`` on a free
port (never the shared one). When neither is possible the fixtures *fail*: a cache test that
skips itself would pass in CI without testing anything. The processes come from the measuring
kit (``loadtests.procs``); this module only turns "cannot start" into a test failure.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from loadtests.procs import RedisProcess
from loadtests.procs import redis_answers as answers

SHARED_URL = "redis://127.0.0.1:6379/0"  # the Redis these machines (and CI) run
__all__ = ["SHARED_URL", "RedisServer", "answers", "any_redis", "own_redis"]


class RedisServer(RedisProcess):
    """The kit's private redis-server, and what only the tests do to it: a hung Redis."""

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)


@contextmanager
def own_redis(workdir: Path, password: str | None = None, tls: bool = False) -> Iterator[RedisServer]:
    """A redis-server of the test's own on a free port: ``stop``, ``start``, ``pause``, ``resume``;
    with ``tls``, over TLS only (``rediss://``; its CA in ``ca_file``)."""
    server = RedisServer(password=password, workdir=workdir, tls=tls)
    try:
        server.start()
    except RuntimeError as exc:
        pytest.fail(f"own redis-server did not start ({exc}): Redis tests cannot run")
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def any_redis(workdir: Path) -> Iterator[str]:
    """The shared Redis when it answers, else a private one; fails when neither is possible."""
    if answers(SHARED_URL):
        yield SHARED_URL
        return
    with own_redis(workdir) as server:
        yield server.url
