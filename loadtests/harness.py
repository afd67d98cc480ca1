"""What `make compare` and `make loadtest` share: the profiles, warm-up, one Locust run, CPU shares.

Locust runs as ONE subprocess (``python -m locust --headless``, FastHttpUser) so its CPU use can
be measured apart from the server's. This module never imports locust: locust monkey-patches
the standard library with gevent on import, and this process also starts servers and threads.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil

from common import corpus
from loadtests.load import post_bodies, process_cpu

REPO = Path(__file__).resolve().parent.parent
LOCUSTFILE = REPO / "loadtests" / "locustfile.py"
WARMUP_SEED = 999  # never used by a profile, so a warm cache cannot flatter the unique-text runs


# --8<-- [start:profiles]
@dataclass(frozen=True)
class Profile:
    """One headless Locust run: a user class, a user count and a few workload options."""

    name: str
    user_class: str
    users: int
    text_kind: str = "sentence"
    texts_per_request: int = 1
    options: tuple[str, ...] = ()

    def args(self) -> list[str]:
        args = ["--text-kind", self.text_kind, *self.options]
        if self.user_class == "OverloadUser":
            return [*args, "--overload-texts", str(self.texts_per_request)]
        return [*args, "--texts-per-request", str(self.texts_per_request)]


# The same list for every stage, in this order (overload last: it leaves the slow stages busiest).
PROFILES: tuple[Profile, ...] = (
    Profile("unique-1", "UniqueTextUser", 1),
    Profile("unique-8", "UniqueTextUser", 8),
    Profile("unique-32", "UniqueTextUser", 32),
    Profile("unique-128", "UniqueTextUser", 128),
    Profile("repeated-32", "RepeatedTextUser", 32, options=("--unique-ratio", "0.3")),
    Profile("mixed-32", "MixedLengthUser", 32, text_kind="mixed"),
    Profile("waves-32", "WaveUser", 32, options=("--wave-period", "0.5")),
    Profile("overload-128", "OverloadUser", 128, texts_per_request=8),
)
# Every stage runs with these settings in `make compare`: a queue of 256 texts (stages 4-5; the
# earlier stages have no bound) makes the overload profile's 1024 texts in flight an overload.
COMPARE_ENV = {"MAX_QUEUE": "256"}
# ...and without these: a shared Redis keeps answers between runs, so "unique" texts would hit.
COMPARE_WITHOUT = ("CACHE_URL",)
# --8<-- [end:profiles]


def _auth_headers() -> dict[str, str]:
    """The locustfile's --api-key default: the first key of $API_KEY, for servers started with it."""
    key = next((k.strip() for k in os.environ.get("API_KEY", "").split(",") if k.strip()), "")
    return {"Authorization": f"Bearer {key}"} if key else {}


def warm_up(url: str, seconds: float, clients: int = 4) -> int:
    """Send unique mixed-length texts from a few clients for ``seconds``; returns how many were answered."""
    texts = corpus.texts(max(200, int(seconds * 400)), seed=WARMUP_SEED, kind="mixed")
    bodies = [orjson.dumps({"inputs": [t]}) for t in texts]
    answers = asyncio.run(post_bodies(url, bodies, clients, seconds=seconds, headers=_auth_headers()))
    return sum(a.status == 200 for a in answers)


def busy_cpu() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores)."""
    t = psutil.cpu_times()
    # Linux counts guest time inside user time already; steal (another VM on the host) stays in.
    counted_twice = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0) - counted_twice)


class CpuSampler:
    """Samples the server's CPU seconds and the machine's busy seconds every ``interval``."""

    def __init__(self, pid: int | None, interval: float = 0.1) -> None:
        self.process = psutil.Process(pid) if pid else None
        self.interval = interval
        self.samples: list[tuple[float, float, float]] = []  # (time.time(), server cpu, busy cpu)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        server = process_cpu(self.process) if self.process else 0.0
        self.samples.append((time.time(), server, busy_cpu()))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> CpuSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def between(self, start: float, stop: float) -> tuple[float, float]:
        """(server CPU s, machine busy CPU s) from ``start`` to ``stop`` (wall clock), interpolated."""

        def at(t: float) -> tuple[float, float]:
            s = self.samples
            for (t0, a0, b0), (t1, a1, b1) in itertools.pairwise(s):
                if t0 <= t <= t1:
                    f = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
                    return a0 + f * (a1 - a0), b0 + f * (b1 - b0)
            _, a, b = s[0] if t < s[0][0] else s[-1]
            return a, b

        (a0, b0), (a1, b1) = at(start), at(stop)
        return a1 - a0, b1 - b0


def classify_failures(errors: dict[str, int]) -> dict[str, int]:
    """Locust error strings -> {"503": n, "other": n}; the locustfile names failures ``HTTP <code>``."""
    out = {"503": 0, "other": 0}
    for error, count in errors.items():
        code = re.search(r"HTTP (\d{3})", error)
        out["503" if code and code.group(1) == "503" else "other"] += count
    return out


@dataclass
class PointResult:
    """Every figure of one Locust run against one stage."""

    stage: str
    profile: str
    user_class: str
    users: int
    texts_per_request: int
    window_s: float
    requests: int
    successes: int
    failures: dict[str, int]
    errors: dict[str, int]
    rps: float  # successful requests per second
    texts_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    loadgen_cores: float  # CPU the Locust process used, in cores, over the window
    server_cores: float
    other_cores: float  # everything else on the machine (other users, this harness)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --8<-- [start:locust_command]
def locust_command(
    url: str, profile: Profile, seconds: float, prefix: Path, seed: int, stop_timeout: float = 10.0
) -> list[str]:
    users = str(profile.users)
    # fmt: off
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url,
        "-u", users, "-r", users, "-t", f"{seconds:g}s",
        "--reset-stats",  # measure from the moment every user is running, not during the ramp
        "--stop-timeout", f"{stop_timeout:g}",  # requests in flight at the end still count
        "--only-summary", "--loglevel", "WARNING", "--exit-code-on-error", "0",
        "--csv", str(prefix), "--json-file", str(prefix),
        "--run-report", f"{prefix}_report.json", "--seed", str(seed),
        *profile.args(), profile.user_class,
    ]
    # fmt: on


# --8<-- [end:locust_command]


def run_point(
    stage: str,
    url: str,
    profile: Profile,
    seconds: float,
    prefix: Path,
    seed: int,
    server_pid: int | None,
    stop_timeout: float = 10.0,
) -> PointResult:
    """One headless Locust run; raw CSV/JSON land next to ``prefix``."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    command = locust_command(url, profile, seconds, prefix, seed, stop_timeout)
    with CpuSampler(server_pid) as sampler, (prefix.parent / f"{prefix.name}_locust.log").open("wb") as log:
        done = subprocess.run(
            command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=seconds + stop_timeout + 120
        )
    if done.returncode != 0:
        raise RuntimeError(f"locust exited with {done.returncode}; see {prefix}_locust.log")
    entries = json.loads(Path(f"{prefix}.json").read_text())
    report = json.loads(Path(f"{prefix}_report.json").read_text())
    window = max(report["wall_s"], 1e-9)
    server_s, busy_s = sampler.between(report["start_wall"], report["stop_wall"])

    requests = sum(e["num_requests"] for e in entries)
    failed = sum(e["num_failures"] for e in entries)
    percentiles = report["percentiles_ms"]  # Locust's own, over every request (the locustfile's report)
    errors = report.get("errors", {})
    return PointResult(
        stage=stage,
        profile=profile.name,
        user_class=profile.user_class,
        users=profile.users,
        texts_per_request=profile.texts_per_request,
        window_s=window,
        requests=requests,
        successes=requests - failed,
        failures=classify_failures(errors),
        errors=errors,
        rps=(requests - failed) / window,
        texts_per_s=(requests - failed) * profile.texts_per_request / window,
        p50_ms=percentiles["0.5"],
        p95_ms=percentiles["0.95"],
        p99_ms=percentiles["0.99"],
        max_ms=report["max_ms"],
        loadgen_cores=report["cores"],
        server_cores=server_s / window,
        other_cores=max(0.0, (busy_s - server_s - report["cpu_s"]) / window),
    )
