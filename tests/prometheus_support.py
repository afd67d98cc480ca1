"""A real Prometheus server for the tests (Debian's package: `make prometheus`), on a spare port."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loadtests.procs import free_port


@contextmanager
def running_prometheus(config: Path) -> Iterator[str]:
    """Prometheus with ``config`` (its checks with promtool first), its data and log beside the file;
    yields the query API's URL, ``http://127.0.0.1:<port>/api/v1/query``."""
    prometheus = shutil.which("prometheus")
    assert prometheus is not None, "prometheus is not installed: `make prometheus` (Debian's package)"
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
        yield f"http://127.0.0.1:{port}/api/v1/query"
    finally:
        process.terminate()
        process.wait(timeout=30)


def prometheus_log(config: Path) -> str:
    """The last lines Prometheus wrote, for a failure's message."""
    return (config.parent / "prometheus.log").read_text()[-2000:]
