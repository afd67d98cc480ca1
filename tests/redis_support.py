"""Real Redis servers for the tests: the shared one at 127.0.0.1:6379 when it answers, else our own.

A test that stops, pauses or restarts Redis always gets a private ``redis-server`` on a free
port (never the shared one). When neither is possible the fixtures *fail*: a cache test that
skips itself would pass in CI without testing anything.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

SHARED_URL = "redis://127.0.0.1:6379/0"


def answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A ``redis-server`` process of our own: start, stop (kill), pause (SIGSTOP), resume."""

    def __init__(self, workdir: Path, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not installed (apt-get install redis-server): Redis tests cannot run"
            )
        self.binary, self.workdir, self.port, self.password = binary, workdir, _free_port(), password
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--daemonize", "no", "--dir", str(self.workdir)]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not answers(self.url):
            if self.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"own redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def pause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)


@contextmanager
def own_redis(workdir: Path, password: str | None = None) -> Iterator[RedisServer]:
    server = RedisServer(workdir, password)
    server.start()
    try:
        yield server
    finally:
        if server.process is not None and server.process.poll() is None:
            server.resume()
        server.stop()


@contextmanager
def any_redis(workdir: Path) -> Iterator[str]:
    """The shared Redis when it answers, else a private one; fails when neither is possible."""
    if answers(SHARED_URL):
        yield SHARED_URL
        return
    with own_redis(workdir) as server:
        yield server.url
