"""`make loadtest STAGE=N` (Locust's web UI) and `make loadtest HEADLESS=1 STAGE=N` (one fixed profile).

    python -m loadtests.run --stage 5                  # UI on http://127.0.0.1:8089
    python -m loadtests.run --stage 3 --headless       # unique-32 for 30 s, files in out/loadtest/

If a server already answers /ready on HOST:PORT it is used as it is; otherwise stage N is started
with the command `make stageN` runs, and stopped again when Locust exits.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from common.serve import resolve
from loadtests import evidence, harness
from loadtests.harness import PROFILES
from loadtests.procs import answers, running_stage

OUT = evidence.OUT / "loadtest"  # git-ignored


def _listening(port: int) -> int | None:
    """The pid of the process listening on ``port`` on this machine, when it can be seen."""
    with contextlib.suppress(psutil.AccessDenied):
        for conn in psutil.net_connections("tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return int(conn.pid)
    return None


@contextlib.contextmanager
def server_for(stage: str, host: str, port: int, out: Path) -> Iterator[int | None]:
    """The pid of a stage started here, or None when something already answers on host:port."""
    url = f"http://{host}:{port}"
    if answers(f"{url}/ready"):
        pid = _listening(port)
        print(f"using the server already answering on {url} (pid {pid or 'not visible'})", flush=True)
        yield pid  # its CPU is measured too, when this user can see its process
        return
    print(f"starting {stage} on {url} (log: {out / f'{stage}-{port}.log'})", flush=True)
    with running_stage(stage, out, port=port, host=host) as server:
        yield server.pid


def web_ui(url: str, web_host: str, web_port: int, extra: Sequence[str]) -> int:
    command = [
        sys.executable, "-m", "locust", "-f", str(harness.LOCUSTFILE), "--host", url,
        "--web-host", web_host, "--web-port", str(web_port), "--class-picker", *extra,
    ]  # fmt: skip
    print(f"Locust web UI: http://{web_host}:{web_port}  (Ctrl-C stops Locust and the server)", flush=True)
    locust = subprocess.Popen(command, cwd=harness.REPO)
    try:
        return locust.wait()
    finally:
        if locust.poll() is None:
            locust.terminate()
            locust.wait(timeout=20)


def headless(
    stage: str,
    url: str,
    profile_name: str,
    seconds: float,
    server_pid: int | None,
    out: Path,
    endpoint: str = "/v1/embed",
) -> dict[str, Any]:
    profile = next((p for p in PROFILES if p.name == profile_name), None)
    if profile is None:
        raise SystemExit(f"unknown profile {profile_name!r}; one of {[p.name for p in PROFILES]}")
    profile = replace(profile, options=(*profile.options, "--endpoint", endpoint))
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    prefix = out / f"{stage}-{profile.name}-{stamp}"
    harness.warm_up(url, min(5.0, seconds / 4))
    point = harness.run_point(stage, url, profile, seconds, prefix, seed=1, server_pid=server_pid)
    run = evidence.Run("loadtests.run", sys.argv[1:])
    run.commit, run.changed = evidence.git_state()
    summary = {"stamp": run.stamp(), "url": url, **point.as_dict()}
    evidence.write_json(Path(f"{prefix}_summary.json"), summary)
    # Locust's own *_stats.csv is a snapshot taken up to a second before the end; this row is final.
    row = {k: v for k, v in point.as_dict().items() if not isinstance(v, dict)}
    row.update({f"failures_{k}": v for k, v in point.failures.items()})
    with open(f"{prefix}_summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        writer.writeheader()
        writer.writerow(row)
    server = f"{point.server_cores:.2f}" if server_pid else "not measured (its process is not visible)"
    print(
        f"{stage} {profile.name}: {point.rps:.1f} req/s, p50 {point.p50_ms:.0f} ms,"
        f" p95 {point.p95_ms:.0f} ms, p99 {point.p99_ms:.0f} ms, failures {point.failures};"
        f" Locust used {point.loadgen_cores:.2f}"
        f" cores, the server {server}\nfiles: {prefix}_summary.json, {prefix}_summary.csv,"
        f" Locust's {prefix}.json and {prefix}_stats_history.csv",
        flush=True,
    )
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage", default="5", help="Stage to start when nothing answers (1-5).")
    parser.add_argument("--headless", action="store_true", help="One fixed profile, CSV/JSON out, no UI.")
    parser.add_argument("--profile", default="unique-32", help="Headless profile (see harness.PROFILES).")
    parser.add_argument("--duration", type=float, default=30.0, help="Headless seconds.")
    parser.add_argument("--endpoint", choices=("/v1/embed", "/v1/embeddings"), default="/v1/embed")
    parser.add_argument("--out", type=Path, default=OUT, help="Folder for results and the server log.")
    parser.add_argument("--web-host", default="127.0.0.1")
    parser.add_argument("--web-port", type=int, default=8089)
    args, extra = parser.parse_known_args(argv)  # anything else goes to Locust (UI mode)
    stage = resolve(args.stage)
    host, port = os.environ.get("HOST", "127.0.0.1"), int(os.environ.get("PORT", "8000"))
    # SIGTERM (from a test, or a process manager) unwinds like Ctrl-C: Locust and the server stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    with server_for(stage, host, port, args.out) as pid:
        url = f"http://{host}:{port}"
        if args.headless:
            headless(stage, url, args.profile, args.duration, pid, args.out, args.endpoint)
        else:
            with contextlib.suppress(KeyboardInterrupt):
                web_ui(url, args.web_host, args.web_port, extra)


if __name__ == "__main__":
    main()
