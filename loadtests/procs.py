"""A private redis-server for the fault tests and the soak run.

The shared Redis on 6379 must never be stopped, so anything that kills, restarts or
password-protects Redis starts its own on a free port, with persistence off.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisProcess:
    """One redis-server on ``port``; ``stop()`` and ``start()`` may be called again and again."""

    port: int
    password: str | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited with {self.process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start in {timeout} s")

    def stop(self, kill: bool = True) -> None:
        """SIGKILL (a crash) by default; ``kill=False`` sends SIGTERM."""
        if self.process is None or self.process.poll() is not None:
            return
        if kill:
            self.process.kill()
        else:
            self.process.terminate()
        self.process.wait(timeout=10)


@contextmanager
def redis_server(password: str | None = None) -> Iterator[RedisProcess]:
    """A private redis-server on a free port, stopped on exit."""
    redis = RedisProcess(free_port(), password)
    redis.start()
    try:
        yield redis
    finally:
        redis.stop()
