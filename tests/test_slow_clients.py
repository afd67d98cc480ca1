"""Slow clients ("slowloris") against every stage: connections that send a request a few bytes at a time.

A slow client costs an asyncio server no thread and no batch slot, only a connection and a task.
The danger is that it costs them forever. Two kinds are sent here, while ordinary requests keep
arriving:

- **slow bodies**: complete headers with ``Content-Length``, then the JSON body one byte every
  ``interval`` seconds. ``BodyGuard`` (``common/limits.py``, the same in every stage) gives the whole
  body ``BODY_TIMEOUT_S`` from the request's start, then answers 408 and closes the connection.
- **slow headers**: the request line and headers one byte at a time. uvicorn has no deadline for
  headers (its keep-alive timeout starts only after a response), so these stay open as long as the
  client keeps sending. They must still not slow anyone else down; the defence against many of them
  is a proxy in front (nginx's ``client_header_timeout``), and ``docs/reliability.md`` says so.

Every ordinary request must be answered 200 while the slow ones are open. The test records what it
saw (``observe``) for ``python -m benchmarks.reliability``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from conftest import SERVER_STAGES, run_server

BODY_TIMEOUT_S = 2.0  # shorter than the default 15 s, so that the test takes seconds

BODY = b'{"inputs": ["a slow client sends this one byte at a time"]}'


@dataclass
class SlowResult:
    slow_bodies: int
    slow_headers: int
    body_statuses: dict[str, int] = field(default_factory=dict)  # status (or "none") -> count
    body_answer_s: list[float] = field(default_factory=list)  # from the first byte to the answer
    body_error_shape_ok: bool = True
    headers_still_open: int = 0  # slow-header connections the server had not closed at the end
    ordinary: int = 0
    ordinary_ok: int = 0
    ordinary_p50_ms: float | None = None
    baseline_p50_ms: float | None = None  # the same ordinary requests with no slow client open


async def _slow_body(host: str, port: int, path: str, interval: float, result: SlowResult) -> None:
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(BODY)}\r\n\r\n"
    ).encode()
    writer.write(head)
    answer = asyncio.create_task(reader.read(65536))
    raw = b""
    try:
        for i in range(len(BODY)):
            if answer.done():
                break
            writer.write(BODY[i : i + 1])
            await writer.drain()
            await asyncio.wait({answer}, timeout=interval)
    except OSError:
        pass  # the server answered and closed while we were still sending: read what it said
    try:
        raw = await asyncio.wait_for(answer, timeout=60)
        while raw and not raw.endswith(b"}"):  # the answer may come in more than one read
            more = await asyncio.wait_for(reader.read(65536), timeout=10)
            if not more:
                break
            raw += more
    except (OSError, TimeoutError):
        pass
    finally:
        writer.close()
    status = raw.split(b" ", 2)[1].decode() if raw.startswith(b"HTTP/1.1 ") else "none"
    result.body_statuses[status] = result.body_statuses.get(status, 0) + 1
    result.body_answer_s.append(time.perf_counter() - started)
    if status != "200":
        try:
            error = json.loads(raw.partition(b"\r\n\r\n")[2])["error"]
            result.body_error_shape_ok &= error["code"] == int(status) and bool(error["message"])
        except (ValueError, KeyError, TypeError):
            result.body_error_shape_ok = False


async def _slow_headers(
    host: str, port: int, interval: float, stop: asyncio.Event, result: SlowResult
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    head = f"POST /v1/embed HTTP/1.1\r\nHost: {host}:{port}\r\nX-Padding: ".encode()
    try:
        writer.write(head)
        while not stop.is_set():
            writer.write(b"a")  # a header value that never ends
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval)
        result.headers_still_open += not reader.at_eof()
    except OSError:
        pass  # the server closed it: fine, and counted by headers_still_open staying low
    finally:
        writer.close()


async def _ordinary(client: httpx.AsyncClient, n: int, pause: float) -> list[tuple[int, float]]:
    out = []
    for i in range(n):
        started = time.perf_counter()
        r = await client.post("/v1/embed", json={"inputs": [f"ordinary request number {i}"], "cache": False})
        out.append((r.status_code, (time.perf_counter() - started) * 1e3))
        await asyncio.sleep(pause)
    return out


async def run(
    url: str,
    slow_bodies: int = 100,
    slow_headers: int = 100,
    interval: float = 0.25,
    ordinary: int = 40,
    path: str = "/v1/embed",
) -> SlowResult:
    """Open the slow connections, send ``ordinary`` requests one after another meanwhile, collect."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    result = SlowResult(slow_bodies, slow_headers)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        baseline = await _ordinary(client, ordinary // 2, 0.02)
        result.baseline_p50_ms = round(statistics.median(ms for _, ms in baseline), 2)
        stop = asyncio.Event()
        header_tasks = [
            asyncio.create_task(_slow_headers(host, port, interval, stop, result))
            for _ in range(slow_headers)
        ]
        body_tasks = [
            asyncio.create_task(_slow_body(host, port, path, interval, result)) for _ in range(slow_bodies)
        ]
        await asyncio.sleep(interval * 2)  # all slow connections open and sending
        answers = await _ordinary(client, ordinary, 0.05)
        await asyncio.gather(*body_tasks)
        stop.set()
        await asyncio.gather(*header_tasks)
    result.ordinary = len(answers)
    result.ordinary_ok = sum(status == 200 for status, _ in answers)
    result.ordinary_p50_ms = round(statistics.median(ms for _, ms in answers), 2)
    return result


@pytest.mark.parametrize("stage", SERVER_STAGES)
def test_slow_clients(stage: str, tmp_path: Path, observe: Callable[..., None]) -> None:
    with run_server(stage, tmp_path, {"BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)}) as server:
        # A body that arrives slowly but within the deadline is answered normally.
        on_time = asyncio.run(run(server.url, slow_bodies=4, slow_headers=0, interval=0.01, ordinary=4))
        assert len(BODY) * 0.01 < BODY_TIMEOUT_S / 2
        assert on_time.body_statuses == {"200": 4}

        result = asyncio.run(run(server.url, slow_bodies=60, slow_headers=60, interval=0.25, ordinary=20))
        observe(
            stage=stage,
            body_timeout_s=BODY_TIMEOUT_S,
            slow_bodies=result.slow_bodies,
            body_statuses=result.body_statuses,
            body_answered_after_s=[round(min(result.body_answer_s), 2), round(max(result.body_answer_s), 2)],
            slow_headers=result.slow_headers,
            headers_still_open=result.headers_still_open,
            ordinary=result.ordinary,
            ordinary_ok=result.ordinary_ok,
            ordinary_p50_ms=result.ordinary_p50_ms,
            baseline_p50_ms=result.baseline_p50_ms,
        )
        # Every trickled body: 408 in the OpenAI error shape, never before the deadline.
        assert result.body_statuses == {"408": 60}, result
        assert result.body_error_shape_ok
        assert min(result.body_answer_s) >= BODY_TIMEOUT_S
        # Meanwhile every ordinary request was answered.
        assert result.ordinary_ok == result.ordinary == 20, result
        assert httpx.get(f"{server.url}/health").status_code == 200
        # uvicorn has no header deadline: those connections stayed open, and cost only themselves.
        assert result.headers_still_open == 60
        assert "Traceback" not in server.log()
