"""``wrk``, the C load generator, driven from Python: closed loop, one new body per request.

On a 2-core machine the load generator shares the cores with the server. ``loadtests.httpload``
costs the server about a third of a core at 700 requests/s; ``wrk`` (one thread, epoll, C) costs a
small fraction of that, so the server's own ceiling shows. Each connection sends its next request
the moment an answer arrives, 200 or 503 alike: what a naive client or a load test does.

Bodies come from a file, one JSON body per line, cycled through by a small Lua script.
``make tools`` installs Debian's package when it is missing.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def available() -> bool:
    return shutil.which("wrk") is not None


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(value) * _UNITS[unit]


def run(
    url: str, bodies: Sequence[bytes], connections: int, seconds: float, path: str = "/v1/embed"
) -> dict[str, Any]:
    """Requests/s, the share that was not 2xx, and latency percentiles (of every answer).

    ``seconds`` is rounded up to whole seconds (what wrk takes)."""
    seconds = max(1, math.ceil(seconds))
    if not available():
        raise SystemExit("wrk is missing: `make tools` installs Debian's package")
    with tempfile.TemporaryDirectory() as tmp:
        file, script = Path(tmp) / "bodies.jsonl", Path(tmp) / "bodies.lua"
        file.write_bytes(b"\n".join(bodies))
        script.write_text(SCRIPT)
        done = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script), url],
            capture_output=True,
            text=True,
            check=True,
            env={"WRK_BODIES": str(file), "WRK_PATH": path, "PATH": "/usr/bin:/bin"},
        )
    out = done.stdout
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    other = int(m.group(1)) if (m := re.search(r"Non-2xx or 3xx responses: (\d+)", out)) else 0
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    latency = {q: _ms(v) for q, v in re.findall(r"^\s+(50|90|99)%\s+(\S+)$", out, re.M)}
    return {
        "connections": connections,
        "requests_per_s": round((total - other) / seconds, 1),
        "non_2xx_per_s": round(other / seconds, 1),
        "socket_errors": errors,
        "p50_ms": latency.get("50"),
        "p99_ms": latency.get("99"),
    }
