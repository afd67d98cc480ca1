"""Structured logs: one line per request, JSON (for machines) or key=value text (for people).

LOG_FORMAT picks the format and LOG_LEVEL the level. The request line carries counts and
timings only: the texts themselves never reach a log, and neither do headers or keys.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

from common.settings import Settings

REQUEST_LOGGER = "embedserve.requests"


def _timestamp(record: logging.LogRecord) -> str:
    return (
        datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


# --8<-- [start:json]
class JsonFormatter(logging.Formatter):
    """``{"ts": ..., "level": ..., "logger": ..., "msg": ..., <fields>}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


# --8<-- [end:json]
class TextFormatter(logging.Formatter):
    """``<ts> INFO request request_id=... route=/v1/embed status=200 ...``"""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        pairs = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        text = f"{_timestamp(record)} {record.levelname} {record.getMessage()} {pairs}".rstrip()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def configure_logging(settings: Settings) -> None:
    """Send every ``embedserve.*`` logger to stderr in the configured format (idempotent)."""
    root = logging.getLogger("embedserve")
    handler = next((h for h in root.handlers if getattr(h, "_embedserve", False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler._embedserve = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    handler.setFormatter(JsonFormatter() if settings.log_format == "json" else TextFormatter())
    root.setLevel(settings.log_level)
    root.propagate = False
