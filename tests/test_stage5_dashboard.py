"""The live dashboard in a real headless Chromium (Debian's, driven by Playwright; `make tools`).

The page draws its charts (uPlot, served by the server) from the first answer, fills them as
traffic arrives, draws a pause in traffic as zero, leaves no hole in its grid and wraps no
table cell; its legends show the latest point when no cursor is over a chart, and all of it fits
in a window 1000 px high from 1280 px wide on. The chapter's screenshot is taken by
``benchmarks/screenshots.py`` under Locust's load; this test saves its own picture in a temporary
folder only.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from conftest import Server, run_server
from playwright.sync_api import Browser, Page, sync_playwright

from benchmarks.screenshots import CHROMIUM, CHROMIUM_ARGS
from common import corpus
from loadtests.load import post_bodies
from stage5_metrics.metrics import Metrics
from stage5_metrics.stage_counts import StageCounts
from stage5_metrics.window import Window, read

CHARTS = ("c-throughput", "c-latency", "c-hits", "c-batches", "c-queue", "c-tiers")
TIME_CHARTS = tuple(c for c in CHARTS if c != "c-batches")  # x is time; batches: x is the size


def traffic(url: str, seconds: float, clients: int) -> int:
    """Closed-loop clients for ``seconds`` (sentences, 1 to 6 a request, about a third repeats);
    the requests answered. On a thread of its own: Playwright's sync API holds this thread's loop."""
    rng, fresh = random.Random(5), corpus.stream(int(time.time()), "sentence")
    popular = corpus.texts(12, 77, "sentence")
    bodies = [
        orjson.dumps({"inputs": [rng.choice(popular) if rng.random() < 0.3 else next(fresh)
                                 for _ in range(rng.randint(1, 6))]})
        for _ in range(2000)
    ]  # fmt: skip
    answers: list[Any] = []
    worker = threading.Thread(
        target=lambda: answers.extend(asyncio.run(post_bodies(url, bodies, clients, seconds=seconds)))
    )
    worker.start()
    worker.join()
    assert answers and all(a.status == 200 for a in answers), answers[:3]
    return len(answers)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server("stage5_metrics", tmp_path_factory.mktemp("dashboard")) as s:
        yield s


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert Path(CHROMIUM).exists() or shutil.which("chromium"), "Chromium is missing: run `make tools`"
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class Watched:
    """A page, with every browser-side error and every URL it fetched."""

    def __init__(self, browser: Browser) -> None:
        self.page: Page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.errors: list[str] = []
        self.urls: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("request", lambda r: self.urls.append(r.url))

    def open(self, url: str) -> None:
        self.page.goto(f"{url}/dashboard")
        self.page.wait_for_function(
            "document.getElementById('status').textContent === 'live'", timeout=15_000
        )

    def points(self) -> dict[str, int]:
        found = self.page.eval_on_selector_all(".chart", "els => els.map(e => [e.id, e.dataset.points])")
        return {chart_id: int(n) for chart_id, n in found}

    def data(self, chart: str) -> list[list[Any]]:
        """What uPlot draws: x, then one array per series."""
        return list(self.page.evaluate(f"window.charts[{chart!r}].data"))

    def renders(self) -> int:
        return int(self.page.evaluate("Number(document.body.dataset.renders || 0)"))

    def wait_for_render(self, after: int) -> None:
        self.page.wait_for_function(f"Number(document.body.dataset.renders || 0) > {after}", timeout=10_000)


@pytest.fixture(scope="module")
def watched(browser: Browser, server: Server) -> Iterator[Watched]:
    w = Watched(browser)
    w.open(server.url)
    yield w
    w.page.close()


def test_an_idle_server_draws_empty_charts_at_once(watched: Watched) -> None:
    assert watched.page.title() == "embedserve dashboard"
    assert watched.page.locator(".chart canvas").count() == len(CHARTS)  # axes and all, from the start
    assert watched.points() == dict.fromkeys(CHARTS, 0)  # no traffic yet: every point is a zero
    for chart in TIME_CHARTS:
        series = watched.data(chart)
        assert len(series[0]) >= 1 and all(v == 0 for s in series[1:] for v in s)


def test_dashboard_fills_with_traffic(watched: Watched, server: Server, tmp_path: Path) -> None:
    # Light load (LOW tier), then heavier (batches form), so every chart has something to show.
    assert traffic(server.url, 4, clients=2) > 0
    assert traffic(server.url, 8, clients=24) > 0
    ids = ",".join(repr(c) for c in CHARTS)
    check = f"[{ids}].every(id => Number(document.getElementById(id).dataset.points) > 0)"
    watched.page.wait_for_function(check, timeout=20_000)
    page = watched.page
    assert len(watched.data("c-latency")) == 4  # x, p50, p95, p99
    counts = watched.data("c-batches")[1]
    assert len([n for n in counts if n > 0]) >= 2  # batches of more than one size
    assert page.text_content("#t-rps") not in ("–", "0.00")
    assert page.text_content("#t-hit").endswith("%")
    assert page.text_content("#model").startswith("all-MiniLM-L6-v2")
    assert page.locator("#summary tr").count() > 5
    # requests/s is drawn last, so on top of texts/s (equal when every request has one text)
    labels = page.evaluate("window.charts['c-throughput'].series.map(s => s.label)")
    assert labels[1:] == ["texts/s", "requests/s"]
    assert (page.text_content("#t-lat") or "").endswith(" ms")  # the tile's value says its unit
    assert (page.text_content("#t-saved") or "").endswith(" s")
    why = page.text_content("#t-saved-why") or ""  # what the saving is, in one sentence on the page
    assert "cache hit" in why and "call of its own" in why and "batching's saving is not estimated" in why
    assert watched.errors == []
    page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    assert (tmp_path / "dashboard.png").stat().st_size > 20_000


def test_no_hole_in_the_grid_and_no_wrapped_cell(watched: Watched) -> None:
    layout = watched.page.evaluate(
        """() => {
        const span = (c) => Number(getComputedStyle(c).gridColumnStart.replace('span ', '')) || 1;
        const cells = (grid) => ({
            columns: getComputedStyle(grid).gridTemplateColumns.split(' ').length,
            used: [...grid.children].reduce((n, c) => n + span(c), 0),
        });
        const rows = [...document.querySelectorAll('#summary tr')].map(r => r.getBoundingClientRect().height);
        const table = document.getElementById('summary');
        return {tiles: cells(document.querySelector('.tiles')), cards: cells(document.querySelector('.grid')),
                rows, tableWidth: table.scrollWidth, cardWidth: table.parentElement.clientWidth};
    }"""
    )
    for grid in ("tiles", "cards"):  # every row of the grid is full
        assert layout[grid]["used"] % layout[grid]["columns"] == 0, layout
    assert max(layout["rows"]) - min(layout["rows"]) < 2, layout  # one line per table row
    assert layout["tableWidth"] <= layout["cardWidth"], layout


def test_legends_show_the_latest_point_without_hovering(watched: Watched) -> None:
    """uPlot's legend shows the point under the cursor: away from the charts, it shows the latest."""
    watched.page.mouse.move(5, 5)  # on the header, over no chart
    legends = watched.page.evaluate(
        """() => Object.entries(window.charts).filter(([id, u]) => u.legend.show !== false).map(([id, u]) => [
            id, u.data.slice(1).map(s => s[s.length - 1]),
            [...u.root.querySelectorAll('.u-legend .u-series .u-value')].slice(1).map(e => e.textContent),
        ])"""
    )
    assert {chart for chart, _, _ in legends} == set(TIME_CHARTS), legends  # the size histogram has none
    for chart, last, shown in legends:
        assert len(shown) == len(last) and all(v not in ("", "--", "–") for v in shown), (chart, shown)
        if chart != "c-tiers":  # the tiers' legend shows each tier's count, not the stacked total drawn
            for value, text in zip(last, shown, strict=True):  # the last point's, as fmt() writes it
                assert float(text.replace(",", "")) == pytest.approx(value, rel=0.01, abs=0.01), chart


@pytest.mark.parametrize("width", (1280, 1920, 1400))  # a laptop, a desktop, the docs' picture (last)
def test_everything_fits_in_a_window_1000_high(watched: Watched, width: int) -> None:
    """Every tile, chart, the table and the footer lie inside the window, nothing beyond its edges."""
    watched.page.set_viewport_size({"width": width, "height": 1000})
    watched.page.wait_for_timeout(200)  # the charts follow their boxes' new width
    boxes = watched.page.evaluate(
        """() => [...document.querySelectorAll('.tile, .card, footer')].map(e => {
            const r = e.getBoundingClientRect();
            return [e.querySelector('h2, .label')?.textContent || e.tagName, r.bottom, r.right];
        })"""
    )
    assert len(boxes) == 7 + len(CHARTS) + 2
    assert all(bottom <= 1000 and right <= width for _, bottom, right in boxes), boxes
    assert watched.page.evaluate("document.scrollingElement.scrollHeight") <= 1000


def test_a_pause_is_drawn_as_zero(watched: Watched, server: Server) -> None:
    """No traffic for two 5-second steps, then traffic again: the lines go to 0 and back, unbroken."""
    time.sleep(11)
    assert traffic(server.url, 4, clients=4) > 0
    watched.wait_for_render(watched.renders())
    requests = watched.data("c-throughput")[2]
    busy = [i for i, v in enumerate(requests) if v > 0]
    assert busy, requests
    between = [requests[i] for i in range(busy[0], busy[-1]) if i not in busy]
    assert between and all(v == 0 for v in between), requests  # the pause, drawn at 0
    for chart in TIME_CHARTS:  # a null would break a line into segments: there are none
        assert all(v is not None for series in watched.data(chart)[1:] for v in series), chart


def test_charts_are_drawn_from_the_first_answer(browser: Browser, server: Server) -> None:
    """A new page on a server that has had traffic: its very first answer fills every chart."""
    fresh = Watched(browser)
    fresh.page.route("**/v1/dashboard", lambda route: route.abort())  # no answer yet: the frame is there
    fresh.page.goto(f"{server.url}/dashboard")
    fresh.page.wait_for_function("document.getElementById('status').textContent.startsWith('offline')")
    assert fresh.page.locator(".chart canvas").count() == len(CHARTS) and fresh.renders() == 0
    fresh.page.unroute("**/v1/dashboard")
    fresh.errors.clear()  # the aborted fetch, reported by the browser
    fresh.page.wait_for_function("document.body.dataset.renders === '1'", timeout=15_000)
    first = fresh.page.evaluate(
        "({renders: document.body.dataset.renders,"
        " points: [...document.querySelectorAll('.chart')].map(e => Number(e.dataset.points))})"
    )
    assert first["renders"] == "1" and all(n > 0 for n in first["points"]), first
    assert fresh.errors == []
    fresh.page.close()


def test_dashboard_is_served_offline(watched: Watched, server: Server) -> None:
    """The page, its script, its stylesheet and uPlot come from the server itself: no CDN."""
    assert watched.urls and all(url.startswith(server.url) for url in watched.urls), watched.urls
    assert any(url.endswith("/vendor/uPlot.iife.min.js") for url in watched.urls)
    for path in ("/dashboard", "/dashboard/static/dashboard.js"):
        source = httpx.get(f"{server.url}{path}").text
        assert "http://" not in source and "https://" not in source, path
    licence = httpx.get(f"{server.url}/dashboard/static/vendor/uPlot.LICENSE")
    assert licence.status_code == 200 and "MIT" in licence.text


def test_dashboard_with_an_api_key(browser: Browser, tmp_path: Path) -> None:
    """With API_KEY set the page's data needs the key: it comes from the URL fragment, never sent."""
    env = {"API_KEY": "dash-key-1", "PROTECT_METRICS": "false"}
    with run_server("stage5_metrics", tmp_path, env) as srv:
        page = browser.new_page()
        page.goto(f"{srv.url}/dashboard")
        page.wait_for_function("document.getElementById('status').textContent.startsWith('offline')")
        assert "401" in page.text_content("#status")
        page.goto(f"{srv.url}/dashboard#key=dash-key-1")
        page.reload()
        page.wait_for_function("document.getElementById('status').textContent === 'live'", timeout=15_000)
        assert "dash-key-1" not in srv.log()
        page.close()


# --- what the page computes from the readings, in the browser ------------------------------------
class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def counted(metrics: Metrics, n: int, ms: float = 5.0, texts: int = 2, hits: int = 1) -> None:
    """``n`` embedding requests answered 200, each with ``texts`` texts, and one batch of their misses."""
    for _ in range(n):
        metrics.observe_request("/v1/embed", 200, ms / 1e3)
        metrics.observe_result(texts, 10 * texts, 0.001, 0.002 * hits)
    metrics.observe_batch(n * (texts - hits), 160, 120, "medium", 0.02, failed=False)


def page_of(window: Window) -> dict[str, Any]:
    """What /v1/dashboard sends the page, from this window."""
    readings = [r.as_dict() for r in window.readings]
    now = window.now().as_dict()
    return {"started": window.started, "step_s": window.step, "readings": readings, "reading": now}


def zero(at: float) -> dict[str, Any]:
    return {"at": at, "values": {}, "latency": {}, "sizes": {}, "depth_max": 0}


def test_percentiles_interpolate_inside_a_bucket(watched: Watched) -> None:
    """The page's histogram_quantile, on 1 .. 1000 ms evenly: within 5 % of the exact percentile."""
    metrics = Metrics()
    for ms in range(1, 1001):
        metrics.observe_request("/v1/embed", 200, ms / 1e3)
    metrics.observe_request("/metrics", 200, 5.0)  # another route: not in the embedding figures
    empty, now = zero(0.0), read(metrics, 1.0).as_dict()
    for q, exact in ((0.5, 500.0), (0.95, 950.0), (0.99, 990.0)):
        got = watched.page.evaluate("([a, b, q]) => quantile(a, b, q, 'latency')", [empty, now, q])
        assert got is not None and abs(got - exact) <= 0.05 * exact, (q, got)
    assert watched.page.evaluate("([b]) => quantile(b, b, 0.5, 'latency')", [now]) is None  # none in between
    mean = watched.page.evaluate("([a, b]) => summary(a, b).latency_ms.mean", [empty, now])
    assert mean == pytest.approx(500.5)


def test_last_minute_forgets_and_since_start_remembers(watched: Watched) -> None:
    clock = Clock()
    metrics = Metrics()
    window = Window(metrics, clock=clock)
    window.sample()
    counted(metrics, 10)
    for _ in range(90):  # a sample a second, as the server's task takes them
        clock.now += 1
        window.sample()
    metrics.observe_request("/v1/embed", 503, 0.001)
    figures = watched.page.evaluate("([d]) => windows(d)", [page_of(window)])
    minute, since = figures["minute"], figures["since"]
    assert minute["requests"] == 1 and minute["rejections"]["overload"] == 1 and minute["texts"] == 0
    assert 59 <= minute["seconds"] <= 61
    assert since["requests"] == 11 and since["texts"] == 20 and since["tokens"] == 200
    assert since["statuses"] == {"200": 10, "503": 1}
    assert since["cache"]["deduplicated"] == 0  # stage 4's counts come from the backend (StageCounts)
    assert since["batches"]["count"] == 1 and since["batches"]["size_distribution"] == {"10": 1}
    assert since["batches"]["tiers"] == {"low": 0, "medium": 1, "high": 0}
    assert since["batches"]["padding_ratio"] == 0.25
    assert since["savings"] == {"model_s_spent": 0.02, "model_s_saved_by_cache": 0.02, "saved_fraction": 0.5}
    assert since["queue_ms_mean"] == 1.0
    clock.now += 600  # long after: since start still has it all
    window.sample()
    assert watched.page.evaluate("([d]) => windows(d).since.requests", [page_of(window)]) == 11


def test_cache_figures_come_from_the_tiers(watched: Watched) -> None:
    """A Redis hit follows a memory miss: hits add up over tiers, lookups are the memory tier's."""
    metrics = Metrics()
    metrics.earlier_stages.source = lambda: StageCounts(
        cache_hits={"memory": 6, "redis": 2}, cache_misses={"memory": 4, "redis": 2}, deduplicated=3
    )
    now = read(metrics, 1.0).as_dict()
    cache = watched.page.evaluate("([a, b]) => summary(a, b).cache", [zero(0.0), now])
    assert cache == {"hits": 8, "misses": 2, "hit_rate": 0.8, "deduplicated": 3}


def test_series_points_cover_the_window_and_a_pause_is_zero(watched: Watched) -> None:
    clock = Clock(1_000_000.0)
    metrics = Metrics()
    depth = {"now": 0}
    metrics.earlier_stages.source = lambda: StageCounts(queue_depth=depth["now"])
    window = Window(metrics, clock=clock)
    series = "([d]) => series(d)"
    assert len(watched.page.evaluate(series, [page_of(window)])) == 1  # just started: one point
    window.sample()
    for second in range(400):
        clock.now += 1
        if second < 30 or second > 380:  # traffic, a pause of almost six minutes, traffic again
            counted(metrics, 2)
            depth["now"] = 7 if second == 385 else 1
        else:
            depth["now"] = 0
        window.sample()
    points = watched.page.evaluate(series, [page_of(window)])
    # 60 steps of 5 s, less the one under way: it began 0 s ago, too young to draw
    assert len(points) == 60 and [p["t"] for p in points] == sorted(p["t"] for p in points)
    assert all(b["t"] - a["t"] == 5 for a, b in itertools.pairwise(points))
    pause, busy_step = points[10], points[-1]
    assert pause["requests_per_s"] == 0 and pause["texts_per_s"] == 0 and pause["queue_depth_max"] == 0
    assert pause["p50_ms"] is None and pause["hit_rate"] is None and pause["avg_batch"] is None
    assert pause["tiers"] == {"low": 0, "medium": 0, "high": 0}
    busy = [p for p in points if p["requests_per_s"] > 0]
    assert busy and all(p["requests_per_s"] == pytest.approx(2.0, abs=0.5) for p in busy[:-1])
    assert max(p["queue_depth_max"] for p in points) == 7  # the deepest queue of its step
    assert busy_step["p50_ms"] == pytest.approx(5.0, rel=0.2) and busy_step["avg_batch"] == 2.0
    assert busy_step["seconds"] == 5.0
    clock.now += 3  # the step under way is drawn once it is 2 s old, over its own length
    under_way = watched.page.evaluate(series, [page_of(window)])[-1]
    assert under_way["t"] == busy_step["t"] + 5 and under_way["seconds"] == 3.0
