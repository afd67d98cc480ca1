"""`make results ONLY=screenshots`: pictures of Locust's web UI for the benchmarking chapter.

Runs `make loadtest`'s launcher (``python -m loadtests.run``) on free ports, photographs the start
form, starts a swarm through the UI's own HTTP API, and photographs the charts and statistics
once the run has gone on for a while. Writes locust_*.png (stamped) and, for the caption,
locust_ui.md: to out/ by default, to docs/img/ and docs/results/ with ``--record``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from common.serve import resolve
from loadtests import evidence, tables
from loadtests.procs import REPO, free_port, wait_http

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]


def shoot(stage: str, user_class: str, users: int, seconds: float, img: Path) -> list[Path]:
    """The three pictures, in ``img``."""
    from playwright.sync_api import sync_playwright

    port, web = free_port(), free_port()
    ui = f"http://127.0.0.1:{web}"
    env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(port)}
    out = evidence.OUT / "logs" / "screenshots"
    out.mkdir(parents=True, exist_ok=True)
    with (out / "run.log").open("wb") as log:
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "loadtests.run",
                "--stage",
                stage,
                "--web-port",
                str(web),
                "--out",
                str(out),
            ],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    img.mkdir(parents=True, exist_ok=True)
    written = []
    try:
        wait_http(ui, run)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(ui)
            page.wait_for_load_state("networkidle")
            page.get_by_text("Custom parameters").click()  # show the workload options
            page.wait_for_timeout(500)
            written.append(img / "locust_start.png")
            page.screenshot(path=str(written[-1]), full_page=True)
            # Start the swarm the way the form's button does, then reload: the page now shows the run.
            started = httpx.post(
                f"{ui}/swarm",
                data={
                    "user_count": users,
                    "spawn_rate": users,
                    "host": f"http://127.0.0.1:{port}",
                    "user_classes": user_class,
                },
            )
            started.raise_for_status()
            time.sleep(2)  # let the first users spawn, so the page loads in its running view
            page.goto(ui)
            page.wait_for_load_state("networkidle")
            page.get_by_role("tab", name="Charts").click(timeout=30_000)
            time.sleep(seconds)
            written.append(img / "locust_charts.png")
            page.screenshot(path=str(written[-1]), full_page=True)
            page.get_by_role("tab", name="Statistics").click()
            page.wait_for_timeout(1000)
            written.append(img / "locust_statistics.png")
            page.screenshot(path=str(written[-1]), clip={"x": 0, "y": 0, "width": 1400, "height": 400})
            browser.close()
        httpx.post(f"{ui}/stop")
    finally:
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
    return written


def caption_page(result: dict[str, Any]) -> str:
    """locust_ui.md: the caption the benchmarking chapter shows under the pictures."""
    ran = (
        f"Screenshots of Locust's web UI: `{result['user_class']}`, {result['users']} users for"
        f" {result['seconds']:g} s against `{result['stage']}`, Locust and the server on the same machine."
    )
    return tables.page(result["stamp"], {"caption": [f"{ran} {evidence.describe(result['stamp'])}"]})


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage", default="5")
    parser.add_argument("--user-class", default="RepeatedTextUser")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument(
        "--seconds", type=float, help="How long the swarm runs before the pictures (default 30, quick 5)."
    )
    parser.add_argument("--img", type=Path, help="Folder for the PNGs (default: out/img, or docs/img).")
    parser.add_argument("--results", type=Path, help="Folder for locust_ui.md (out/results or docs/results).")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("loadtests.ui_screenshot", args, argv)
    seconds = args.seconds or (5.0 if args.quick else 30.0)
    img, results, stage = args.img or run.img_dir, args.results or run.results_dir, resolve(args.stage)
    paths = shoot(stage, args.user_class, args.users, seconds, img)
    result = {
        "stamp": run.stamp(),
        "stage": stage,
        "user_class": args.user_class,
        "users": args.users,
        "seconds": seconds,
    }
    for path in paths:
        evidence.stamp_png(path, result["stamp"])
    paths.append(evidence.write_json(results / "locust_ui.json", result))
    paths.append(evidence.write_text(results / "locust_ui.md", caption_page(result)))
    print("wrote " + ", ".join(str(p) for p in paths), flush=True)


if __name__ == "__main__":
    main()
