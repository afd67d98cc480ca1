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
