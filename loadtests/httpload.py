"""The light load generators beside Locust: a closed loop and an open loop over raw HTTP/1.1.

On 2 cores the load generator competes with the server for CPU, so it must be cheap: raw
asyncio streams, request bytes built before the clock starts, no HTTP library. Every
measurement reports the client's own CPU next to its figures.

* ``closed_loop``: N clients, each with one keep-alive connection, each sending its next
  request when the last one is answered (``run_load`` sums one up: requests/s, percentiles).
* ``OpenLoop``: requests at a set arrival rate whatever the answers do, through ``Connections``
  (a request takes an idle keep-alive connection or opens one).

A request that gets no answer (refused, reset, timed out) is an ``Answer`` with status 0 and
the error's name: counted, never raised, so a fault injected under load is measured, not fatal.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil

# What a request that got no answer raises: each is counted as an Answer with status 0.
NO_ANSWER = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError)


def post_requests(
    path: str, bodies: Sequence[bytes], headers: Mapping[str, str] | None = None
) -> list[bytes]:
    """The full request bytes for each JSON body, built once, before the clock starts."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{extra}".encode()
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


@dataclass(slots=True)
class Answer:
    """One request's outcome. ``status`` 0: no answer (``error`` says why)."""

    status: int
    started: float  # time.monotonic() when it was sent
    ms: float  # until the answer (or the failure)
    headers: dict[str, str] = field(default_factory=dict)
    error: str | None = None


# --- closed loop -------------------------------------------------------------------------
class _Client:
    """One connection, opened when needed and again after a failure or a ``connection: close``."""

    def __init__(self, host: str, port: int, keep_alive: bool, timeout: float) -> None:
        self.host, self.port, self.keep_alive, self.timeout = host, port, keep_alive, timeout
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def send(self, request: bytes) -> Answer:
        started, clock = time.monotonic(), time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout):
                if self.streams is None:
                    self.streams = await asyncio.open_connection(self.host, self.port)
                reader, writer = self.streams
                writer.write(request)
                status, headers = await read_response(reader)
        except NO_ANSWER as exc:
            self.close()
            return Answer(0, started, (time.perf_counter() - clock) * 1e3, error=type(exc).__name__)
        if not self.keep_alive or headers.get("connection", "").lower() == "close":
            self.close()
        return Answer(status, started, (time.perf_counter() - clock) * 1e3, headers)

    def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()
            self.streams = None


async def closed_loop(
    host: str,
    port: int,
    requests: Sequence[bytes],
    clients: int,
    *,
    seconds: float | None = None,
    stop: asyncio.Event | None = None,
    keep_alive: bool = True,
    timeout: float = 60.0,
    pause_after_error: float = 0.05,
    record: Callable[[Answer], None] | None = None,
    honour_retry_after: bool = False,
) -> list[Answer]:
    """``clients`` clients, each sending its next request as soon as the last one is answered.

    Runs for ``seconds``, or until ``stop`` is set (each client cycling through ``requests`` from
    its own offset), or, with neither, until every request has been sent once. ``keep_alive=False``
    opens a new connection per request. After a request with no answer a client waits
    ``pause_after_error`` (a refused connection answers at once: do not spin). With
    ``honour_retry_after`` a client that gets 503 or 429 waits the answer's Retry-After seconds
    before it sends again, as a polite client does.
    """
    answers: list[Answer] = []
    keep = record or answers.append
    until = time.perf_counter() + seconds if seconds is not None else None
    shared = itertools.count() if seconds is None and stop is None else None
    step = max(1, len(requests) // max(clients, 1))

    def more() -> bool:
        if until is not None and time.perf_counter() >= until:
            return False
        return not (stop is not None and stop.is_set())

    async def one_client(i: int) -> None:
        client = _Client(host, port, keep_alive, timeout)
        n = i * step
        try:
            while more():
                if shared is not None:
                    n = next(shared)
                    if n >= len(requests):
                        return
                answer = await client.send(requests[n % len(requests)])
                n += 1
                keep(answer)
                if answer.status == 0 and pause_after_error > 0:
                    await asyncio.sleep(pause_after_error)
                elif honour_retry_after and answer.status in (429, 503):
                    await asyncio.sleep(float(answer.headers.get("retry-after", "1")))
        finally:
            client.close()

    await asyncio.gather(*(one_client(i) for i in range(clients)))
    return answers


async def _probe(host: str, port: int, path: str, until: float, out: list[float]) -> None:
    """GET ``path`` every 50 ms on a connection of its own: how long a health check waits."""
    client = _Client(host, port, True, 60.0)
    request = f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode()
    try:
        while time.perf_counter() < until:
            answer = await client.send(request)
            if answer.status:
                out.append(answer.ms)
            await asyncio.sleep(0.05)
    finally:
        client.close()


def percentile_ms(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if len(values) else None


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
        asyncio.run(closed_loop(host, port, requests[::-1], clients, seconds=warmup))

    async def measured() -> tuple[list[Answer], list[float]]:
        probed: list[float] = []
        load = closed_loop(host, port, requests, clients, seconds=seconds)
        if probe is None:
            return await load, probed
        answers, _ = await asyncio.gather(
            load, _probe(host, port, probe, time.perf_counter() + seconds, probed)
        )
        return answers, probed

    me = psutil.Process()
    cpu = sum(me.cpu_times()[:2])
    answers, probed = asyncio.run(measured())
    latencies = [a.ms for a in answers if a.status == 200]
    result: dict[str, Any] = {
        "clients": clients,
        "requests_per_s": round(len(latencies) / seconds, 1),
        "p50_ms": percentile_ms(latencies, 50),
        "p99_ms": percentile_ms(latencies, 99),
        "errors": len(answers) - len(latencies),
        "client_cpu_cores": round((sum(me.cpu_times()[:2]) - cpu) / seconds, 2),
    }
    if probe is not None:
        result.update(
            {
                "probe": probe,
                "probe_n": len(probed),
                "probe_p50_ms": percentile_ms(probed, 50),
                "probe_p99_ms": percentile_ms(probed, 99),
                "probe_max_ms": round(max(probed), 2) if probed else None,
            }
        )
    return result


# --- open loop ---------------------------------------------------------------------------
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


class OpenLoop:
    """Requests sent on a schedule (``rate(t)`` per second at ``t`` seconds in), whatever the answers do.

    A closed loop slows down with the server it measures; an open loop keeps arriving, as users
    do, so a server that falls behind shows it as a growing number ``in_flight``. Past
    ``max_in_flight`` a due request is not sent but counted at once as an Answer with status 0 and
    error ``client_backlog``: the server is not keeping up, and queueing it here would hide that.
    """

    def __init__(self, host: str, port: int, max_in_flight: int = 256, timeout: float = 60.0) -> None:
        self.conns = Connections(host, port)
        self.max_in_flight, self.timeout = max_in_flight, timeout
        self.in_flight = 0
        self.sent = 0  # requests due so far (those refused for the backlog included)
        self.began = time.monotonic()

    async def run(
        self,
        path: str,
        next_body: Callable[[], bytes],
        rate: Callable[[float], float],
        seconds: float,
        record: Callable[[Answer], None],
        drain_s: float = 60.0,
    ) -> None:
        """Send for ``seconds``, then wait up to ``drain_s`` for the answers still in flight."""
        tasks: set[asyncio.Task[None]] = set()

        async def one(body: bytes) -> None:
            started, clock = time.monotonic(), time.perf_counter()
            try:
                status, headers = await self.conns.post(path, body, self.timeout)
                answer = Answer(status, started, (time.perf_counter() - clock) * 1e3, headers)
            except NO_ANSWER as exc:
                answer = Answer(0, started, (time.perf_counter() - clock) * 1e3, error=type(exc).__name__)
            finally:
                self.in_flight -= 1
            record(answer)

        self.began = due = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if now - self.began >= seconds:
                    break
                if due > now:
                    await asyncio.sleep(due - now)
                    continue
                due += 1 / rate(due - self.began)
                self.sent += 1
                if self.in_flight >= self.max_in_flight:
                    record(Answer(0, now, 0.0, error="client_backlog"))
                    continue
                self.in_flight += 1
                task = asyncio.create_task(one(next_body()))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(tasks, timeout=drain_s)
        finally:
            self.conns.close()
