"""Stage 5's pure parts: the window's arithmetic, the savings estimate, the log formats."""

from __future__ import annotations

import json
import logging

from common.engine import Engine
from stage5_metrics.logs import JsonFormatter, TextFormatter
from stage5_metrics.savings import CostModel
from stage5_metrics.window import Window, bucket_of, percentile


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_percentiles_are_within_ten_percent() -> None:
    latencies = [float(ms) for ms in range(1, 1001)]  # 1 .. 1000 ms
    histogram: dict[int, int] = {}
    for ms in latencies:
        histogram[bucket_of(ms)] = histogram.get(bucket_of(ms), 0) + 1
    for q, exact in ((0.5, 500.0), (0.95, 950.0), (0.99, 990.0)):
        got = percentile(histogram, q)
        assert got is not None and exact <= got <= exact * 1.1
    assert percentile({}, 0.5) is None


def test_last_minute_forgets_and_since_start_remembers() -> None:
    clock = Clock()
    window = Window(keep_s=120, clock=clock)
    for _ in range(10):
        window.record_request(200, 5.0, texts=2, tokens=20, cache_hits=1, cache_misses=1, queue_ms=1.0)
    window.record_batch(8, 160, 120, "medium", 20.0, saved_ms=30.0, queue_depth=5)
    clock.now += 90  # older than a minute, still inside keep_s
    window.record_request(503, 1.0)
    minute, since = window.summary(60), window.summary(None)
    assert minute["requests"] == 1 and minute["rejections"]["overload"] == 1 and minute["texts"] == 0
    assert since["requests"] == 11 and since["texts"] == 20 and since["tokens"] == 200
    clock.now += 600  # every slot expired into the running total: since-start still has it all
    window.record_request(200, 2.0, texts=1, tokens=5)
    since = window.summary(None)
    assert since["requests"] == 12 and since["texts"] == 21
    assert since["cache"] == {"hits": 10, "misses": 10, "hit_rate": 0.5}
    assert since["batches"]["count"] == 1 and since["batches"]["size_distribution"] == {"8": 1}
    assert since["batches"]["tiers"] == {"low": 0, "medium": 1, "high": 0}
    assert since["batches"]["padding_ratio"] == 0.25
    assert since["savings"]["model_s_spent"] == 0.02 and since["savings"]["model_s_saved_by_batching"] == 0.03
    assert since["savings"]["saved_fraction"] == 0.6
    assert since["queue_ms_mean"] == 1.0
    assert window.summary(60)["requests"] == 1


def test_series_points_cover_the_window() -> None:
    clock = Clock(1_000_000.0)
    window = Window(clock=clock)
    assert len(window.series(seconds=300, step=5)) == 1  # just started: one point
    clock.now += 400
    for _ in range(10):
        window.record_request(200, 4.0, texts=1, tokens=10, cache_hits=1)
    window.record_batch(2, 20, 20, "low", 3.0, 1.0, queue_depth=0)
    series = window.series(seconds=300, step=5)
    assert len(series) == 60
    assert [p["t"] for p in series] == sorted(p["t"] for p in series)
    last, empty = series[-1], series[0]
    assert last["requests_per_s"] > 0 and last["hit_rate"] == 1.0 and last["avg_batch"] == 2.0
    assert last["queue_depth_max"] == 0
    assert empty["requests_per_s"] == 0 and empty["p50_ms"] is None and empty["queue_depth_max"] is None


def test_cost_model_is_measured_and_monotonic(engine: Engine) -> None:
    cost = CostModel.measure(engine, repeats=3)
    assert cost.tokens == sorted(cost.tokens) and cost.tokens[0] >= 3
    assert cost.ms == sorted(cost.ms) and cost.ms[0] > 0
    assert cost.alone_ms(10) <= cost.alone_ms(200)
    # A batch of eight saves eight lone calls minus what it took; a batch of one saves nothing.
    alone = cost.alone_ms(16)
    assert cost.batch_saved_ms(8, 8 * 16, alone * 2) == 8 * alone - alone * 2
    assert cost.batch_saved_ms(1, 16, alone) == 0.0


def test_cost_model_follows_the_machine() -> None:
    cost = CostModel([(4, 1.0), (64, 4.0)])
    for _ in range(60):  # lone calls now take twice the calibrated time
        cost.batch_saved_ms(1, 64, 8.0)
    assert 7.5 < cost.alone_ms(64) <= 8.0


def _record(**fields: object) -> logging.LogRecord:
    record = logging.makeLogRecord({"name": "embedserve.requests", "levelname": "INFO", "msg": "request"})
    record.fields = fields
    return record


def test_log_formats() -> None:
    line = json.loads(JsonFormatter().format(_record(request_id="r1", status=200, queue_ms=None)))
    assert line["msg"] == "request" and line["level"] == "info" and line["logger"] == "embedserve.requests"
    assert line["request_id"] == "r1" and line["status"] == 200 and line["queue_ms"] is None
    text = TextFormatter().format(_record(request_id="r1", status=200, queue_ms=None))
    assert text.endswith("INFO request request_id=r1 status=200")


def test_metrics_reference_is_current() -> None:
    """docs/results/stage5_metrics.md is what the registry exposes (rerun the module if not)."""
    from stage5_metrics import reference

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
        "process_cpu_seconds_total",
    ):
        assert f"`{name}`" in reference.markdown()


def test_prometheus_rules_name_real_metrics() -> None:
    """The scrape config and recording rules the chapter shows parse, and name metrics that exist."""
    import re

    import yaml

    from stage5_metrics import reference

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


def test_request_log_lines_in_both_formats() -> None:
    """The request line's fast path writes what the formatters would: valid JSON, or key=value text."""
    import io

    from common.settings import Settings
    from stage5_metrics.logs import RequestLog, RequestRecord

    record = RequestRecord("rid-1", texts=2, tokens=17, cache_hits=1, cache_misses=1, queue_ms=0.5)
    for fmt in ("json", "text"):
        log = RequestLog(Settings(log_format=fmt))
        log.handler = logging.StreamHandler(io.StringIO())
        log.write(logging.INFO, "POST", "/v1/embed", 200, record, 12.3456)  # no event loop: written at once
        log.write(logging.WARNING, 'GE"T', "unmatched", 503, RequestRecord("rid-2"), 1.0)
        first, second = log.handler.stream.getvalue().splitlines()
        if fmt == "json":
            line = json.loads(first)
            assert list(line)[:4] == ["ts", "level", "logger", "msg"]
            assert line["request_id"] == "rid-1" and line["status"] == 200 and line["tokens"] == 17
            assert line["queue_ms"] == 0.5 and line["inference_ms"] is None and line["total_ms"] == 12.346
            odd = json.loads(second)  # an odd method token cannot break the JSON
            assert odd["method"] == "OTHER" and odd["level"] == "warning" and odd["texts"] == 0
        else:
            assert " INFO request request_id=rid-1 method=POST route=/v1/embed status=200 texts=2" in first
            assert first.endswith("total_ms=12.346") and "inference_ms=null" in first
            assert " WARNING request request_id=rid-2" in second
    quiet = RequestLog(Settings(log_level="WARNING"))  # LOG_LEVEL=WARNING: no request lines
    assert not quiet.enabled(logging.INFO) and quiet.enabled(logging.WARNING)
    RequestLog(Settings())  # leave the process's logging as the settings' defaults have it
