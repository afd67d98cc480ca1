"""Locust workloads for every server stage: one file, five user classes, options in the web UI.

    make loadtest STAGE=3            # web UI at http://127.0.0.1:8089, pick a user class there
    locust -f loadtests/locustfile.py --headless -u 32 -r 32 -t 20s UniqueTextUser --host http://127.0.0.1:8000

Every text comes from ``common.corpus`` with a seed, so two runs send the same requests. Each
user class is one workload from the lessons:

* ``UniqueTextUser``   every text new: every request is a cache miss (the model's real cost).
* ``RepeatedTextUser`` a fraction ``--unique-ratio`` of texts new, the rest repeats: what a cache sees.
* ``WaveUser``         every user fires at the same instant each ``--wave-period``: bursts, then quiet.
* ``MixedLengthUser``  short queries and long passages together: padding and length grouping.
* ``OverloadUser``     no pause and several texts per request: more than the server can take.

The load generator shares the CPU with the server, so the per-request work here is kept small:
FastHttpUser, bodies built from short templates, and the response checked by counting bytes
rather than parsing 384 floats per text.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from collections.abc import Iterator
from typing import Any

import psutil
from locust import FastHttpUser, between, constant, events, task

from common import corpus
from loadtests.load import process_cpu

ENDPOINTS = ("/v1/embed", "/v1/embeddings")
TEXT_KINDS = ("query", "sentence", "passage", "mixed")

# Users are numbered in spawn order (deterministic in one process), so user i of a run with seed s
# always sends the same texts.
_user_numbers = itertools.count()
# Texts already sent in this process: RepeatedTextUser draws its repeats from here.
_sent: list[str] = []
_SENT_MAX = 50_000


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default="/v1/embed",
        help="Route to load: the native one or the OpenAI-shaped one.",
    )
    parser.add_argument("--seed", type=int, default=1, help="Seed of the texts; a new seed, new texts.")
    parser.add_argument(
        "--text-kind",
        choices=TEXT_KINDS,
        default="sentence",
        help="Length of the texts (MixedLengthUser always sends `mixed`).",
    )
    parser.add_argument("--texts-per-request", type=int, default=1, help="Texts in one request.")
    parser.add_argument(
        "--unique-ratio",
        type=float,
        default=0.333,
        help="RepeatedTextUser: share of texts never sent before (the rest are repeats); make compare's"
        " repeated-32 sends a third new.",
    )
    parser.add_argument(
        "--wave-period",
        type=float,
        default=1.0,
        help="WaveUser: seconds between bursts; a burst is one request from every user.",
    )
    parser.add_argument("--overload-texts", type=int, default=8, help="OverloadUser: texts per request.")
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=0.0,
        help="Send X-Request-Timeout with this many seconds (0: do not send it).",
    )
    parser.add_argument(
        "--api-key",
        default=next((k.strip() for k in os.environ.get("API_KEY", "").split(",") if k.strip()), ""),
        include_in_web_ui=False,
        help="Bearer key for a server started with API_KEY (default: the first key in $API_KEY).",
    )
    parser.add_argument(
        "--server-pid",
        type=int,
        default=0,
        include_in_web_ui=False,
        help="The server's process id: the run report counts its CPU over the measured window.",
    )
    parser.add_argument(
        "--run-report",
        default="",
        include_in_web_ui=False,
        help="Write the measured window, this process's CPU use and failures to a JSON file.",
    )


class _EmbedUser(FastHttpUser):
    """Sends texts to the embedding route and checks status and vector count, nothing more."""

    abstract = True
    wait_time = constant(0)
    text_kind: str | None = None  # None: the --text-kind option
    stage = ""  # the stage this class loads, when the web UI compares stages (names its rows)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        number = next(_user_numbers)
        kind = self.text_kind or opts.text_kind
        # A distinct stream per user: the "(#seed-i)" tag in each text keeps them globally unique.
        self.texts: Iterator[str] = corpus.stream(opts.seed * 100_000 + number, kind)
        self.rng = random.Random(opts.seed * 100_000 + number)
        self.n_texts = opts.texts_per_request
        self.headers = {"X-Request-Timeout": str(opts.request_timeout)} if opts.request_timeout > 0 else {}
        if opts.api_key:
            self.headers["Authorization"] = f"Bearer {opts.api_key}"
        self.openai = opts.endpoint == "/v1/embeddings"
        # One row per user class in Locust's tables, so mixed classes in the web UI stay apart.
        self.request_name = f"{opts.endpoint} {self.stage or type(self).__name__}"

    def next_text(self) -> str:
        return next(self.texts)

    @task
    def embed(self) -> None:
        texts = [self.next_text() for _ in range(self.n_texts)]
        if self.openai:
            path, body, marker = "/v1/embeddings", {"input": texts}, b'"index":'
        else:
            path, body, marker = "/v1/embed", {"inputs": texts}, b"],["
        with self.client.post(
            path,
            data=json.dumps(body),
            headers={**self.headers, "Content-Type": "application/json"},
            catch_response=True,
            name=self.request_name,
        ) as resp:
            if resp.status_code != 200:
                # One failure entry per status: the reports count 503s apart from the rest.
                resp.failure(f"HTTP {resp.status_code}")
                return
            content = resp.content or b""
            # Counting separators costs microseconds; parsing every float would take CPU the server needs.
            got = content.count(marker) + (0 if self.openai else 1)
            if got != len(texts):
                resp.failure(f"expected {len(texts)} vectors, got {got}")


# --8<-- [start:users]
class UniqueTextUser(_EmbedUser):
    """Every text is new: no cache can help."""


class RepeatedTextUser(_EmbedUser):
    """A share ``--unique-ratio`` of texts is new; the rest repeat texts this process already sent."""

    def next_text(self) -> str:
        ratio = self.environment.parsed_options.unique_ratio
        if _sent and self.rng.random() >= ratio:
            return self.rng.choice(_sent)
        text = next(self.texts)
        if len(_sent) < _SENT_MAX:
            _sent.append(text)
        return text


class WaveUser(_EmbedUser):
    """All users fire together at each multiple of ``--wave-period``: a burst of -u requests, then quiet."""

    def wait_time(self) -> float:  # type: ignore[override]
        period: float = self.environment.parsed_options.wave_period
        return period - (time.time() % period)


class MixedLengthUser(_EmbedUser):
    """40% short queries, 45% sentences, 15% long passages, as ``common.corpus.mixed`` draws them."""

    text_kind = "mixed"


class OverloadUser(_EmbedUser):
    """No pause and ``--overload-texts`` texts per request: run it with more users than the server holds."""

    def on_start(self) -> None:
        super().on_start()
        self.n_texts = self.environment.parsed_options.overload_texts


class ThinkingUser(_EmbedUser):
    """A person-like client that pauses 0.5-2 s between requests (for watching the web UI's charts)."""

    wait_time = between(0.5, 2.0)


# --8<-- [end:users]


# `make loadtest COMPARE=3,4`: a user class per stage, each with its own server's URL (``host``), so
# one web UI loads them at once and its statistics show them side by side, a row per stage. The
# launcher (loadtests/run.py) starts the stages and names them here: "stage=url,stage=url".
for _stage, _, _url in (p.partition("=") for p in os.environ.get("EMBEDSERVE_COMPARE", "").split(",") if p):
    _name = "Stage" + _stage.removeprefix("stage").split("_")[0] + "User"  # Stage3User, Stage4User
    globals()[_name] = type(_name, (UniqueTextUser,), {"host": _url, "stage": _stage, "__module__": __name__})


# The measuring kit's user (``loadtests.load.locust``, what `make compare` runs): every user sends
# the next body of the file EMBEDSERVE_BODIES (one JSON body a line, shared by all, round and
# round) the moment its answer comes. The class exists only when the variable is set, so the web
# UI never offers it.
if _bodies_file := os.environ.get("EMBEDSERVE_BODIES"):
    with open(_bodies_file, "rb") as _f:
        _bodies = itertools.cycle(_f.read().splitlines())

    class BodiesUser(FastHttpUser):
        """A closed-loop client of prepared bodies: the same requests for every server compared."""

        wait_time = constant(0)

        @task
        def post(self) -> None:
            headers = {"Content-Type": "application/json"}
            with self.client.post("/v1/embed", data=next(_bodies), headers=headers, catch_response=True) as r:
                if r.status_code != 200:
                    r.failure(f"HTTP {r.status_code}")


# --- the run report: the measured window, the load generator's CPU and the server's -----------
_window: dict[str, float] = {}
PERCENTILES = (0.50, 0.95, 0.99)  # the run report carries these from Locust's stats


def _server_cpu(pid: int) -> float | None:
    """CPU seconds of the server process named by --server-pid and its children (None: none named or seen)."""
    try:
        return process_cpu(psutil.Process(pid)) if pid else None
    except psutil.Error:
        return None


@events.init.add_listener
def _remember(environment: Any, **_: Any) -> None:
    _window["server_pid"] = getattr(environment.parsed_options, "server_pid", 0) or 0


@events.spawning_complete.add_listener
def _window_start(user_count: int, **_: Any) -> None:
    # With --reset-stats Locust restarts its statistics here, so CPU is counted from the same moment.
    _window.update(start_wall=time.time(), start_cpu=time.process_time(), users=user_count)
    if (server := _server_cpu(int(_window["server_pid"]))) is not None:
        _window["start_server_cpu"] = server


@events.test_stop.add_listener
def _window_stop(environment: Any, **_: Any) -> None:
    path = getattr(environment.parsed_options, "run_report", "")
    if not path or "start_wall" not in _window:
        return
    wall = time.time() - _window["start_wall"]
    cpu = time.process_time() - _window["start_cpu"]
    server = _server_cpu(int(_window.get("server_pid", 0)))
    # Locust's final JSON has no failure messages; its error table does (reset with the stats).
    errors: dict[str, int] = {}
    for e in environment.stats.errors.values():
        errors[str(e.error)] = errors.get(str(e.error), 0) + e.occurrences
    total = environment.stats.total  # every request since the reset, Locust's own percentiles
    report = {
        **_window,
        "stop_wall": time.time(),
        "wall_s": wall,
        "cpu_s": cpu,
        "cores": cpu / wall if wall > 0 else 0.0,
        "server_cores": None
        if server is None or "start_server_cpu" not in _window
        else (server - _window["start_server_cpu"]) / wall,
        "requests": total.num_requests,
        "failures": total.num_failures,
        "errors": errors,
        "percentiles_ms": {str(q): total.get_response_time_percentile(q) for q in PERCENTILES},
        "max_ms": total.max_response_time or 0.0,
    }
    with open(path, "w") as f:
        json.dump(report, f)
