"""A real Prometheus server for the tests (Debian's package: `make tools`), on a spare port."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from loadtests.procs import free_port


@contextmanager
def running_prometheus(config: Path, timeout: float = 60) -> Iterator[str]:
    """Prometheus with ``config`` (its checks with promtool first), its data and log beside the file;
    yields the query API's URL, ``http://127.0.0.1:<port>/api/v1/query``, once ``/-/ready`` says 200.

    A Prometheus that is still starting answers ``Service Unavailable`` in plain text, so nothing
    but a 200 from the readiness endpoint counts as up."""
    prometheus = shutil.which("prometheus")
    assert prometheus is not None, "prometheus is not installed: `make tools` (Debian's package)"
    check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    args = [
        prometheus,
        f"--config.file={config}",
        f"--storage.tsdb.path={config.parent / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with (config.parent / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while not _ready(f"http://127.0.0.1:{port}/-/ready"):
            log = prometheus_log(config)
            assert process.poll() is None, f"prometheus exited with {process.returncode}\n{log}"
            assert time.monotonic() < deadline, f"prometheus not ready in {timeout} s\n{log}"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/api/v1/query"
    finally:
        process.terminate()
        process.wait(timeout=30)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def query(api: str, expr: str) -> list[dict[str, Any]]:
    """The result of an instant query; empty while Prometheus cannot answer yet (any answer that is
    not a JSON success counts as 'not yet', never as an error of the test)."""
    try:
        answer = httpx.get(api, params={"query": expr}, timeout=10).json()
    except (httpx.TransportError, ValueError):
        return []
    return answer.get("data", {}).get("result", []) if answer.get("status") == "success" else []


def prometheus_log(config: Path) -> str:
    """The last lines Prometheus wrote, for a failure's message."""
    return (config.parent / "prometheus.log").read_text()[-2000:]
