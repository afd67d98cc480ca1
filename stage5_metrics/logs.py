"""Structured logs: one line per request, JSON (for machines) or key=value text (for people).

LOG_FORMAT picks the format and LOG_LEVEL the level. The request line carries counts and
timings only: the texts themselves never reach a log, and neither do headers or keys.

Every ``embedserve.*`` logger goes through ``logging`` with the formatters below. The request
line, written once per request, takes a shorter way (``RequestLog``): building a
``LogRecord`` (process and thread names, caller lookup, handler locks) and one system call
per line cost several times more than the rest of a cached request's bookkeeping. It writes
the same line to the same stream, and honours the same level.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import orjson

from common.settings import Settings

REQUEST_LOGGER = "embedserve.requests"


class _Clock:
    """ISO 8601 UTC timestamps to the millisecond; the seconds part is formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._prefix = ""

    def stamp(self, now: float) -> str:
        second = int(now)
        if second != self._second:
            self._second, self._prefix = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._prefix}.{int((now - second) * 1000):03d}Z"


_clock = _Clock()
_LEVELS = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning", logging.ERROR: "error"}


def _line(level: str, logger: str, msg: str, fields: dict[str, Any], created: float) -> dict[str, Any]:
    return {"ts": _clock.stamp(created), "level": level, "logger": logger, "msg": msg, **fields}


def _text(level: str, msg: str, fields: dict[str, Any], created: float) -> str:
    pairs = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
    return f"{_clock.stamp(created)} {level.upper()} {msg} {pairs}".rstrip()


# --8<-- [start:json]
class JsonFormatter(logging.Formatter):
    """``{"ts": ..., "level": ..., "logger": ..., "msg": ..., <fields>}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        fields = dict(getattr(record, "fields", {}))
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        line = _line(record.levelname.lower(), record.name, record.getMessage(), fields, record.created)
        return orjson.dumps(line).decode()


# --8<-- [end:json]


class TextFormatter(logging.Formatter):
    """``<ts> INFO request request_id=... route=/v1/embed status=200 ...``"""

    def format(self, record: logging.LogRecord) -> str:
        text = _text(record.levelname, record.getMessage(), getattr(record, "fields", {}), record.created)
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def configure_logging(settings: Settings) -> logging.StreamHandler[TextIO]:
    """Send every ``embedserve.*`` logger to stderr in the configured format (idempotent)."""
    root = logging.getLogger("embedserve")
    handler = next((h for h in root.handlers if getattr(h, "_embedserve", False)), None)
    if not isinstance(handler, logging.StreamHandler):
        handler = logging.StreamHandler(sys.stderr)
        handler._embedserve = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    handler.setFormatter(JsonFormatter() if settings.log_format == "json" else TextFormatter())
    root.setLevel(settings.log_level)
    root.propagate = False
    return handler


@dataclass(slots=True)
class RequestRecord:
    """What one request did, filled in on the way (ids, counts and timings; never text)."""

    request_id: str
    texts: int = 0
    tokens: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    queue_ms: float | None = None
    inference_ms: float | None = None
    saved_cache_ms: float = 0.0


def _ms(value: float | None) -> str:
    return "null" if value is None else f"{value:.3f}"


# --8<-- [start:request_log]
class RequestLog:
    """The one line per request, in the configured format, written in batches of lines.

    One ``write`` system call per line would cost more than all the counting together; the
    lines wait at most ``FLUSH_S`` and go out in one write (always whole lines), and the
    backend flushes what is left when the server stops.
    """

    FLUSH_S = 0.05

    def __init__(self, settings: Settings) -> None:
        self.handler = configure_logging(settings)
        self.logger = logging.getLogger(REQUEST_LOGGER)
        self.json = settings.log_format == "json"
        self._pending: list[str] = []
        self._timer: asyncio.TimerHandle | None = None

    def enabled(self, level: int) -> bool:
        return self.logger.isEnabledFor(level)  # cached by logging: about a dict lookup

    def write(
        self, level: int, method: str, route: str, status: int, r: RequestRecord, total_ms: float
    ) -> None:
        name = _LEVELS.get(level) or logging.getLevelName(level).lower()
        ts = _clock.stamp(time.time())
        if not method.isalpha():  # HTTP allows odd tokens; keep the line valid JSON whatever comes
            method = "OTHER"
        queue, inference = _ms(r.queue_ms), _ms(r.inference_ms)
        if self.json:
            # Formatted by hand: every value is a number, null or a checked string (the request id
            # matched a strict pattern, the route is a template); the same keys as JsonFormatter.
            line = (
                f'{{"ts":"{ts}","level":"{name}","logger":"{REQUEST_LOGGER}","msg":"request",'
                f'"request_id":"{r.request_id}","method":"{method}","route":"{route}","status":{status},'
                f'"texts":{r.texts},"tokens":{r.tokens},"cache_hits":{r.cache_hits},'
                f'"cache_misses":{r.cache_misses},"queue_ms":{queue},"inference_ms":{inference},'
                f'"total_ms":{total_ms:.3f}}}'
            )
        else:
            line = (
                f"{ts} {name.upper()} request request_id={r.request_id} method={method} route={route} "
                f"status={status} texts={r.texts} tokens={r.tokens} cache_hits={r.cache_hits} "
                f"cache_misses={r.cache_misses} queue_ms={queue} inference_ms={inference} "
                f"total_ms={total_ms:.3f}"
            )
        self._pending.append(line)
        if self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(self.FLUSH_S, self.flush)
            except RuntimeError:  # no event loop (a script, a test): write now
                self.flush()

    def flush(self) -> None:
        self._timer = None
        if self._pending:
            lines, self._pending = self._pending, []
            self.handler.stream.write("\n".join(lines) + "\n")
            self.handler.stream.flush()


# --8<-- [end:request_log]
