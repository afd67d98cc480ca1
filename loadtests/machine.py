"""Which machine a result came from: every results file records it."""

from __future__ import annotations

import datetime as dt
import os
import platform
from importlib import metadata
from typing import Any


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return 0.0


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, OS, Python and key library versions, and the time (UTC)."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            p: _version(p)
            for p in ("onnxruntime", "tokenizers", "numpy", "fastapi", "uvicorn", "redis", "locust")
        },
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
