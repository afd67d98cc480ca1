"""`make loadtest STAGE=N` (Locust's web UI) and `make loadtest HEADLESS=1 STAGE=N` (one fixed profile).

    python -m loadtests.run --stage 5                  # UI on http://127.0.0.1:8089
    python -m loadtests.run --stage 3 --headless       # unique-32 for 30 s, files in out/loadtest/
    python -m loadtests.run --compare 3,4              # stages 3 and 4 side by side in the web UI

If a server already answers /ready on HOST:PORT it is used as it is (its process found by its
port, so its CPU is counted); otherwise stage N is started with the command `make stageN` runs,
and stopped again when Locust exits. Headless, Locust runs as one subprocess and writes its own
CSV and JSON; the locustfile's run report adds the measured window's CPU (Locust's and the
server's), and this module stamps it as a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from common.serve import resolve
from loadtests import evidence
from loadtests.load import LOCUSTFILE, bodies_for, locust_command, post_bodies
from loadtests.procs import REPO, answers, running_stage

OUT = evidence.OUT / "loadtest"  # git-ignored
WARMUP_SEED = 999  # never used by a profile, so a warm cache cannot flatter the unique-text runs
# The headless profiles: a user class, a user count and a few of the locustfile's options.
PROFILES: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "unique-1": ("UniqueTextUser", 1, ()),
    "unique-8": ("UniqueTextUser", 8, ()),
    "unique-32": ("UniqueTextUser", 32, ()),
    "unique-128": ("UniqueTextUser", 128, ()),
    "repeated-32": ("RepeatedTextUser", 32, ()),  # --unique-ratio's default: a third new, as make compare's
    "mixed-32": ("MixedLengthUser", 32, ()),
    "waves-32": ("WaveUser", 32, ("--wave-period", "0.5")),
    "overload-128": ("OverloadUser", 128, ("--overload-texts", "8")),
}


def _listening(port: int) -> int | None:
    """The pid of the process listening on ``port`` on this machine, when it can be seen."""
    with contextlib.suppress(psutil.AccessDenied):
        for conn in psutil.net_connections("tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return int(conn.pid)
    return None


@contextlib.contextmanager
def server_for(stage: str, host: str, port: int, out: Path) -> Iterator[int | None]:
    """The pid of a stage started here, or of the server already answering on host:port."""
    url = f"http://{host}:{port}"
    if answers(f"{url}/ready"):
        pid = _listening(port)
        print(f"using the server already answering on {url} (pid {pid or 'not visible'})", flush=True)
        yield pid
        return
    print(f"starting {stage} on {url} (log: {out / f'{stage}-{port}.log'})", flush=True)
    with running_stage(stage, out, port=port, host=host) as server:
        yield server.pid


def web_ui(
    url: str, web_host: str, web_port: int, extra: Sequence[str], compare: dict[str, str] | None = None
) -> int:
    """Locust's web UI on ``url``; with ``compare`` (stage -> url), a user class per stage as well."""
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE),
        *(() if compare else ("--host", url)),  # a host given would override each stage's own
        "--web-host", web_host, "--web-port", str(web_port), "--class-picker", *extra,
    ]  # fmt: skip
    env = {**os.environ, "EMBEDSERVE_COMPARE": ",".join(f"{s}={u}" for s, u in (compare or {}).items())}
    print(f"Locust web UI: http://{web_host}:{web_port}  (Ctrl-C stops Locust and the server)", flush=True)
    if compare:
        picks = " and ".join(_user_class(s) for s in compare)
        print(f"in the form, pick {picks} only, and leave Host empty: each has its own", flush=True)
    locust = subprocess.Popen(command, cwd=REPO, env=env)
    try:
        return locust.wait()
    finally:
        if locust.poll() is None:
            locust.terminate()
            locust.wait(timeout=20)


def _user_class(stage: str) -> str:
    return "Stage" + stage.removeprefix("stage").split("_")[0] + "User"  # as the locustfile names it


def warm_up(url: str, seconds: float, clients: int = 4) -> None:
    """Unique mixed-length texts from a few clients for ``seconds``, from a seed no profile uses."""
    key = next((k.strip() for k in os.environ.get("API_KEY", "").split(",") if k.strip()), "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    bodies = bodies_for("mixed", max(200, int(seconds * 400)), WARMUP_SEED)
    asyncio.run(post_bodies(url, bodies, clients, seconds=seconds, headers=headers))


def headless(
    stage: str, url: str, profile: str, seconds: float, pid: int | None, out: Path, endpoint: str
) -> dict[str, Any]:
    """One Locust run of ``profile`` for ``seconds``: Locust's files and a stamped summary in ``out``."""
    if profile not in PROFILES:
        raise SystemExit(f"unknown profile {profile!r}; one of {list(PROFILES)}")
    user_class, users, options = PROFILES[profile]
    prefix = out / f"{stage}-{profile}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}"
    warm_up(url, min(5.0, seconds / 4))
    command = [
        *locust_command(url, users, f"{seconds:g}s", Path(f"{prefix}_report.json"), pid),
        "--csv",
        str(prefix),
        "--json-file",
        str(prefix),
        "--endpoint",
        endpoint,
        *options,
        user_class,
    ]
    with open(f"{prefix}_locust.log", "wb") as log:
        subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
    report = json.loads(Path(f"{prefix}_report.json").read_text())
    refused = sum(n for error, n in report["errors"].items() if error == "HTTP 503")
    window, answered = report["wall_s"], report["requests"] - report["failures"]
    row = {
        "stage": stage, "profile": profile, "user_class": user_class, "users": users,
        "window_s": round(window, 2), "requests": report["requests"], "successes": answered,
        "rps": answered / window, "p50_ms": report["percentiles_ms"]["0.5"],
        "p95_ms": report["percentiles_ms"]["0.95"], "p99_ms": report["percentiles_ms"]["0.99"],
        "max_ms": report["max_ms"], "loadgen_cores": report["cores"], "server_cores": report["server_cores"],
    }  # fmt: skip
    failures = {"503": refused, "other": report["failures"] - refused}
    run = evidence.Run("loadtests.run", sys.argv[1:])
    run.commit, run.changed = evidence.git_state()
    summary = {"stamp": run.stamp(), "url": url, **row, "failures": failures, "errors": report["errors"]}
    evidence.write_json(Path(f"{prefix}_summary.json"), summary)
    server = "not measured" if row["server_cores"] is None else f"{row['server_cores']:.2f} cores"
    print(
        f"{stage} {profile}: {row['rps']:.1f} req/s, p50 {row['p50_ms']:.0f} ms, p95 {row['p95_ms']:.0f} ms,"
        f" p99 {row['p99_ms']:.0f} ms, failures {failures}; Locust used {row['loadgen_cores']:.2f} cores,"
        f" the server {server}\nfiles: {prefix}_summary.json,"
        f" Locust's {prefix}.json and {prefix}_stats_history.csv",
        flush=True,
    )
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage", default="5", help="Stage to start when nothing answers (1-5).")
    parser.add_argument("--headless", action="store_true", help="One fixed profile, CSV/JSON out, no UI.")
    parser.add_argument("--profile", default="unique-32", choices=PROFILES, help="The headless profile.")
    parser.add_argument("--duration", type=float, default=30.0, help="Headless seconds.")
    parser.add_argument("--endpoint", choices=("/v1/embed", "/v1/embeddings"), default="/v1/embed")
    parser.add_argument("--out", type=Path, default=OUT, help="Folder for results and the server log.")
    parser.add_argument("--web-host", default="127.0.0.1")
    parser.add_argument("--web-port", type=int, default=8089)
    parser.add_argument(
        "--compare", help="Stages to load side by side in the web UI, on PORT, PORT+1, ... (e.g. 3,4)."
    )
    args, extra = parser.parse_known_args(argv)  # anything else goes to Locust (UI mode)
    stage = resolve(args.stage)
    host, port = os.environ.get("HOST", "127.0.0.1"), int(os.environ.get("PORT", "8000"))
    # SIGTERM (from a test, or a process manager) unwinds like Ctrl-C: Locust and the server stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compare:
        stages = [resolve(s.strip()) for s in args.compare.split(",")]
        with contextlib.ExitStack() as stack:
            urls = {s: f"http://{host}:{port + i}" for i, s in enumerate(stages)}
            for i, s in enumerate(stages):
                stack.enter_context(server_for(s, host, port + i, args.out))
            with contextlib.suppress(KeyboardInterrupt):
                web_ui(urls[stages[0]], args.web_host, args.web_port, extra, compare=urls)
        return
    with server_for(stage, host, port, args.out) as pid:
        url = f"http://{host}:{port}"
        if args.headless:
            headless(stage, url, args.profile, args.duration, pid, args.out, args.endpoint)
        else:
            with contextlib.suppress(KeyboardInterrupt):
                web_ui(url, args.web_host, args.web_port, extra)


if __name__ == "__main__":
    main()
