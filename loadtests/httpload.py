"""A light closed-loop HTTP/1.1 load: N asyncio clients, one keep-alive connection each.

On 2 cores the load generator competes with the server for CPU, so it must be cheap: raw
asyncio streams, pre-built request bytes, no HTTP library. Used by ``loadtests.overhead``
and ``loadtests.threads_sweep``; its own CPU use is reported with every point.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import psutil


def post_requests(path: str, bodies: list[bytes]) -> list[bytes]:
    """The full request bytes for each JSON body, built once, before the clock starts."""
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n".encode()
    return [b"%scontent-length: %d\r\n\r\n%s" % (head, len(b), b) for b in bodies]


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
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            if head[9:12] == b"200":
                out.append((time.perf_counter() - sent) * 1e3)
            else:
                errors += 1
    finally:
        writer.close()
    return errors


async def _drive(
    host: str, port: int, requests: list[bytes], clients: int, seconds: float
) -> tuple[list[float], int]:
    until = time.perf_counter() + seconds
    latencies: list[float] = []
    step = max(1, len(requests) // clients)
    jobs = (_client(host, port, requests, i * step, until, latencies) for i in range(clients))
    errors = await asyncio.gather(*jobs)
    return latencies, sum(errors)


def run_load(
    host: str, port: int, requests: list[bytes], clients: int, seconds: float, warmup: float = 1.0
) -> dict[str, Any]:
    """Requests/s, latency percentiles and the client's own CPU for ``clients`` over ``seconds``."""
    if warmup > 0:
        asyncio.run(_drive(host, port, requests[::-1], clients, warmup))
    me = psutil.Process()
    cpu = sum(me.cpu_times()[:2])
    latencies, errors = asyncio.run(_drive(host, port, requests, clients, seconds))
    lat = np.asarray(latencies)
    return {
        "clients": clients,
        "requests_per_s": round(len(lat) / seconds, 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 2) if len(lat) else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 2) if len(lat) else None,
        "errors": errors,
        "client_cpu_cores": round((sum(me.cpu_times()[:2]) - cpu) / seconds, 2),
    }
