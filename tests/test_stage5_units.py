"""Stage 5's parts without a server: the registry, the window's readings of it, the savings estimate,
the logs, and the backend that counts each request and each batch (the stage 5 exercise's first
check). What the page computes from the readings is tested in the browser (test_stage5_dashboard)."""

from __future__ import annotations

import io
import itertools
import json
import logging
import re
import signal
import time
from collections.abc import Callable, Iterator

import pytest
import yaml
from exercise_pieces import metrics_backend
from prometheus_client import generate_latest

from benchmarks import metrics_reference as reference
from common.backend import EmbedJob
from common.batch_stats import BatchRecord
from common.engine import Engine
from common.limits import APIError
from common.settings import Settings
from stage3_batching.backend import make_batcher
from stage4_cache_backpressure.backend import CacheBackend
from stage5_metrics import backend as stage5_backend
from stage5_metrics.logs import (
    JsonFormatter,
    RequestRecord,
    TextFormatter,
    configure_logging,
    current_record,
    log_request,
    start_logging,
    stop_logging,
)
from stage5_metrics.metrics import Metrics
from stage5_metrics.savings import CostModel
from stage5_metrics.stage_counts import StageCounts
from stage5_metrics.window import Window, read


def test_a_reading_sums_the_embedding_routes_and_the_window_keeps_one_a_step() -> None:
    """A reading holds running totals only (the page computes rates from two); the window keeps the
    one read as each 5-second step began, five minutes of them, with the deepest queue of its step."""
    now = {"t": 1_000_000.0}
    metrics = Metrics()
    depth = {"now": 0}
    metrics.earlier_stages.source = lambda: StageCounts(queue_depth=depth["now"])
    window = Window(metrics, clock=lambda: now["t"])
    window.sample()
    assert list(window.readings) == []  # no step has begun since the start
    for second in range(400):
        now["t"] += 1
        metrics.observe_request("/v1/embed", 200, 0.005)
        metrics.observe_request("/metrics", 200, 5.0)  # another route: not in the page's figures
        depth["now"] = 7 if second == 385 else 1
        window.sample()
    kept = list(window.readings)
    assert len(kept) == 61 and all(b.at - a.at == 5 for a, b in itertools.pairwise(kept))
    last = kept[-1]
    assert last.values["requests_total 200"] == int(last.at - 1_000_000.0) == last.latency["+Inf"]
    assert last.latency["0.005"] == last.latency["+Inf"] and last.latency["0.003"] == 0
    assert max(r.depth_max for r in kept) == 7  # the deepest queue of its step
    assert window.now().as_dict()["values"]["requests_total 200"] == 400


def test_the_earlier_stages_counts_are_exported_by_name() -> None:
    """Every count of stages 3 and 4 is there before the model loads (zeros), with the backend's
    values after."""
    metrics = Metrics()
    names = {s.name for f in metrics.own_families() for s in f.samples}
    for name in ("queue_depth_texts", "cache_hits_total", "rejected_requests_total", "dropped_texts_total"):
        assert f"embedserve_{name}" in names
    metrics.earlier_stages.source = lambda: StageCounts(
        queue_depth=5, tier="medium", rejected={"overload": 2}
    )
    text = generate_latest(metrics.registry).decode()
    assert "embedserve_queue_depth_texts 5.0" in text
    assert 'embedserve_load_tier{tier="medium"} 1.0' in text
    assert 'embedserve_rejected_requests_total{reason="overload"} 2.0' in text


def test_the_call_price_is_fitted_to_real_model_calls(engine: Engine) -> None:
    """The line through lone calls of 8, 64 and 128 tokens: a longer call costs more."""
    cost = CostModel.measure(engine, repeats=3)
    assert cost.token_ms > 0 and cost.overhead_ms >= 0
    assert 0 < cost.call_ms(10) < cost.call_ms(200)


def test_cache_hits_are_priced_as_calls_of_their_own() -> None:
    cost = CostModel(overhead_ms=2.0, token_ms=0.25)
    # Three hits in a request of four texts and 72 tokens: three calls of 18 tokens, 6.5 ms each.
    assert cost.call_ms(18) == 6.5 and cost.cache_saved_ms(3, 4, 72) == 19.5
    assert cost.cache_saved_ms(0, 4, 72) == 0.0
    assert CostModel(overhead_ms=-1.0, token_ms=0.25).call_ms(4) == 1.0  # noise never prices below nothing


def _record(**fields: object) -> logging.LogRecord:
    return logging.makeLogRecord(
        {"name": "embedserve.requests", "levelname": "INFO", "msg": "request", **fields}
    )


def test_log_formats() -> None:
    line = json.loads(JsonFormatter().format(_record(request_id="r1", status=200, queue_ms=None)))
    assert list(line)[:4] == ["ts", "level", "logger", "msg"]
    assert line["msg"] == "request" and line["level"] == "info" and line["logger"] == "embedserve.requests"
    assert line["request_id"] == "r1" and line["status"] == 200 and line["queue_ms"] is None
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["ts"])
    text = TextFormatter().format(_record(request_id="r1", status=200, queue_ms=None))
    assert text.endswith("INFO request request_id=r1 status=200 queue_ms=null")
    # uvicorn's lines: its ANSI-coloured copy of the message is dropped, the message formatted.
    uvicorn = logging.makeLogRecord(
        {"name": "uvicorn.error", "levelname": "INFO", "msg": "Started server process [%d]", "args": (7,)}
    )
    uvicorn.color_message = "\x1b[36m7\x1b[0m"
    assert json.loads(JsonFormatter().format(uvicorn))["msg"] == "Started server process [7]"
    assert "color_message" not in JsonFormatter().format(uvicorn)


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    """The request log's handler, writing to a string for the test, its thread started as the
    lifespan starts it (stopped after, as the lifespan's end stops it). A handler an earlier app of
    this process left (built, never served) goes first, with the lines it queued."""
    stop_logging()
    configure_logging(Settings())
    queued = logging.getLogger("embedserve").handlers[0]
    stream = io.StringIO()
    old = queued.target.setStream(stream)  # type: ignore[attr-defined]
    start_logging()
    yield stream
    stop_logging()
    queued.target.setStream(old)  # type: ignore[attr-defined]


def test_request_lines_in_both_formats(log_stream: io.StringIO) -> None:
    def written(n: int) -> None:  # the listener's thread writes: wait for its n-th line
        deadline = time.monotonic() + 30
        while len(log_stream.getvalue().splitlines()) < n and time.monotonic() < deadline:
            time.sleep(0.005)

    record = RequestRecord("rid-1", texts=2, tokens=17, cache_hits=1, cache_misses=1, queue_ms=0.5)
    for n, fmt in ((2, "json"), (4, "text")):
        configure_logging(Settings(log_format=fmt))
        log_request(logging.INFO, "POST", "/v1/embed", 200, record, 12.3456)
        log_request(logging.WARNING, "GET", "unmatched", 503, RequestRecord("rid-2"), 1.0)
        written(n)  # both lines in this format before the next
    lines = log_stream.getvalue().splitlines()
    assert len(lines) == 4
    first, second = json.loads(lines[0]), json.loads(lines[1])
    assert first["request_id"] == "rid-1" and first["status"] == 200 and first["tokens"] == 17
    assert first["queue_ms"] == 0.5 and first["inference_ms"] is None and first["total_ms"] == 12.346
    assert second["level"] == "warning" and second["texts"] == 0
    assert " INFO request request_id=rid-1 method=POST route=/v1/embed status=200 texts=2" in lines[2]
    assert lines[2].endswith("total_ms=12.346") and "inference_ms=null" in lines[2]
    assert " WARNING request request_id=rid-2" in lines[3]
    configure_logging(Settings(log_level="WARNING"))  # LOG_LEVEL=WARNING: no request lines
    log_request(logging.INFO, "POST", "/v1/embed", 200, record, 1.0)  # returns before a record is made
    assert len(log_stream.getvalue().splitlines()) == 4


def test_an_error_line_keeps_its_traceback_in_a_field_of_its_own(log_stream: io.StringIO) -> None:
    """``msg`` stays the message and the traceback goes to ``exc`` (the standard QueueHandler would
    fold it into the message, and a log search for the message would miss the line)."""
    try:
        raise ZeroDivisionError("division by zero")
    except ZeroDivisionError:
        logging.getLogger("embedserve.test").exception("the batch failed")
    deadline = time.monotonic() + 30
    while not log_stream.getvalue() and time.monotonic() < deadline:  # the listener's thread writes
        time.sleep(0.005)
    line = json.loads(log_stream.getvalue().splitlines()[0])
    assert line["msg"] == "the batch failed" and line["level"] == "error"
    assert line["exc"].startswith("Traceback") and line["exc"].endswith("ZeroDivisionError: division by zero")


def test_metrics_reference_is_current() -> None:
    """docs/results/stage5_metrics.md is what the registry exposes (rerun the module if not)."""
    assert reference.OUT.read_text() == reference.markdown(), "run: python -m benchmarks.metrics_reference"
    for name in (
        "embedserve_requests_total",
        "embedserve_request_duration_seconds",
        "embedserve_queue_wait_seconds",
        "embedserve_batch_inference_seconds",
        "embedserve_batch_size_texts",
        "embedserve_batch_padding_ratio",
        "embedserve_cache_hits_total",
        "embedserve_rejected_requests_total",
        "embedserve_cache_saved_model_seconds_total",
        "process_cpu_seconds_total",
    ):
        assert f"`{name}`" in reference.markdown()


def test_prometheus_rules_name_real_metrics() -> None:
    """The scrape config and recording rules parse, and name metrics that exist."""
    folder = reference.OUT.parents[2] / "stage5_metrics" / "prometheus"
    config = yaml.safe_load((folder / "prometheus.yml").read_text())
    assert config["scrape_configs"][0]["metrics_path"] == "/metrics"
    rules = yaml.safe_load((folder / "rules.yml").read_text())["groups"][0]["rules"]
    exposed = reference.markdown()
    used = {m for rule in rules for m in re.findall(r"embedserve_[a-z_]+", rule["expr"])}
    assert len(used) >= 8
    for name in used:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert f"`{base}`" in exposed, name


# --- stage 5's backend: what a request and a batch record (make exercise STAGE=5 starts here) ---
MetricsBackend = metrics_backend()  # stage 5's; with EXERCISE=1 yours (exercises/stage5_metrics/app.py)


@pytest.fixture
def backend_of(engine: Engine) -> Iterator[Callable[[Metrics], stage5_backend.MetricsBackend]]:
    """A stage 5 backend on the real engine, counting into ``metrics`` (not started). Its start
    chains SIGTERM and SIGINT handlers, as in the server; the test's own are put back after."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    settings = Settings(cache_url=None)
    yield lambda metrics: MetricsBackend(
        CacheBackend(engine, make_batcher(engine, settings), settings, drain_on_signal=True),
        metrics,
        Window(metrics),
    )
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def test_the_backend_counts_each_batch_by_its_on_batch_hook(
    backend_of: Callable[[Metrics], stage5_backend.MetricsBackend],
) -> None:
    """``on_batch``: stage 3's batcher calls it after each model call with the batch's record, and
    the batch is counted once: by tier, its size, its padded tokens and padding, its model time
    in seconds, and a batch whose model call raised as an error."""
    metrics = Metrics()
    backend = backend_of(metrics)
    backend.on_batch(BatchRecord(3, 40, 30, "medium", [1.0, 1.0, 2.0], 20.0, None))
    backend.on_batch(BatchRecord(1, 8, 8, "high", [0.5], 5.0, "RuntimeError"))
    counted = read(metrics, 0.0).values
    assert counted["batches_total medium"] == 1 and counted["batches_total high"] == 1
    assert counted["batches_total low"] == 0 and counted["batch_errors_total"] == 1
    assert counted["batch_size_texts_count"] == 2 and counted["batch_size_texts_sum"] == 4
    assert counted["batch_tokens_sum"] == 48 and counted["batch_padding_tokens_total"] == 10
    assert counted["batch_padding_ratio_sum"] == pytest.approx(0.25)
    assert counted["batch_inference_seconds_sum"] == pytest.approx(0.025)


async def test_the_backend_counts_each_request_and_fills_its_log_record(
    backend_of: Callable[[Metrics], stage5_backend.MetricsBackend], engine: Engine
) -> None:
    """``embed``: stage 4's answer, counted once in the registry from its typed result (texts,
    tokens, queue time when a text reached the model, the model time its cache hits saved), and
    written into the request's log record (``current_record``): the text count first, so a request
    refused with 504 is logged with it too. A request that skipped the cache has no hits, no
    misses and saved nothing."""
    metrics = Metrics()
    backend = backend_of(metrics)
    await backend.start()
    try:
        texts = [f"counted once {time.time_ns()} {i}" for i in range(2)]
        tokens = sum(t.n_tokens for t in engine.tokenize(texts))

        async def embed(name: str, job: EmbedJob) -> RequestRecord:
            record = RequestRecord(name)
            reset = current_record.set(record)  # as the middleware does
            try:
                result = await backend.embed(job)
                assert result.vectors.shape == (len(job.texts), engine.dimensions)
            finally:
                current_record.reset(reset)
            return record

        miss = await embed("miss", EmbedJob(texts=texts))
        counted = read(metrics, 0.0).values
        assert counted["texts_total"] == 2 and counted["tokens_total"] == tokens
        assert counted["queue_wait_seconds_count"] == 1 and counted["cache_saved_model_seconds_total"] == 0
        assert counted["batch_size_texts_sum"] == 2  # the batch of its misses, once (on_batch)
        assert (miss.texts, miss.tokens, miss.cache_hits, miss.cache_misses) == (2, tokens, 0, 2)
        assert miss.queue_ms is not None and miss.inference_ms is not None and miss.inference_ms > 0

        hit = await embed("hit", EmbedJob(texts=texts))
        counted = read(metrics, 0.0).values
        assert counted["texts_total"] == 4 and counted["tokens_total"] == 2 * tokens
        assert counted["queue_wait_seconds_count"] == 1  # no text of it reached the model
        assert backend.cost is not None
        saved = 2 * backend.cost.call_ms(tokens / 2) / 1e3  # two hits, each a call of its own
        assert counted["cache_saved_model_seconds_total"] == pytest.approx(saved)
        assert (hit.texts, hit.tokens, hit.cache_hits, hit.cache_misses) == (2, tokens, 2, 0)
        assert hit.queue_ms is None

        skipped = await embed("skipped", EmbedJob(texts=texts, use_cache=False))
        counted = read(metrics, 0.0).values
        assert counted["texts_total"] == 6 and counted["queue_wait_seconds_count"] == 2
        assert counted["cache_saved_model_seconds_total"] == pytest.approx(saved)
        assert (skipped.texts, skipped.cache_hits, skipped.cache_misses) == (2, 0, 0)

        late = RequestRecord("late")
        reset = current_record.set(late)
        with pytest.raises(APIError) as refused:
            await backend.embed(EmbedJob(texts=[f"too late {time.time_ns()}"], deadline=time.monotonic() - 1))
        current_record.reset(reset)
        assert refused.value.status == 504 and late.texts == 1
        assert read(metrics, 0.0).values["texts_total"] == 6  # texts of answered requests only
    finally:
        await backend.close()
