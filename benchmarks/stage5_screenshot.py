"""The stage 5 chapter's picture of the dashboard, taken after a minute of steady traffic.

    python -m benchmarks.stage5_screenshot                 # out/img/dashboard.png, after 60 s
    python -m benchmarks.stage5_screenshot --quick         # after 10 s, to see that it works
    python -m benchmarks.stage5_screenshot --record        # docs/img/dashboard.png (stamped)

It starts stage 5 as ``make stage5`` does, sends closed-loop traffic for ``--warm`` seconds
(sentences, 1 to 6 a request, about a third of them repeats: cache hits), opens ``/dashboard``
in Debian's Chromium (Playwright; ``make tools``) while the traffic goes on, and saves the
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from common import corpus
from loadtests import evidence, tables
from loadtests.load import post_bodies
from loadtests.procs import running_stage

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-sync"]


def _requests(n: int, seed: int = 5) -> list[bytes]:
    """New sentences and repeats (about a third: cache hits), 1 to 6 texts a request."""
    rng = random.Random(seed)
    fresh = corpus.stream(seed=int(time.time()), kind="sentence")
    popular = corpus.texts(12, seed=77, kind="sentence")
    bodies = [
        orjson.dumps(
            {
                "inputs": [
                    rng.choice(popular) if rng.random() < 0.3 else next(fresh)
                    for _ in range(rng.randint(1, 6))
                ]
            }
        )
        for _ in range(n)
    ]
    return bodies


def traffic(url: str, seconds: float, clients: int) -> int:
    """``clients`` closed-loop clients (``harness.post_bodies``) for ``seconds``; requests answered.

    On a thread of its own: Playwright's sync API keeps an event loop on the caller's thread."""
    bodies = _requests(max(2000, int(seconds * 400)))

    def run() -> list[Any]:
        return asyncio.run(post_bodies(url, bodies, clients, seconds=seconds))

    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.extend(run()))
    worker.start()
    worker.join()
    failed = [a for a in result if a.status != 200]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(result)} requests failed: {failed[0]}")
    return len(result)


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


def caption_page(result: dict[str, Any]) -> str:
    """dashboard.md: what the picture shows, for the stage 5 chapter's caption."""
    shows = (
        f"The dashboard after {result['warm_s']:g} s of closed-loop traffic from {result['clients']} clients"
        f" ({result['answered']} requests: sentences, 1 to 6 a request, a third of them repeats)."
    )
    return tables.page(result["stamp"], {"caption": [f"{shows} {evidence.describe(result['stamp'])}"]})


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--warm", type=float, help="seconds of traffic before the picture (60, quick 10)")
    parser.add_argument("--clients", type=int, default=12, help="closed-loop clients (default 12)")
    parser.add_argument(
        "--out", type=Path, help="the picture (default: dashboard.png in out/img or docs/img)"
    )
    parser.add_argument("--results", type=Path, help="folder for dashboard.json and .md")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.stage5_screenshot", args, argv)
    warm = args.warm or (10.0 if args.quick else 60.0)
    out = args.out or run.img_dir / "dashboard.png"
    answered: list[int] = []
    with running_stage("stage5_metrics", run.logs("stage5_screenshot")) as server:
        # The load runs on while the page opens and draws, so "now" shows a busy server too.
        load = threading.Thread(target=lambda: answered.append(traffic(server.url, warm + 15, args.clients)))
        load.start()
        time.sleep(warm)
        screenshot(server.url, out)
        load.join()
    result = {"stamp": run.stamp(), "warm_s": warm, "clients": args.clients, "answered": answered[0]}
    evidence.stamp_png(out, result["stamp"])
    folder = args.results or run.results_dir
    evidence.write_json(folder / "dashboard.json", result)
    evidence.write_text(folder / "dashboard.md", caption_page(result))
    print(
        f"wrote {out} after {warm:g} s of traffic from {args.clients} clients, and {folder / 'dashboard.md'}"
    )


if __name__ == "__main__":
    main()
