"""Processes the fault tests, the soak run and the reliability report start and kill.

* ``redis_server``: a private redis-server. The shared Redis on 6379 must never be
  stopped, so anything that kills, restarts or password-protects Redis starts its own on
  a free port, with persistence off.
* ``stage_process``: a server stage started with the command ``make stageN`` runs, on a
  free port, that can be sent SIGTERM or SIGKILL and started again.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


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


@dataclass
class StageProcess:
    """A server stage run as ``make stageN`` runs it, on its own port, that can be killed and restarted."""

    stage: str
    env: dict[str, str]
    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, ready_timeout: float = 120.0) -> float:
        """Start and wait for ``/ready``; returns the seconds it took."""
        started = time.monotonic()
        env = {**os.environ, **self.env, "HOST": "127.0.0.1", "PORT": str(self.port)}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "common.serve", self.stage],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        while time.monotonic() - started < ready_timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.stage} exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1.0).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.stage} not ready after {ready_timeout} s:\n{self.log()}")

    def signal(self, sig: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@contextmanager
def stage_process(stage: str, log_dir: Path, env: dict[str, str] | None = None) -> Iterator[StageProcess]:
    """A started stage, stopped (SIGTERM, then SIGKILL) on exit."""
    server = StageProcess(stage, env or {}, log_dir / f"{stage}-{os.getpid()}-{free_port()}.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()
