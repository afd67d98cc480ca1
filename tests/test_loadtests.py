"""The load-test tools end to end: Locust against real servers, `make compare` in its quick form.

Timings on a shared 2-core machine are noise, so these tests check completeness (every stage,
every profile, every figure present and positive) and that the words agree with the ratios, never
speed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from common.serve import available_stages
from loadtests import load
from loadtests.load import post_bodies
from tests.conftest import REPO, free_port

USER_CLASSES = (
    "UniqueTextUser",
    "RepeatedTextUser",
    "WaveUser",
    "MixedLengthUser",
    "OverloadUser",
    "ThinkingUser",
)


def _locust(
    host: str | None, prefix: Path, seconds: int, users: int, *args: str, env: dict[str, str] | None = None
) -> list[dict]:
    """A headless Locust run; ``host`` None: each user class's own (a --host would override them)."""
    command = [
        sys.executable, "-m", "locust", "-f", "loadtests/locustfile.py", "--headless",
        *(("--host", host) if host else ()),
        "-u", str(users), "-r", str(users), "-t", f"{seconds}s", "--reset-stats", "--only-summary",
        "--json-file", str(prefix), "--run-report", f"{prefix}_report.json", "--exit-code-on-error", "0",
        *args,
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=seconds + 60)
    assert done.returncode == 0, done.stdout + done.stderr
    return list(json.loads(Path(f"{prefix}.json").read_text()))


# --- pure helpers -----------------------------------------------------------------
# --- the locustfile against a real server -----------------------------------------
@pytest.fixture(scope="module")
def stage_url(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from tests.conftest import run_server

    with run_server(available_stages()[-1], tmp_path_factory.mktemp("srv")) as server:
        yield server.url


def test_every_user_class_sends_valid_requests(stage_url: str, tmp_path: Path) -> None:
    entries = _locust(stage_url, tmp_path / "all", 3, len(USER_CLASSES), "--wave-period", "0.5")
    by_name = {e["name"]: e for e in entries}
    for cls in USER_CLASSES:
        entry = by_name[f"/v1/embed {cls}"]
        assert entry["num_requests"] > 0, cls
        assert entry["num_failures"] == 0, cls
    report = json.loads((tmp_path / "all_report.json").read_text())
    assert report["errors"] == {}
    assert report["wall_s"] > 0 and report["cpu_s"] > 0


def test_openai_endpoint_option(stage_url: str, tmp_path: Path) -> None:
    entries = _locust(
        stage_url, tmp_path / "oai", 2, 2, "--endpoint", "/v1/embeddings", "--texts-per-request", "3",
        "UniqueTextUser",
    )  # fmt: skip
    (entry,) = entries
    assert entry["name"] == "/v1/embeddings UniqueTextUser"
    assert entry["num_requests"] > 0 and entry["num_failures"] == 0


def test_the_api_key_comes_from_the_environment(tmp_path: Path) -> None:
    """Against a server started with API_KEY, Locust sends the first key of the same variable."""
    from tests.conftest import run_server

    with run_server("stage1_naive", tmp_path, {"API_KEY": "k-one, k-two"}) as server:
        env = {**os.environ, "API_KEY": "k-one, k-two"}
        ok = _locust(server.url, tmp_path / "ok", 2, 2, "UniqueTextUser", env=env)
        wrong = _locust(server.url, tmp_path / "no", 2, 2, "--api-key", "nope", "UniqueTextUser", env=env)
    assert ok[0]["num_requests"] > 0 and ok[0]["num_failures"] == 0
    assert wrong[0]["num_requests"] > 0 and wrong[0]["num_failures"] == wrong[0]["num_requests"]
    assert list(json.loads((tmp_path / "no_report.json").read_text())["errors"]) == ["HTTP 401"]


def test_two_stages_side_by_side_each_in_its_own_rows(tmp_path: Path) -> None:
    """`make loadtest COMPARE=2,3`'s locustfile: a user class per stage, each sending to its own
    server, so one Locust run (the web UI's, here headless) reports each stage in its own row."""
    from tests.conftest import run_server

    with (
        run_server("stage2_threadpool", tmp_path / "2") as two,
        run_server("stage3_batching", tmp_path / "3") as three,
    ):
        env = {**os.environ, "EMBEDSERVE_COMPARE": f"stage2_threadpool={two.url},stage3_batching={three.url}"}
        entries = _locust(None, tmp_path / "both", 3, 4, "Stage2User", "Stage3User", env=env)
        batched = httpx.get(f"{three.url}/v1/batcher/metrics").json()["texts"]
    by_name = {e["name"]: e for e in entries}
    assert set(by_name) == {"/v1/embed stage2_threadpool", "/v1/embed stage3_batching"}
    for entry in by_name.values():
        assert entry["num_requests"] > 0 and entry["num_failures"] == 0, by_name
    # stage 3's own count: its user class, and only it, sent to stage 3's server (one text a request;
    # Locust leaves out what its 2 users had in flight when it reset or stopped its statistics)
    sent_to_three, sent_to_two = (
        by_name[f"/v1/embed {s}"]["num_requests"] for s in ("stage3_batching", "stage2_threadpool")
    )
    assert 0 <= batched - sent_to_three <= 4 < sent_to_two, (batched, sent_to_three, sent_to_two)


def test_a_wrong_vector_count_is_a_failure(tmp_path: Path) -> None:
    """The cheap body check must catch a server that drops a vector: aim Locust at one that does."""
    port = free_port()
    script = (
        "import http.server, json\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_POST(self):\n"
        "        n = json.loads(self.rfile.read(int(self.headers['Content-Length'])))['inputs']\n"
        "        vectors = [[0.0, 1.0]] * (len(n) - 1)  # compact JSON, as the servers write it\n"
        "        body = json.dumps({'embeddings': vectors}, separators=(',', ':')).encode()\n"
        "        self.send_response(200); self.send_header('Content-Length', str(len(body)))\n"
        "        self.end_headers(); self.wfile.write(body)\n"
        "    def log_message(self, *a): pass\n"
        f"http.server.ThreadingHTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    server = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "stub server did not start"
                time.sleep(0.1)
        entries = _locust(
            f"http://127.0.0.1:{port}", tmp_path / "bad", 2, 1, "--texts-per-request", "3", "UniqueTextUser"
        )
    finally:
        server.terminate()
        server.wait()
    (entry,) = entries
    assert entry["num_requests"] > 0 and entry["num_failures"] == entry["num_requests"]
    report = json.loads((tmp_path / "bad_report.json").read_text())
    assert list(report["errors"]) == ["expected 3 vectors, got 2"]


# --- make loadtest (web UI) and make loadtest HEADLESS=1 -------------------------------
def test_make_loadtest_starts_the_stage_and_serves_the_web_ui(tmp_path: Path) -> None:
    stage, port, web = available_stages()[-1], free_port(), free_port()
    env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(port)}
    log = (tmp_path / "run.log").open("wb")
    run = subprocess.Popen(
        [sys.executable, "-m", "loadtests.run", "--stage", stage, "--web-port", str(web),
         "--out", str(tmp_path)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    ui = f"http://127.0.0.1:{web}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert run.poll() is None, (tmp_path / "run.log").read_text()
            try:
                page = httpx.get(ui, timeout=2)
                if page.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "web UI did not come up"
            time.sleep(0.5)
        # The custom options are part of the UI's form, and the class picker lists every workload.
        for option in ("unique_ratio", "endpoint", "wave_period", "texts_per_request"):
            assert option in page.text, option
        assert "run_report" not in page.text
        for cls in USER_CLASSES:
            assert cls in page.text, cls
        started = httpx.post(
            f"{ui}/swarm",
            data={"user_count": 2, "spawn_rate": 2, "host": f"http://127.0.0.1:{port}",
                  "user_classes": "RepeatedTextUser", "unique_ratio": "0.5"},
        )  # fmt: skip
        assert started.json()["success"] is True
        deadline = time.monotonic() + 30
        while True:
            stats = httpx.get(f"{ui}/stats/requests").json()
            total = next(s for s in stats["stats"] if s["name"] == "Aggregated")
            if total["num_requests"] >= 5:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.5)
        assert total["num_failures"] == 0
        httpx.post(f"{ui}/stop")
    finally:
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
        log.close()
    # Started by `make loadtest`, so stopped with it.
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_make_loadtest_headless_writes_csv_and_json(tmp_path: Path) -> None:
    stage, port = available_stages()[-1], free_port()
    env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(port)}
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.run", "--stage", stage, "--headless", "--profile", "unique-8",
         "--duration", "2", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (summary_path,) = tmp_path.glob(f"{stage}-unique-8-*_summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["stage"] == stage and summary["requests"] > 0 and summary["rps"] > 0
    assert summary["failures"] == {"503": 0, "other": 0}
    assert summary["stamp"]["machine"]["logical_cores"] > 0 and summary["stamp"]["commit"]
    assert list(tmp_path.glob(f"{stage}-unique-8-*_stats_history.csv"))
    # The percentiles are Locust's own over the whole run: what locust.stats makes of the response
    # times in its final JSON (asked in a subprocess: locust patches the standard library on import)
    (raw,) = tmp_path.glob(f"{stage}-unique-8-*Z.json")
    code = (
        "import json, sys\n"
        "from locust.stats import calculate_response_time_percentile as p\n"
        "times = {}\n"
        "for e in json.load(open(sys.argv[1])):\n"
        "    for ms, n in e['response_times'].items(): times[float(ms)] = times.get(float(ms), 0) + n\n"
        "print(json.dumps([p(times, sum(times.values()), q) for q in (0.5, 0.95, 0.99)]))\n"
    )
    ask = [sys.executable, "-c", code, str(raw)]
    locust = subprocess.run(ask, capture_output=True, text=True, check=True)
    assert [summary[f"p{q}_ms"] for q in (50, 95, 99)] == json.loads(locust.stdout)
    # Locust keeps a time of 100 ms or more rounded to two significant digits (126.2 ms is 130),
    # so its p99 may sit above the exact maximum by that rounding, never by more
    top = summary["max_ms"]
    binned = round(top) if top < 100 else round(top, -len(str(int(top))) + 2)
    assert 0 < summary["p50_ms"] <= summary["p99_ms"] <= binned, (summary["p99_ms"], top)


def test_headless_against_a_running_server_measures_its_cpu(stage_url: str, tmp_path: Path) -> None:
    """A server this command did not start: its process is found by its port, and its CPU counted."""
    port = int(stage_url.rsplit(":", 1)[1])
    env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(port)}
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.run", "--stage", available_stages()[-1], "--headless",
         "--profile", "unique-8", "--duration", "2", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "using the server already answering" in done.stdout and "not visible" not in done.stdout
    (summary_path,) = tmp_path.glob("*_summary.json")
    assert json.loads(summary_path.read_text())["server_cores"] > 0.01


# --- make compare, quick ----------------------------------------------------------
def test_screenshots(tmp_path: Path) -> None:
    """`make results ONLY=screenshots`, short: Locust's start form, charts and table, and the
    dashboard under that load, as PNGs, with the captions the chapters include."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.screenshots", "--users", "4", "--seconds", "4",
         "--img", str(tmp_path), "--results", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("locust_start", "locust_charts", "locust_statistics", "dashboard"):
        data = (tmp_path / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    result = json.loads((tmp_path / "screenshots.json").read_text())
    assert result["requests"] > 0 and result["failures"] == 0, result
    captions = (tmp_path / "screenshots.md").read_text()
    assert "[end:locust]" in captions and "[end:dashboard]" in captions


def test_bench_suite_runs_once(tmp_path: Path) -> None:
    """`make bench` with timing off: every microbenchmark runs once, so none can rot."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks", "-o", "python_files=bench_*.py",
         "-o", "python_functions=bench_*", "-p", "no:cacheprovider", "-q", "--benchmark-disable",
         f"--basetemp={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout


WRK_REPORT = """Running 2s test @ http://127.0.0.1:8000
  1 threads and 128 connections
  Latency Distribution
     50%  596.16ms
     75%  625.20ms
     90%  987.40ms
     99%    1.02s{pad}
  630 requests in 2.03s, 2.98MB read
  Socket errors: connect 0, read 0, write 0, timeout 3
  Non-2xx or 3xx responses: 30
""".format(pad=" ")


def test_wrk_report_is_read_with_seconds_and_errors() -> None:
    point = load.parse(WRK_REPORT, 128, 2)
    assert point["p50_ms"] == 596.16 and point["p99_ms"] == 1020.0  # "1.02s " ends in a pad
    assert point["requests_per_s"] == 300.0 and point["non_2xx_per_s"] == 15.0
    assert point["socket_errors"] == 3


def test_post_bodies_sends_each_body_once_or_for_a_while(stage_url: str) -> None:
    run = os.urandom(4).hex()  # texts no earlier run left in a shared cache
    bodies = [orjson.dumps({"inputs": [f"post bodies test {run} {i}"]}) for i in range(6)]
    once = asyncio.run(post_bodies(stage_url, bodies + bodies[:2], clients=1))
    assert [a.status for a in once] == [200] * 8
    assert [a.headers["x-cache"] for a in once] == ["miss"] * 6 + ["hit"] * 2  # in order, each once
    timed = asyncio.run(post_bodies(stage_url, bodies, clients=2, seconds=0.5, keep_alive=False))
    assert len(timed) > len(bodies) and all(a.status == 200 and a.ms > 0 for a in timed)


def test_locust_sends_the_given_bodies_and_answers_what_wrk_answers(stage_url: str) -> None:
    """``load.locust`` (what `make compare` runs): the Locust file's BodiesUser sends exactly the
    bodies it is given (a stage 5 cache has them afterwards), with wrk's figures and its own CPU."""
    run = os.urandom(4).hex()
    bodies = [orjson.dumps({"inputs": [f"locust bodies {run} {i}"]}) for i in range(5)]
    point = load.locust(stage_url, bodies, 2, 1.0)
    again = asyncio.run(post_bodies(stage_url, bodies, clients=1))
    assert [a.headers["x-cache"] for a in again] == ["hit"] * 5  # every one was sent
    other = asyncio.run(post_bodies(stage_url, [orjson.dumps({"inputs": [f"not sent {run}"]})], clients=1))
    assert other[0].headers["x-cache"] == "miss"
    assert point["requests_per_s"] > 0 and point["socket_errors"] == 0 and point["non_2xx_per_s"] == 0
    # Locust keeps whole milliseconds under 100 ms: cache hits on a fast machine can read 0
    assert 0 <= point["p50_ms"] <= point["p99_ms"] and point["window_s"] > 0
    assert point["load_generator_cpu"] > 0 and point["server_cpu_s"] is None  # no pid named
    assert set(point) == set(load.wrk(stage_url, bodies, 2, 1.0))
