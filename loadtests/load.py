"""How the kit loads a server: Locust or ``wrk`` where throughput counts, httpx where each answer matters.

``locust`` runs the repository's Locust file headless (its ``BodiesUser``, a ``FastHttpUser``) and
``wrk``, the C load generator, the same load: closed loop, the given bodies sent in turn, one a
request. Both answer with the same figures, the load generator's own CPU (``load_generator_cpu``,
in cores) among them, so a comparison can name its tool and what the tool cost: ``make compare``
runs Locust and, on two loads, wrk beside it. ``post_bodies`` sends through httpx from a few
clients and keeps each answer's status, time and headers (``x-cache``, ``x-batch-size``), for the
experiments that read them. ``settle`` waits between points until the server is idle again.

On a 2-core machine the load generator shares the cores with the server; ``wrk`` (one thread,
epoll, C) costs a fraction of what a Python client does, so the experiments that look for a
server's own ceiling use it. Each connection sends its next request the moment an answer arrives,
200 or 503 alike (what a naive client or a load test does), or, with ``honour_retry_after``, waits
a refusal's Retry-After (what a polite one does).

wrk's bodies come from a file, one JSON body per line, cycled through by a small Lua script;
Locust reads the same file. ``make tools`` installs Debian's wrk when it is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil

from common import corpus
from loadtests.procs import answers, wait_until

SCRIPT = """
local bodies, i = {}, 0
for line in io.lines(os.getenv("WRK_BODIES")) do bodies[#bodies + 1] = line end
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
  i = i + 1
  return wrk.format(nil, os.getenv("WRK_PATH"), nil, bodies[(i % #bodies) + 1])
end
"""
# With ``honour_retry_after``: every 503 or 429 makes the next connection that is ready to send
# wait its Retry-After first. wrk calls ``delay`` when a connection may send again, not beside the
# answer, so the wait can land on another connection than the refused one; for identical clients
# in a closed loop the load is the same: one pause of Retry-After seconds for each refusal.
POLITE = """
local waits = {}
response = function(status, headers)
  if status == 503 or status == 429 then
    local after = headers["retry-after"] or headers["Retry-After"] or "1"
    waits[#waits + 1] = tonumber(after) * 1000
  end
end
delay = function()
  if #waits == 0 then return 0 end
  return table.remove(waits, 1)
end
"""
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def available() -> bool:
    return shutil.which("wrk") is not None


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(value) * _UNITS[unit]


def wrk(
    url: str,
    bodies: Sequence[bytes],
    connections: int,
    seconds: float,
    path: str = "/v1/embed",
    honour_retry_after: bool = False,
    pid: int | None = None,
) -> dict[str, Any]:
    """Requests/s, the share that was not 2xx, and latency percentiles (of every answer).

    ``seconds`` is rounded up to whole seconds (what wrk takes); ``honour_retry_after``: a refusal
    pauses a connection for its Retry-After (``POLITE``), as a polite client does; ``pid``: the
    server's CPU seconds over the run too (``server_cpu_s``)."""
    seconds = max(1, math.ceil(seconds))
    if not available():
        raise SystemExit("wrk is missing: `make tools` installs Debian's package")
    server = psutil.Process(pid) if pid else None
    with tempfile.TemporaryDirectory() as tmp:
        file, script = Path(tmp) / "bodies.jsonl", Path(tmp) / "bodies.lua"
        file.write_bytes(b"\n".join(bodies))
        script.write_text(SCRIPT + (POLITE if honour_retry_after else ""))
        before, server_before = _children_cpu(), process_cpu(server) if server else 0.0
        done = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script), url],
            capture_output=True,
            text=True,
            check=True,
            env={"WRK_BODIES": str(file), "WRK_PATH": path, "PATH": "/usr/bin:/bin"},
        )
        used, server_used = _children_cpu() - before, process_cpu(server) - server_before if server else None
    return {**parse(done.stdout, connections, seconds), "window_s": seconds,
            "load_generator_cpu": round(used / seconds, 3), "server_cpu_s": server_used}  # fmt: skip


def _children_cpu() -> float:
    """CPU seconds of this process's children that have exited (wrk, once it is done)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bodies_for(kind: str, n: int, seed: int) -> list[bytes]:
    """``n`` one-text request bodies of ``common.corpus`` texts of ``kind``, from ``seed``."""
    return [orjson.dumps({"inputs": [t]}) for t in corpus.texts(n, seed=seed, kind=kind)]


LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def locust_command(url: str, users: int, seconds: str, report: Path, pid: int | None) -> list[str]:
    """Locust headless on the Locust file: ``users`` started at once, counted from the moment all of
    them run (``--reset-stats``), the requests in flight at the end still counted; its run report."""
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url,
        "-u", str(users), "-r", str(users), "-t", seconds, "--reset-stats", "--stop-timeout", "10",
        "--only-summary", "--loglevel", "WARNING", "--exit-code-on-error", "0", "--run-report", str(report),
        "--server-pid", str(pid or 0),
    ]  # fmt: skip


# --8<-- [start:locust]
def locust(
    url: str, bodies: Sequence[bytes], connections: int, seconds: float, pid: int | None = None
) -> dict[str, Any]:
    """What ``wrk`` answers, measured by Locust: ``connections`` users of the Locust file's
    ``BodiesUser`` POSTing ``bodies`` in turn to /v1/embed, counted from the moment all of them run,
    for about ``seconds`` (``--reset-stats``); the requests in flight at the end still count."""
    with tempfile.TemporaryDirectory() as tmp:
        file, report = Path(tmp) / "bodies.jsonl", Path(tmp) / "report.json"
        file.write_bytes(b"\n".join(bodies))
        env = {**os.environ, "EMBEDSERVE_BODIES": str(file)}
        command = locust_command(url, connections, f"{math.ceil(seconds + 0.5)}s", report, pid)
        done = subprocess.run([*command, "BodiesUser"], env=env, capture_output=True, text=True)
        if done.returncode != 0 or not report.exists():
            raise RuntimeError(f"Locust failed ({done.returncode}): {done.stderr[-2000:]}")
        got = json.loads(report.read_text())
    # --8<-- [end:locust]
    wall, refused = got["wall_s"], sum(n for e, n in got["errors"].items() if e.startswith("HTTP "))
    return {
        "connections": connections,
        "requests_per_s": round((got["requests"] - got["failures"]) / wall, 1),
        "non_2xx_per_s": round(refused / wall, 1),
        "socket_errors": got["failures"] - refused,
        "p50_ms": got["percentiles_ms"]["0.5"],
        "p99_ms": got["percentiles_ms"]["0.99"],
        "window_s": round(wall, 3),
        "load_generator_cpu": round(got["cores"], 3),
        "server_cpu_s": None if got["server_cores"] is None else got["server_cores"] * wall,
    }


LOAD_GENERATORS = {"locust": locust, "wrk": wrk}


def parse(out: str, connections: int, seconds: float) -> dict[str, Any]:
    """wrk's report as figures: requests/s (2xx), the rest per second, socket errors, p50 and p99.

    wrk's socket errors include its "timeout" count: requests still unanswered after its 2 s
    timeout when it checks; an answer that comes later still counts as an answer, but its latency
    is left out of the percentiles."""
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    other = int(m.group(1)) if (m := re.search(r"Non-2xx or 3xx responses: (\d+)", out)) else 0
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    # wrk pads a one-letter unit ("1.02s ") to line up with the two-letter ones
    latency = {q: _ms(v) for q, v in re.findall(r"^\s+(50|90|99)%\s+(\S+)\s*$", out, re.M)}
    return {
        "connections": connections,
        "requests_per_s": round((total - other) / seconds, 1),
        "non_2xx_per_s": round(other / seconds, 1),
        "socket_errors": errors,
        "p50_ms": latency.get("50"),
        "p99_ms": latency.get("99"),
    }


# --- httpx: every answer's status, time and headers ----------------------------------------
@dataclass
class Answer:
    status: int  # 0: no answer (refused, reset, timed out)
    ms: float
    headers: dict[str, str]


async def post_bodies(
    url: str,
    bodies: Sequence[bytes],
    clients: int,
    *,
    seconds: float | None = None,
    keep_alive: bool = True,
    headers: Mapping[str, str] | None = None,
    path: str = "/v1/embed",
) -> list[Answer]:
    """``clients`` closed-loop clients POSTing ``bodies`` to ``path``: each body once, or round and
    round for ``seconds``. ``keep_alive=False``: a new connection per request."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients if keep_alive else 0)
    until = time.perf_counter() + seconds if seconds is not None else None
    todo = itertools.cycle(bodies) if until is not None else iter(bodies)  # shared by the clients
    got: list[Answer] = []
    sent = {"content-type": "application/json", **(headers or {})}
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300, headers=sent) as client:

        async def one_client() -> None:
            for body in todo:
                if until is not None and time.perf_counter() >= until:
                    return
                started = time.perf_counter()
                try:
                    r = await client.post(path, content=body)
                    status, answer_headers = r.status_code, dict(r.headers)
                except httpx.HTTPError:
                    status, answer_headers = 0, {}
                got.append(Answer(status, (time.perf_counter() - started) * 1e3, answer_headers))

        await asyncio.gather(*(one_client() for _ in range(clients)))
    return got


# --- between points ----------------------------------------------------------------------
def process_cpu(process: psutil.Process) -> float:
    """CPU seconds of a process and its children."""
    total = 0.0
    with contextlib.suppress(psutil.NoSuchProcess):
        for p in [process, *process.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                total += t.user + t.system
    return total


def settle(pid: int, url: str, idle_cores: float = 0.15, max_s: float = 60.0) -> float:
    """Wait until the server answers /health and is idle: the previous point's backlog is gone.
    Returns the seconds it took (``max_s`` at most: a server still busy then is measured anyway)."""
    process = psutil.Process(pid)

    def idle() -> bool:
        before = process_cpu(process)
        time.sleep(0.5)  # the window the server's CPU is read over
        return (process_cpu(process) - before) / 0.5 < idle_cores and answers(f"{url}/health", timeout=2.0)

    start = time.monotonic()
    with contextlib.suppress(TimeoutError):
        wait_until(idle, max_s, every=0)
    return time.monotonic() - start
