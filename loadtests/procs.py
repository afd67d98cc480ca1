"""The processes a measurement or a test starts: a server stage, a private Redis, and free ports.

* ``running_stage``: a server stage started with the command ``make stageN`` runs, on a free
  port, ready (``/ready`` answers 200) when the block starts and stopped when it ends; its
  ``StageProcess`` can be sent SIGTERM or SIGKILL and started again on the same port.
* ``redis_server``: a private redis-server with persistence off, plain or over TLS (a CA and a
  certificate made on the spot with ``trustme``). The shared Redis on 6379 must never be
  stopped, so anything that kills, pauses, password-protects or encrypts Redis starts its own.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
import tenacity

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port nothing listens on right now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers(url: str, timeout: float = 1.0) -> bool:
    """``GET url`` answers 200."""
    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(
    ready: Callable[[], bool], timeout: float, every: float, process: subprocess.Popen[bytes] | None = None
) -> float:
    """Poll ``ready`` every ``every`` seconds until it is true (tenacity); returns the seconds it took.
    Raises RuntimeError when ``process`` exits first, TimeoutError after ``timeout`` seconds."""

    def check() -> bool:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode}")
        return ready()

    started = time.monotonic()
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_delay(timeout),
        wait=tenacity.wait_fixed(every),
        retry=tenacity.retry_if_result(lambda ok: not ok),  # an exception is not retried: it stops
    )
    try:
        retrying(check)
    except tenacity.RetryError:
        raise TimeoutError(f"not ready in {timeout:.0f} s") from None
    return time.monotonic() - started


def wait_http(url: str, process: subprocess.Popen[bytes] | None = None, timeout: float = 180.0) -> float:
    """Wait until ``GET url`` answers 200; fail early if ``process`` exits. Returns the seconds waited."""
    try:
        return wait_until(lambda: answers(url), timeout, 0.1, process)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc} before {url} answered") from None
    except TimeoutError:
        raise RuntimeError(f"{url} did not answer in {timeout:.0f} s") from None


# --- a server stage ----------------------------------------------------------------------
def server_command(stage: str) -> list[str]:
    """Exactly what `make stageN` runs."""
    return [sys.executable, "-m", "common.serve", stage]


def _tree_path(tree: Path) -> dict[str, str]:
    """Another checkout's code first on the path (this one's is installed in the venv)."""
    return {} if tree == REPO else {"PYTHONPATH": str(tree)}


def server_env(
    host: str, port: int, extra: Mapping[str, str] | None = None, without: Sequence[str] = ()
) -> dict[str, str]:
    """This process's environment, less ``without``, plus HOST, PORT and ``extra``."""
    drop = {name.upper() for name in without}
    env = {k: v for k, v in os.environ.items() if k.upper() not in drop}
    return {**env, "HOST": host, "PORT": str(port), **(extra or {})}


@dataclass
class StageProcess:
    """A server stage run as ``make stageN`` runs it, on its own port; it can be killed and restarted."""

    stage: str
    env: dict[str, str]
    log_path: Path
    port: int = field(default_factory=free_port)
    host: str = "127.0.0.1"
    without: tuple[str, ...] = ()
    tree: Path = REPO  # the checkout the stage runs from (another commit's worktree: compare --against)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, ready_timeout: float = 180.0) -> float:
        """Start and wait for ``/ready``; returns the seconds it took. The log is appended to."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                server_command(self.stage),
                cwd=self.tree,
                env=server_env(self.host, self.port, {**self.env, **_tree_path(self.tree)}, self.without),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            return wait_http(f"{self.url}/ready", self.process, ready_timeout)
        except RuntimeError as exc:  # say why: the server's own output
            self.stop()
            raise RuntimeError(f"{self.stage}: {exc}\n{self.log()}") from None

    def signal(self, sig: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def stop(self, timeout: float = 40.0) -> None:
        """SIGTERM (a graceful drain), then SIGKILL after ``timeout``."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@contextmanager
def running_stage(
    stage: str,
    log_dir: Path,
    env: Mapping[str, str] | None = None,
    *,
    without: Sequence[str] = (),
    port: int | None = None,
    host: str = "127.0.0.1",
    ready_timeout: float = 180.0,
    tree: Path = REPO,
) -> Iterator[StageProcess]:
    """``stage`` started and ready, stopped (SIGTERM, then SIGKILL) on exit; its log in ``log_dir``.

    ``env`` adds to this process's environment; ``without`` names variables to leave out; ``tree``
    is the checkout whose code it runs (this one by default).
    """
    port = port or free_port()
    log = log_dir / f"{stage}-{port}.log"
    server = StageProcess(stage, dict(env or {}), log, port, host, tuple(without), tree)
    server.start(ready_timeout)
    try:
        yield server
    finally:
        server.stop()


# --- Redis -------------------------------------------------------------------------------
def redis_answers(url: str, ca_file: Path | None = None) -> bool:
    """A Redis at ``url`` answers PING (over TLS, ``rediss://``, trusting ``ca_file``)."""
    tls = {"ssl_ca_certs": str(ca_file)} if ca_file is not None else {}
    try:
        client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1, **tls)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


@dataclass
class RedisProcess:
    """One redis-server on ``port``: ``start``, ``stop`` (a SIGKILL: a crash), ``start`` again (same
    port, empty). The tests' own (tests/redis_support.py) can pause and resume it too."""

    port: int = field(default_factory=free_port)
    password: str | None = None
    workdir: Path | None = None
    tls: bool = False  # only TLS, on ``port``: the URL is rediss:// and clients need ``ca_file``
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}/0"

    @property
    def ca_file(self) -> Path | None:
        """The CA that signed this server's certificate (TLS only)."""
        return self._certs() / "ca.pem" if self.tls else None

    def _certs(self) -> Path:
        if self.workdir is None:
            raise RuntimeError("a TLS redis-server needs a workdir for its certificates")
        return self.workdir / "tls"

    def _tls_args(self) -> list[str]:
        """A CA and a certificate for 127.0.0.1 and localhost, made once per workdir (trustme)."""
        import trustme

        folder = self._certs()
        if not (folder / "ca.pem").is_file():
            folder.mkdir(parents=True, exist_ok=True)
            ca = trustme.CA()
            cert = ca.issue_cert("127.0.0.1", "localhost")
            cert.private_key_pem.write_to_path(str(folder / "key.pem"))
            cert.cert_chain_pems[0].write_to_path(str(folder / "cert.pem"))
            ca.cert_pem.write_to_path(str(folder / "ca.pem"))
        return ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no",
                "--tls-cert-file", str(folder / "cert.pem"), "--tls-key-file", str(folder / "key.pem"),
                "--tls-ca-cert-file", str(folder / "ca.pem")]  # fmt: skip

    def start(self, timeout: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        if self.workdir is not None:
            args += ["--dir", str(self.workdir)]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            args += self._tls_args()
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: redis_answers(self.url, self.ca_file), timeout, 0.05, self.process)
        except RuntimeError as exc:
            raise RuntimeError(f"redis-server on port {self.port}: {exc}") from None
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"redis-server on port {self.port} did not start in {timeout} s") from None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


@contextmanager
def redis_server(
    password: str | None = None, workdir: Path | None = None, tls: bool = False
) -> Iterator[RedisProcess]:
    """A private redis-server on a free port, killed on exit."""
    server = RedisProcess(password=password, workdir=workdir, tls=tls)
    server.start()
    try:
        yield server
    finally:
        server.stop()
