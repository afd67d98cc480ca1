"""Stage 5 against a real server: /metrics after known traffic, the JSON views, the request log."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import Server, run_server
from exercise_pieces import stage5
from prometheus_client.parser import text_string_to_metric_families
from tenacity import AsyncRetrying, stop_after_delay, wait_fixed

from common.engine import Engine
from stage5_metrics.savings import CostModel

STAGE = stage5()  # stage5_metrics; with EXERCISE=1 yours, exercises.stage5_metrics
SECRET = "PRIVATE-TEXT-7f3a"  # must never reach a log line or a metric


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(
        STAGE, tmp_path_factory.mktemp("stage5"), {"LOG_FORMAT": "json", "LOG_LEVEL": "INFO"}
    ) as s:
        yield s


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def unique(tag: str, n: int) -> list[str]:
    return [f"{tag} {i} {time.monotonic_ns()} the quick brown fox jumps over the lazy dog" for i in range(n)]


def log_lines(server: Server) -> list[dict[str, Any]]:
    lines = []
    for line in server.log().splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def test_scrape_counts_known_traffic(server: Server, engine: Engine) -> None:
    before = scrape(server.url)
    embed_texts = [unique(f"scrape{i}", 2) for i in range(3)]
    openai_text = unique("scrape-openai", 1)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for texts in embed_texts:
            assert client.post("/v1/embed", json={"inputs": texts}).status_code == 200
        assert client.post("/v1/embeddings", json={"input": openai_text[0]}).status_code == 200
        # A repeat of one text answered from the memory tier, and one bad request.
        hit = client.post("/v1/embed", json={"inputs": [embed_texts[0][0]]})
        assert hit.headers["x-cache"] == "hit"
        assert client.post("/v1/embed", json={"inputs": []}).status_code == 422
    after = scrape(server.url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    computed = [t for texts in embed_texts for t in texts] + openai_text
    assert delta("embedserve_requests_total", route="/v1/embed", status="200") == 4
    assert delta("embedserve_requests_total", route="/v1/embed", status="422") == 1
    assert delta("embedserve_requests_total", route="/v1/embeddings", status="200") == 1
    assert delta("embedserve_request_duration_seconds_count", route="/v1/embed") == 5
    assert delta("embedserve_texts_total") == len(computed) + 1
    tokens = sum(t.n_tokens for t in engine.tokenize([*computed, embed_texts[0][0]]))
    assert delta("embedserve_tokens_total") == tokens
    assert delta("embedserve_cache_hits_total", tier="memory") == 1
    assert delta("embedserve_cache_misses_total", tier="memory") == len(computed)
    # Batch metrics: once per batch, and the batches hold exactly the computed texts.
    batches = total(after, "embedserve_batches_total") - total(before, "embedserve_batches_total")
    assert 1 <= batches <= len(computed)
    assert delta("embedserve_batch_size_texts_count") == batches
    assert delta("embedserve_batch_size_texts_sum") == len(computed)
    assert delta("embedserve_batch_padding_ratio_count") == batches
    assert delta("embedserve_batch_inference_seconds_count") == batches
    real = sum(t.n_tokens for t in engine.tokenize(computed))
    assert delta("embedserve_batch_tokens_sum") >= real
    # Queue time: the four requests that reached the model, not the cache hit or the 422.
    assert delta("embedserve_queue_wait_seconds_count") == 4
    # The state gauges and the process defaults are there.
    assert value(after, "embedserve_queue_depth_texts") == 0
    assert value(after, "embedserve_batches_in_flight") == 0
    assert sum(value(after, "embedserve_load_tier", tier=t) for t in ("low", "medium", "high")) == 1
    assert total(after, "process_cpu_seconds_total") > 0
    assert any(name == "python_info" for name, _ in after)


def test_labels_are_bounded(server: Server) -> None:
    rid = "cardinality-check-1234"
    with httpx.Client(base_url=server.url, timeout=60) as client:
        client.post("/v1/embed", json={"inputs": [SECRET]}, headers={"x-request-id": rid})
        for path in ("/no/such/route/1", "/no/such/route/2", f"/{SECRET}"):
            assert client.get(path).status_code == 404
    text = httpx.get(f"{server.url}/metrics").text
    assert rid not in text and SECRET not in text and "/no/such" not in text
    samples = scrape(server.url)
    assert value(samples, "embedserve_requests_total", route="unmatched", status="404") >= 3
    for (name, labels), _ in samples.items():
        if name.startswith("embedserve_"):
            assert set(dict(labels)) <= {
                "route",
                "status",
                "tier",
                "reason",
                "kind",
                "le",
                "model",
                "dimensions",
                "slot",
                "by",
            }
    routes = {dict(labels).get("route") for (name, labels) in samples if name == "embedserve_requests_total"}
    assert routes <= {
        "/v1/embed",
        "/v1/embeddings",
        "/metrics",
        "/v1/metrics",
        "/v1/dashboard",
        "/health",
        "/ready",
        "/dashboard",
        "/dashboard/static",
        "/v1/models",
        "unmatched",
    }


def test_deadline_rejection_is_counted(server: Server) -> None:
    before = scrape(server.url)
    response = httpx.post(
        f"{server.url}/v1/embed",
        json={"inputs": unique("deadline", 1)},
        headers={"x-request-timeout": "0.000001"},
    )
    assert response.status_code == 504
    after = scrape(server.url)
    assert (
        value(after, "embedserve_rejected_requests_total", reason="deadline")
        - value(before, "embedserve_rejected_requests_total", reason="deadline")
        == 1
    )
    assert (
        value(after, "embedserve_requests_total", route="/v1/embed", status="504")
        - value(before, "embedserve_requests_total", route="/v1/embed", status="504")
        == 1
    )


def test_json_views_after_traffic(server: Server) -> None:
    """/v1/metrics is one reading of the registry's running totals (embedding routes only: the views'
    own polls do not count), with the queue now; /v1/dashboard adds a reading a 5-second step."""
    start = httpx.get(f"{server.url}/v1/metrics").json()
    repeated = unique("json-view", 3)

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            bodies = [{"inputs": [repeated[i % 3], *unique(f"burst{i}", 2)]} for i in range(24)]
            answers = await asyncio.gather(*(client.post("/v1/embed", json=b) for b in bodies))
            return [a.status_code for a in answers]

    warm = httpx.post(f"{server.url}/v1/embed", json={"inputs": repeated}, timeout=60)  # later: hits
    assert warm.status_code == 200
    assert asyncio.run(burst()) == [200] * 24
    metrics = httpx.get(f"{server.url}/v1/metrics").json()
    dashboard = httpx.get(f"{server.url}/v1/dashboard").json()
    for payload in (metrics, dashboard):
        assert set(payload) >= {"model", "started", "uptime_s", "now", "reading"}
    before, after = start["reading"]["values"], metrics["reading"]["values"]

    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("requests_total 200") == 1 + 24  # warm + burst; the polls of the views do not count
    assert grew("texts_total") == 3 + 72
    # 24 repeats of three texts, computed by the warm-up: cache hits, never computed again
    assert grew("cache_hits_total memory") + grew("deduplicated_texts_total") == 24
    assert grew("cache_hits_total memory") > 0
    assert grew("batch_size_texts_count") == sum(
        grew(f"batches_total {t}") for t in ("low", "medium", "high")
    )
    assert grew("batch_inference_seconds_sum") > 0
    latency = metrics["reading"]["latency"]
    assert latency["+Inf"] - start["reading"]["latency"].get("+Inf", 0.0) == 25
    assert metrics["now"]["queue_depth"] == 0 and metrics["now"]["tier"] == "low"
    assert dashboard["step_s"] == 5 and len(dashboard["readings"]) <= 61
    assert all(
        b["at"] - a["at"] == pytest.approx(5, abs=1) for a, b in itertools.pairwise(dashboard["readings"])
    )
    assert dashboard["cost_model"]["token_ms"] > 0


def test_the_cache_saving_is_its_hits_priced_as_calls_of_their_own(server: Server) -> None:
    """A request answered from the cache adds its hits times a call of its mean length, as the
    server priced one at start, and nothing else counts as saved (batching's is not estimated)."""
    texts = unique("saving", 3)
    assert httpx.post(f"{server.url}/v1/embed", json={"inputs": texts}, timeout=60).status_code == 200
    before = scrape(server.url)
    assert httpx.post(f"{server.url}/v1/embed", json={"inputs": texts}, timeout=60).status_code == 200
    after = scrape(server.url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("embedserve_cache_hits_total", tier="memory") == 3
    tokens = delta("embedserve_tokens_total")
    call_ms = CostModel(**httpx.get(f"{server.url}/v1/dashboard").json()["cost_model"]).call_ms(tokens / 3)
    saved = "embedserve_cache_saved_model_seconds_total"
    assert delta(saved) == pytest.approx(3 * call_ms / 1e3, rel=1e-3) and delta(saved) > 0
    assert [name for name, _ in after if "saved" in name] == [saved]


def test_request_log_lines(server: Server, engine: Engine) -> None:
    texts = [f"{SECRET} first", "a second text for the log test"]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        given = client.post("/v1/embed", json={"inputs": texts}, headers={"X-Request-ID": "log-test-given-1"})
        generated = client.post("/v1/embed", json={"inputs": [f"{SECRET} again"]})
        invalid = client.post(
            "/v1/embed", json={"inputs": ["x"]}, headers={"X-Request-ID": "bad id\twith tab"}
        )
        bad = client.post("/v1/embed", json={"inputs": [SECRET, 3]}, headers={"X-Request-ID": "log-test-422"})
    assert given.headers["x-request-id"] == "log-test-given-1"
    assert re.fullmatch(r"[0-9a-f]{32}", generated.headers["x-request-id"])
    assert re.fullmatch(r"[0-9a-f]{32}", invalid.headers["x-request-id"])
    assert bad.status_code == 422 and bad.headers["x-request-id"] == "log-test-422"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "log-test-422" not in server.log():
        time.sleep(0.05)
    lines = {line["request_id"]: line for line in log_lines(server) if "request_id" in line}
    assert [line.get("request_id") for line in log_lines(server)].count("log-test-given-1") == 1
    line = lines["log-test-given-1"]
    assert line["msg"] == "request" and line["level"] == "info" and line["method"] == "POST"
    assert line["route"] == "/v1/embed" and line["status"] == 200
    assert line["texts"] == 2 and line["tokens"] == sum(t.n_tokens for t in engine.tokenize(texts))
    assert line["cache_hits"] == 0 and line["cache_misses"] == 2
    assert line["queue_ms"] >= 0 and line["inference_ms"] > 0
    assert line["total_ms"] >= line["inference_ms"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["ts"])
    assert lines[generated.headers["x-request-id"]]["texts"] == 1
    assert lines[invalid.headers["x-request-id"]]["status"] == 200
    assert lines["log-test-422"]["status"] == 422 and lines["log-test-422"]["queue_ms"] is None
    assert SECRET not in server.log()


def test_uvicorn_lines_are_json_too(server: Server) -> None:
    """One format for the whole stream: uvicorn's own lines are JSON lines like the request lines."""
    lines = [line for line in server.log().splitlines() if line.strip()]
    launcher = [line for line in lines if not line.startswith("{")]
    assert len(launcher) == 1 and "listening on" in launcher[0]  # common.serve's print, on stdout
    parsed = [json.loads(line) for line in lines if line.startswith("{")]
    messages = {line["msg"] for line in parsed if line["logger"].startswith("uvicorn")}
    assert any(m.startswith("Started server process") for m in messages)
    assert any(m.startswith("Uvicorn running on") for m in messages)
    assert all(line["level"] in ("debug", "info", "warning", "error") and "ts" in line for line in parsed)


def test_the_textbook_batcher_counts_its_batches_under_no_tier(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """BATCHER=textbook in stage 5: its batches have no load tier, and count as tier "none"."""
    with run_server(STAGE, tmp_path_factory.mktemp("textbook"), {"BATCHER": "textbook"}) as srv:
        before = total(scrape(srv.url), "embedserve_batches_total")
        response = httpx.post(f"{srv.url}/v1/embed", json={"inputs": ["one batch, no tier"]}, timeout=60)
        assert response.status_code == 200, response.text
        samples = scrape(srv.url)
    assert value(samples, "embedserve_batches_total", tier="none") == 1
    assert total(samples, "embedserve_batches_total") - before == 1


def test_text_logs_for_people(tmp_path_factory: pytest.TempPathFactory) -> None:
    """LOG_FORMAT=text: the same lines as `<ts> LEVEL message key=value ...`, uvicorn's included."""
    with run_server(STAGE, tmp_path_factory.mktemp("text-logs"), {"LOG_FORMAT": "text"}) as srv:
        response = httpx.post(f"{srv.url}/v1/embed", json={"inputs": ["a line for people"]}, timeout=60)
        rid = response.headers["x-request-id"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and rid not in srv.log():
            time.sleep(0.05)
        log = srv.log()
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
    assert re.search(rf"^{stamp} INFO Uvicorn running on http://", log, re.MULTILINE)
    line = next(line for line in log.splitlines() if rid in line)
    assert re.fullmatch(
        rf"{stamp} INFO request request_id={rid} method=POST route=/v1/embed status=200 texts=1 tokens=\d+ "
        r"cache_hits=0 cache_misses=1 queue_ms=[\d.]+ inference_ms=[\d.]+ total_ms=[\d.]+",
        line,
    ), line
    assert not any(line.startswith("{") for line in log.splitlines())


def test_overload_and_disconnect_are_counted(tmp_path_factory: pytest.TempPathFactory) -> None:
    """503s and dropped disconnects show up in /metrics exactly as often as clients saw them."""
    long_texts = [" ".join(["overload"] * 200) + f" {i} {time.monotonic_ns()}" for i in range(64)]

    async def flood(url: str) -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            bodies = [{"inputs": long_texts[i % 8 * 8 : i % 8 * 8 + 8]} for i in range(40)]
            answers = await asyncio.gather(
                *(client.post("/v1/embed", json=b, headers={"cache-control": "no-cache"}) for b in bodies)
            )
            return [a.status_code for a in answers]

    async def hang_up(url: str, rid: str) -> None:
        # Long texts keep the request in the model a while; the client leaves once the backend has
        # it (a client that leaves before its body is read is a 499 of the body reader instead).
        body = json.dumps({"inputs": [t * 20 for t in unique("hang-up", 8)], "cache": False}).encode()
        _reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        head = (
            f"POST /v1/embed HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-request-id: {rid}\r\n"
        )
        writer.write(head.encode() + b"content-length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        async with httpx.AsyncClient(base_url=url) as client:
            async for attempt in AsyncRetrying(stop=stop_after_delay(30), wait=wait_fixed(0.002)):
                with attempt:
                    assert (await client.get("/v1/cache/metrics")).json()["active"] == 1
        writer.close()  # gone before the answer
        await writer.wait_closed()

    with run_server(STAGE, tmp_path_factory.mktemp("overload"), {"MAX_QUEUE": "8"}) as srv:
        before = scrape(srv.url)
        statuses = asyncio.run(flood(srv.url))
        assert set(statuses) <= {200, 503} and statuses.count(503) >= 1
        asyncio.run(hang_up(srv.url, "hang-up-request"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and '"hang-up-request"' not in srv.log():
            time.sleep(0.05)
        after = scrape(srv.url)

        def delta(name: str, **labels: str) -> float:
            return value(after, name, **labels) - value(before, name, **labels)

        assert delta("embedserve_requests_total", route="/v1/embed", status="503") == statuses.count(503)
        assert delta("embedserve_rejected_requests_total", reason="overload") == statuses.count(503)
        assert delta("embedserve_requests_total", route="/v1/embed", status="200") == statuses.count(200)
        assert delta("embedserve_rejected_requests_total", reason="disconnect") == 1
        gone = [line for line in log_lines(srv) if line.get("request_id") == "hang-up-request"]
        assert len(gone) == 1 and gone[0]["status"] == 499 and gone[0]["texts"] == 8


def test_answers_before_routing_keep_their_route(server: Server) -> None:
    """A 413 from the body limit never reaches the router; it still counts under /v1/embed."""
    before = scrape(server.url)
    big = b'{"inputs": ["' + b"x" * 2_100_000 + b'"]}'
    response = httpx.post(f"{server.url}/v1/embed", content=big, headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.headers["x-request-id"]
    after = scrape(server.url)
    key = {"route": "/v1/embed", "status": "413"}
    assert (
        value(after, "embedserve_requests_total", **key) - value(before, "embedserve_requests_total", **key)
        == 1
    )


def test_every_request_line_is_written_before_a_sigterm_ends_the_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The log listener's thread writes the lines after their answers; a SIGTERM right after the
    last answer still finds every request's line in the log (the lifespan's end stops the listener,
    which writes what is queued first)."""
    with run_server(STAGE, tmp_path_factory.mktemp("last-lines")) as srv:
        ids = [f"last-line-{i}" for i in range(30)]
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            for rid in ids:
                answer = client.post(
                    "/v1/embed", json={"inputs": [f"text {rid}"]}, headers={"X-Request-ID": rid}
                )
                assert answer.status_code == 200
        srv.process.terminate()  # at once: the last lines may still be queued
        assert srv.process.wait(timeout=60) in (0, -15)
        logged = {
            json.loads(line).get("request_id") for line in srv.log().splitlines() if line.startswith("{")
        }
    assert set(ids) <= logged
