"""The docs' pictures of a busy server: Locust's web UI and stage 5's dashboard, under one load.

    python -m benchmarks.screenshots             # out/img/, after 30 s of load (about a minute in all)
    python -m benchmarks.screenshots --quick     # after 8 s, to see that it works
    python -m benchmarks.screenshots --record    # docs/img/ and docs/results/screenshots.md

Stage 5 starts as ``make stage5`` starts it, and ``make loadtest``'s launcher
(``python -m loadtests.run``) opens Locust's web UI against it, as a reader would run the two.
Debian's Chromium (driven by Playwright; ``make tools``) photographs the start form, a swarm is
started through the UI's own HTTP API, and after ``--seconds`` of it the Charts and Statistics
tabs and the dashboard (1400x1000, where all of it fits) are photographed while the load goes
on. Writes locust_start/charts/statistics.png and dashboard.png (stamped), and
screenshots.json/.md with the captions the benchmarking and stage 5 chapters show.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from loadtests import evidence, tables
from loadtests.procs import REPO, free_port, running_stage, wait_http

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]
WINDOW = {"width": 1400, "height": 1000}
PICTURES = ("locust_start.png", "locust_charts.png", "locust_statistics.png", "dashboard.png")


@contextmanager
def locust_ui(server_url: str, log: Path) -> Iterator[str]:
    """`make loadtest` against the server at ``server_url``; yields the web UI's address."""
    host, port = server_url.removeprefix("http://").split(":")
    web = free_port()
    with log.open("wb") as out:
        ui = subprocess.Popen(
            [sys.executable, "-m", "loadtests.run", "--web-port", str(web), "--out", str(log.parent)],
            cwd=REPO, env={**os.environ, "HOST": host, "PORT": port}, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{web}", ui)
        yield f"http://127.0.0.1:{web}"
    finally:
        ui.terminate()  # SIGTERM: the launcher stops Locust; the server is ours
        ui.wait(timeout=60)


def shoot(server_url: str, ui: str, img: Path, user_class: str, users: int, seconds: float) -> dict[str, Any]:
    """The four pictures into ``img``; what Locust counted by then."""
    from playwright.sync_api import sync_playwright

    img.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport=WINDOW)
        page.goto(ui)
        page.get_by_text("Custom parameters").click()  # the workload options of the locustfile
        page.wait_for_timeout(500)
        page.screenshot(path=str(img / PICTURES[0]), full_page=True)
        # Start the swarm as the form's button does.
        swarm = {"user_count": users, "spawn_rate": users, "host": server_url, "user_classes": user_class}
        httpx.post(f"{ui}/swarm", data=swarm).raise_for_status()
        time.sleep(2)  # the first users spawned: the page, reloaded, opens on the run
        page.goto(ui)
        page.get_by_role("tab", name="Charts").click(timeout=30_000)
        time.sleep(max(seconds - 2, 0))  # the charts draw what this page has seen since it opened
        stats = httpx.get(f"{ui}/stats/requests").json()
        page.screenshot(path=str(img / PICTURES[1]), full_page=True)
        page.get_by_role("tab", name="Statistics").click()
        page.wait_for_timeout(1000)
        page.screenshot(path=str(img / PICTURES[2]), clip={"x": 0, "y": 0, "width": 1400, "height": 400})
        dashboard = browser.new_page(viewport=WINDOW)
        dashboard.goto(f"{server_url}/dashboard")
        dashboard.wait_for_function("Number(document.body.dataset.renders || 0) >= 2", timeout=30_000)
        dashboard.screenshot(path=str(img / PICTURES[3]), full_page=True)
        browser.close()
    httpx.post(f"{ui}/stop").raise_for_status()
    total = next(s for s in stats["stats"] if s["name"] == "Aggregated")
    return {"requests": total["num_requests"], "failures": total["num_failures"]}


def markdown(result: dict[str, Any]) -> str:
    """screenshots.md: the captions, one section each for the benchmarking and stage 5 chapters."""
    load = (
        f"`{result['user_class']}` from {result['users']} Locust users for {result['seconds']:g} s"
        f" against `stage5_metrics` ({result['requests']:,} requests by then, {result['failures']} failed),"
        f" Locust and the server on the same machine"
    )
    said = evidence.describe(result["stamp"])
    return tables.page(
        result["stamp"],
        {
            "locust": [f"Screenshots of Locust's web UI: {load}. {said}"],
            "dashboard": [
                f"The dashboard, in a 1400x1000 window, taken after Locust's pictures with the load still"
                f" on: {load}. {said}"
            ],
        },
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--user-class", default="RepeatedTextUser", help="the locustfile's user class")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--seconds", type=float, help="load before the pictures (default 30, quick 8)")
    parser.add_argument("--img", type=Path, help="folder for the pictures (out/img, or docs/img)")
    parser.add_argument("--results", type=Path, help="folder for screenshots.json and .md")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.screenshots", args, argv)
    seconds = args.seconds or (8.0 if args.quick else 30.0)
    img, logs = args.img or run.img_dir, run.logs("screenshots")
    with running_stage("stage5_metrics", logs) as server, locust_ui(server.url, logs / "locust.log") as ui:
        counted = shoot(server.url, ui, img, args.user_class, args.users, seconds)
    result = {"stamp": run.stamp(), "user_class": args.user_class, "users": args.users, "seconds": seconds}
    result.update(counted)
    for name in PICTURES:
        evidence.stamp_png(img / name, result["stamp"])
    evidence.publish(run, "screenshots", result, markdown, args.results)
    print("and " + ", ".join(str(img / name) for name in PICTURES))


if __name__ == "__main__":
    main()
