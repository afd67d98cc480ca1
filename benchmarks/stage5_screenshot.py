"""The stage 5 chapter's picture of the dashboard, taken after a minute of steady traffic.

    python -m benchmarks.stage5_screenshot                 # writes docs/img/dashboard.png
    python -m benchmarks.stage5_screenshot --warm 120 --out /tmp/dashboard.png

It starts stage 5 as ``make stage5`` does, sends closed-loop traffic for ``--warm`` seconds
(sentences, 1 to 6 a request, about a third of them repeats: cache hits), opens ``/dashboard``
in Debian's Chromium (Playwright; ``make browser``) while the traffic goes on, and saves the
page once it has drawn a fresh answer. A picture taken seconds after the start shows empty
charts and savings that mean nothing yet; this one shows a server that has been busy a while.
``tests/test_stage5_dashboard.py`` drives the page with the same traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from loadtests.procs import REPO, running_stage
from stage0_script import corpus

OUT = REPO / "docs" / "img" / "dashboard.png"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-sync"]


async def closed_loop(url: str, seconds: float, clients: int, seed: int = 5) -> int:
    """``clients`` closed-loop clients for ``seconds``: new sentences and repeats; requests answered."""
    rng = random.Random(seed)
    fresh = corpus.stream(seed=int(time.time()), kind="sentence")
    popular = corpus.texts(12, seed=77, kind="sentence")
    until = time.monotonic() + seconds
    answered = 0

    async def client(c: httpx.AsyncClient) -> None:
        nonlocal answered
        while time.monotonic() < until:
            texts = [
                rng.choice(popular) if rng.random() < 0.3 else next(fresh) for _ in range(rng.randint(1, 6))
            ]
            response = await c.post("/v1/embed", json={"inputs": texts})
            assert response.status_code == 200, response.text
            answered += 1

    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        await asyncio.gather(*(client(c) for _ in range(clients)))
    return answered


def traffic(url: str, seconds: float, clients: int) -> int:
    """``closed_loop`` on a thread of its own (Playwright's sync API keeps a loop on the caller's)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, closed_loop(url, seconds, clients)).result()


def screenshot(url: str, out: Path, width: int = 1400) -> None:
    """Open the page, wait until it has rendered a fresh answer, save it (full page)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": width, "height": 1000})
        page.goto(f"{url}/dashboard")
        page.wait_for_function("Number(document.body.dataset.renders || 0) >= 2", timeout=30_000)
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), full_page=True)
        browser.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--warm", type=float, default=60.0, help="seconds of traffic before the picture")
    parser.add_argument("--clients", type=int, default=12, help="closed-loop clients (default 12)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    with running_stage("stage5_metrics", REPO / "out" / "logs" / "stage5_screenshot") as server:
        # The load runs on while the page opens and draws, so "now" shows a busy server too.
        load = threading.Thread(target=traffic, args=(server.url, args.warm + 15, args.clients))
        load.start()
        time.sleep(args.warm)
        screenshot(server.url, args.out)
        load.join()
    print(f"wrote {args.out} after {args.warm:g} s of traffic from {args.clients} clients")


if __name__ == "__main__":
    main()
