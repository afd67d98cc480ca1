"""A light closed-loop HTTP/1.1 load: N asyncio clients, one keep-alive connection each.

On 2 cores the load generator competes with the server for CPU, so it must be cheap: raw
asyncio streams, pre-built request bytes, no HTTP library. Used by ``benchmarks.stage2_overhead``
and ``benchmarks.stage2_threads``; its own CPU use is reported with every point.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any

import numpy as np
import psutil


def post_requests(path: str, bodies: list[bytes]) -> list[bytes]:
    """The full request bytes for each JSON body, built once, before the clock starts."""
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n".encode()
    return [b"%scontent-length: %d\r\n\r\n%s" % (head, len(b), b) for b in bodies]


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """Read one HTTP/1.1 response with a Content-Length: its status and headers (lower-case names)."""
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split(" ", 2)[1]), headers


async def _client(
    host: str, port: int, requests: list[bytes], start: int, until: float, out: list[float]
) -> int:
    reader, writer = await asyncio.open_connection(host, port)
    errors, i = 0, start
    try:
        while time.perf_counter() < until:
            request = requests[i % len(requests)]
            i += 1
            sent = time.perf_counter()
            writer.write(request)
            status, _ = await read_response(reader)
            if status == 200:
                out.append((time.perf_counter() - sent) * 1e3)
            else:
                errors += 1
    finally:
        writer.close()
    return errors


async def _probe(host: str, port: int, path: str, until: float, out: list[float]) -> None:
    """GET ``path`` every 50 ms on a connection of its own: how long a health check waits."""
    reader, writer = await asyncio.open_connection(host, port)
    request = f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode()
    try:
        while time.perf_counter() < until:
            sent = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            out.append((time.perf_counter() - sent) * 1e3)
            await asyncio.sleep(0.05)
    finally:
        writer.close()


async def _drive(
    host: str, port: int, requests: list[bytes], clients: int, seconds: float, probe: str | None = None
) -> tuple[list[float], int, list[float]]:
    until = time.perf_counter() + seconds
    latencies: list[float] = []
    probed: list[float] = []
    step = max(1, len(requests) // clients)
    jobs: list[Coroutine[Any, Any, int | None]] = [
        _client(host, port, requests, i * step, until, latencies) for i in range(clients)
    ]
    if probe is not None:
        jobs.append(_probe(host, port, probe, until, probed))
    results = await asyncio.gather(*jobs)
    return latencies, sum(r for r in results if r is not None), probed


def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if values else None


def run_load(
    host: str,
    port: int,
    requests: list[bytes],
    clients: int,
    seconds: float,
    warmup: float = 1.0,
    probe: str | None = None,
) -> dict[str, Any]:
    """Requests/s, latency percentiles and the client's own CPU for ``clients`` over ``seconds``.

    With ``probe="/health"`` a separate connection also GETs that path every 50 ms
    during the run, and its latencies are reported as ``probe_*_ms``.
    """
    if warmup > 0:
        asyncio.run(_drive(host, port, requests[::-1], clients, warmup))
    me = psutil.Process()
    cpu = sum(me.cpu_times()[:2])
    latencies, errors, probed = asyncio.run(_drive(host, port, requests, clients, seconds, probe))
    result: dict[str, Any] = {
        "clients": clients,
        "requests_per_s": round(len(latencies) / seconds, 1),
        "p50_ms": _ms(latencies, 50),
        "p99_ms": _ms(latencies, 99),
        "errors": errors,
        "client_cpu_cores": round((sum(me.cpu_times()[:2]) - cpu) / seconds, 2),
    }
    if probe is not None:
        result.update(
            {
                "probe": probe,
                "probe_n": len(probed),
                "probe_p50_ms": _ms(probed, 50),
                "probe_p99_ms": _ms(probed, 99),
                "probe_max_ms": round(max(probed), 2) if probed else None,
            }
        )
    return result


class Connections:
    """Keep-alive HTTP/1.1 connections for an *open-loop* load: a request takes an idle
    connection or opens one, and gives it back when its answer is read.

    httpx manages a pool of hundreds of connections in Python on every request; when a
    server falls behind and hundreds of requests are in flight, that bookkeeping can take a
    whole core from the machine the server runs on, and the load generator becomes the thing
    being measured. This costs one deque operation per request. Connections idle longer than
    ``max_idle_s`` are dropped (uvicorn closes them after 5 s, and a request sent at that moment
    would fail for the client's reasons, not the server's).
    """

    def __init__(self, host: str, port: int, max_idle_s: float = 2.0) -> None:
        self.host, self.port, self.max_idle_s = host, port, max_idle_s
        self._idle: deque[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = deque()

    async def post(self, path: str, body: bytes, timeout: float = 60.0) -> tuple[int, dict[str, str]]:
        """Send one POST; return the status and the response headers (names in lower case)."""
        reader, writer = await self._take()
        try:
            writer.write(post_requests(path, [body])[0])
            async with asyncio.timeout(timeout):
                status, headers = await read_response(reader)
        except BaseException:
            writer.close()
            raise
        if headers.get("connection", "").lower() == "close":
            writer.close()
        else:
            self._idle.append((reader, writer, time.monotonic()))
        return status, headers

    async def _take(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        now = time.monotonic()
        while self._idle:
            reader, writer, since = self._idle.pop()  # the most recently used: least likely stale
            if now - since < self.max_idle_s and not reader.at_eof():
                return reader, writer
            writer.close()
        return await asyncio.open_connection(self.host, self.port)

    def close(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()
