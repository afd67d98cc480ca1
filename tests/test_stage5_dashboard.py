"""The live dashboard in a real headless Chromium (Debian's, driven by Playwright; `make browser`).

The page loads with empty charts, fills them once traffic arrives, and the test saves the
screenshot the stage 5 chapter shows (docs/img/dashboard.png).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import REPO, Server, run_server
from playwright.sync_api import Page, sync_playwright

from stage0_script import corpus

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
CHARTS = ("c-throughput", "c-latency", "c-hits", "c-batches", "c-queue", "c-tiers", "c-savings")
SCREENSHOT = REPO / "docs" / "img" / "dashboard.png"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server("stage5_metrics", tmp_path_factory.mktemp("dashboard")) as s:
        yield s


@pytest.fixture(scope="module")
def page() -> Iterator[Page]:
    assert Path(CHROMIUM).exists() or shutil.which("chromium"), "Chromium is missing: run `make browser`"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser.new_page(viewport={"width": 1400, "height": 1000})
        browser.close()


async def _traffic(url: str, seconds: float, clients: int) -> int:
    """Closed-loop clients: mostly new sentences, some repeats (cache hits), 1-6 texts a request."""
    rng = random.Random(5)
    fresh = corpus.stream(seed=int(time.time()), kind="sentence")
    popular = corpus.texts(12, seed=77, kind="sentence")
    until = time.monotonic() + seconds
    sent = 0

    async def client(c: httpx.AsyncClient) -> None:
        nonlocal sent
        while time.monotonic() < until:
            n = rng.randint(1, 6)
            texts = [rng.choice(popular) if rng.random() < 0.3 else next(fresh) for _ in range(n)]
            assert (await c.post("/v1/embed", json={"inputs": texts})).status_code == 200
            sent += 1

    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        await asyncio.gather(*(client(c) for _ in range(clients)))
    return sent


def traffic(url: str, seconds: float, clients: int) -> int:
    # Playwright's sync API keeps an event loop on this thread: the load runs on its own.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _traffic(url, seconds, clients)).result()


def _points(page: Page) -> dict[str, int]:
    found = page.eval_on_selector_all(".chart", "els => els.map(e => [e.id, e.dataset.points || '-1'])")
    return {chart_id: int(n) for chart_id, n in found}


def test_dashboard_fills_with_traffic(server: Server, page: Page) -> None:
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(f"{server.url}/dashboard")
    page.wait_for_function("document.getElementById('status').textContent === 'live'", timeout=15_000)
    assert page.title() == "embedserve dashboard"
    empty = _points(page)
    assert set(empty) == set(CHARTS)
    assert all(n == 0 for n in empty.values()), empty  # no traffic yet: nothing drawn

    # Light load (LOW tier), then heavier (batches form), so every chart has something to show.
    assert traffic(server.url, 4, clients=2) > 0
    assert traffic(server.url, 8, clients=24) > 0
    ids = ",".join(repr(c) for c in CHARTS)
    check = f"[{ids}].every(id => Number(document.getElementById(id).dataset.points) > 0)"
    page.wait_for_function(check, timeout=20_000)
    filled = _points(page)
    assert all(n > 0 for n in filled.values()), filled
    assert page.locator("#c-latency path").count() == 3  # p50, p95, p99
    assert page.locator("#c-batches rect").count() >= 2  # batches of more than one size
    assert page.text_content("#t-rps") not in ("–", "0.00")
    assert page.text_content("#t-hit").endswith("%")
    assert page.text_content("#model").startswith("all-MiniLM-L6-v2")
    assert page.locator("#summary tr").count() > 5
    assert errors == []
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    assert SCREENSHOT.stat().st_size > 20_000


def test_dashboard_is_served_offline(server: Server) -> None:
    """The page and its script come from the server itself: no external URL anywhere."""
    html = httpx.get(f"{server.url}/dashboard").text
    script = httpx.get(f"{server.url}/dashboard/dashboard.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    for source in (html, script.text):
        assert "http://" not in source.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in source


def test_dashboard_with_an_api_key(page: Page, tmp_path: Path) -> None:
    """With API_KEY set the page's data needs the key: it comes from the URL fragment, never sent."""
    env = {"API_KEY": "dash-key-1", "PROTECT_METRICS": "false"}
    with run_server("stage5_metrics", tmp_path, env) as srv:
        page.goto(f"{srv.url}/dashboard")
        page.wait_for_function("document.getElementById('status').textContent.startsWith('offline')")
        assert "401" in page.text_content("#status")
        page.goto(f"{srv.url}/dashboard#key=dash-key-1")
        page.reload()
        page.wait_for_function("document.getElementById('status').textContent === 'live'", timeout=15_000)
        assert "dash-key-1" not in srv.log()
