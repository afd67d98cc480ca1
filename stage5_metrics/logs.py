"""Logs: one line per request and uvicorn's own lines, JSON (for machines) or text (for people).

Everything goes through the standard ``logging`` machinery. LOG_FORMAT picks the formatter
(python-json-logger's, or ``key=value`` text) and LOG_LEVEL the level. The request line
carries ids, counts and timings only (``log_request``): the texts never reach a log, and
neither do headers or keys.

Writing to stderr can block (a full pipe, a slow log shipper), so the ``embedserve.*`` lines
go through the standard library's ``QueueHandler`` and ``QueueListener``: the event loop only
puts the record on a queue, and the listener's thread, waking every WRITE_EVERY_S rather than for
every line, formats and writes what is queued. The lifespan's end
stops the listener (``stop_logging``), which writes every line still queued first, so a SIGTERM
loses none. uvicorn configures its loggers before it calls the app factory, so ``configure_logging``,
called when the app is built, gives uvicorn's lines ("Started server process", "Uvicorn running
on", errors) the same format; they are few, so they are written directly.
"""

from __future__ import annotations

import logging
import queue
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass
from logging.handlers import QueueHandler, QueueListener
from typing import Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.orjson import OrjsonFormatter

from common.settings import Settings

REQUEST_LOGGER = "embedserve.requests"
WRITE_EVERY_S = 0.05  # how often the listener's thread wakes to write the queued lines
_SKIP = {*RESERVED_ATTRS, "color_message"}  # uvicorn adds an ANSI-coloured copy of its message


def _utc(seconds: float | None) -> time.struct_time:
    return time.gmtime(seconds)


# --8<-- [start:json]
class JsonFormatter(OrjsonFormatter):
    """``{"ts": ..., "level": ..., "logger": ..., "msg": ..., <fields>}`` on one line."""

    converter = staticmethod(_utc)  # to the millisecond: 2026-12-01T09:30:00.123Z
    default_time_format, default_msec_format = "%Y-%m-%dT%H:%M:%S", "%s.%03dZ"

    def __init__(self) -> None:
        renames = {
            "asctime": "ts",
            "levelname": "level",
            "name": "logger",
            "message": "msg",
            "exc_info": "exc",
        }
        super().__init__(
            "%(asctime)s %(levelname)s %(name)s %(message)s", rename_fields=renames, reserved_attrs=_SKIP
        )

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        log_data["level"] = log_data["level"].lower()
        return log_data


# --8<-- [end:json]


class TextFormatter(logging.Formatter):
    """``<ts> INFO request request_id=... route=/v1/embed status=200 ...``"""

    converter = staticmethod(_utc)
    default_time_format, default_msec_format = JsonFormatter.default_time_format, "%s.%03dZ"

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        fields = {k: v for k, v in record.__dict__.items() if k not in _SKIP and not k.startswith("_")}
        pairs = "".join(f" {k}={'null' if v is None else v}" for k, v in fields.items())
        text = super().format(record)
        head, newline, trace = text.partition("\n")  # an exception's traceback goes after the fields
        return head + pairs + newline + trace


class _Listener(QueueListener):
    """The standard listener, except that its thread wakes every WRITE_EVERY_S to write what is
    queued, rather than for every line: each wake-up had the event loop hand the GIL over, once a
    request. A line waits at most that long; ``stop`` still writes every queued line first."""

    def dequeue(self, block: bool) -> Any:
        while True:
            try:
                return self.queue.get_nowait()  # type: ignore[attr-defined]  # the SimpleQueue
            except queue.Empty:
                if not block:
                    raise
                time.sleep(WRITE_EVERY_S)


class _Queued(QueueHandler):
    """Puts records on a queue; a listener thread formats them and writes them to ``target``."""

    def __init__(self, target: logging.Handler) -> None:
        # A SimpleQueue, whose put is reentrant: the drain logs from the SIGTERM handler, which may
        # interrupt a put of this thread (a queue.Queue's lock would deadlock there).
        lines: queue.SimpleQueue[Any] = queue.SimpleQueue()
        super().__init__(lines)
        self.target = target
        self.listener = _Listener(lines, target)  # started with the backend (``start_logging``)
        self.running = False

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        # The default folds the traceback into the message; kept apart, the JSON line's `msg` stays
        # the message and the traceback is its `exc` field. The listener's formatter does the rest.
        record.msg, record.args = record.getMessage(), None
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        return record


def configure_logging(settings: Settings) -> None:
    """Send ``embedserve.*`` and ``uvicorn*`` lines to stderr in the configured format (idempotent)."""
    ours = logging.getLogger("embedserve")
    queued = next((h for h in ours.handlers if isinstance(h, _Queued)), None)
    if queued is None:
        queued = _Queued(logging.StreamHandler(sys.stderr))
    ours.handlers = [queued]  # (in place of the plain handler common.serve gives the earlier stages)
    queued.target.setFormatter(JsonFormatter() if settings.log_format == "json" else TextFormatter())
    ours.setLevel(settings.log_level)
    ours.propagate = False
    for name in ("uvicorn", "uvicorn.access"):  # uvicorn.error propagates to uvicorn
        logger = logging.getLogger(name)
        if logger.handlers:  # none on uvicorn.access: the access log is off (common/serve.py)
            logger.handlers = [queued.target]


def _queued() -> list[_Queued]:
    return [h for h in logging.getLogger("embedserve").handlers if isinstance(h, _Queued)]


def start_logging() -> None:
    """Start the thread that writes the queued lines (the lifespan's start: lines queued before
    it, by the app's construction, are written then)."""
    for handler in _queued():
        if not handler.running:
            handler.listener.start()
            handler.running = True


def stop_logging() -> None:
    """Write every queued line, then stop the listener (the lifespan's end).

    After a SIGTERM uvicorn ends the process by that signal, so a line still queued then would be
    lost. The handler goes too: an app built later in the same process installs a fresh one.
    """
    ours = logging.getLogger("embedserve")
    for handler in _queued():
        ours.removeHandler(handler)
        if handler.running:
            handler.listener.stop()  # the standard listener writes what is queued, then its thread ends


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


# The record of the request being served: the middleware sets it, the backend fills it in.
current_record: ContextVar[RequestRecord | None] = ContextVar("current_record", default=None)


# --8<-- [start:request_log]
_requests = logging.getLogger(REQUEST_LOGGER)


def log_request(level: int, method: str, route: str, status: int, r: RequestRecord, total_ms: float) -> None:
    """The one line per request: its id, counts and timings, never a text."""
    if not _requests.isEnabledFor(level):  # LOG_LEVEL=WARNING: no record is even built
        return
    fields = {
        "request_id": r.request_id, "method": method, "route": route, "status": status,
        "texts": r.texts, "tokens": r.tokens, "cache_hits": r.cache_hits, "cache_misses": r.cache_misses,
        "queue_ms": _ms(r.queue_ms), "inference_ms": _ms(r.inference_ms), "total_ms": _ms(total_ms),
    }  # fmt: skip
    _requests.log(level, "request", extra=fields)


# --8<-- [end:request_log]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
