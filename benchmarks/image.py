"""`make results ONLY=image`: the stage 5 image beside `make stage5`, its size and its start (docs/beyond.md).

    python -m benchmarks.image            # builds the image first when its files changed (minutes)
    python -m benchmarks.image --quick    # one start of each

Each started ROUNDS times, in turns, on a free port: the image's container (``buildah run`` here,
``docker run`` where a Docker engine answers; ``deploy/docker/image.py``) and ``make stage5``,
timed from the command's start to the first 200 of ``/ready`` (the model loaded and warm). Sizes:
the image's unpacked layers (what ``docker images`` shows), beside what ``make stage5`` serves
from: the model folder and ``.venv``, which holds the build and dev extras (torch among them).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.settings import Settings
from deploy.docker import image as docker_image
from loadtests import evidence
from loadtests.procs import answers, free_port, wait_until
from loadtests.tables import num, page, table

REPO = evidence.REPO
ROUNDS, QUICK_ROUNDS = 3, 1
STARTS = ("image", "stage5")


def _mb(path: Path) -> float:
    """Bytes of every file under ``path`` (links not followed), in MB (10^6, as image sizes are)."""
    total = sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    return round(total / 1e6, 1)


def _first_200(url: str, process: subprocess.Popen[bytes], started: float) -> float:
    wait_until(lambda: answers(f"{url}/ready"), timeout=180, every=0.02, process=process)
    return round(time.monotonic() - started, 2)


def start_image(image: docker_image.Image, logs: Path) -> float:
    """Seconds from ``docker run`` (here ``buildah from`` and ``buildah run``) to the first 200."""
    with (logs / "image.log").open("ab") as log:
        started = time.monotonic()
        with docker_image.running(image, free_port(), log=log) as container:
            return _first_200(container.url, container.process, started)


def start_stage5(logs: Path) -> float:
    """Seconds from ``make stage5`` to the first 200; then its process group gets SIGTERM."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("HOST", "PORT", "MAKEFLAGS", "MFLAGS")}
    with (logs / "stage5.log").open("ab") as log:
        started = time.monotonic()
        make = subprocess.Popen(["make", "--no-print-directory", "stage5", f"PORT={port}"], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        return _first_200(f"http://127.0.0.1:{port}", make, started)
    finally:
        os.killpg(make.pid, signal.SIGTERM)
        make.wait(timeout=60)


def measure(rounds: int, logs: Path) -> dict[str, Any]:
    with (logs / "build.log").open("w") as log:
        image = docker_image.build(log)
    starts: dict[str, list[float]] = {name: [] for name in STARTS}
    for _ in range(rounds):  # in turns: a slower minute of the machine costs both alike
        starts["image"].append(start_image(image, logs))
        starts["stage5"].append(start_stage5(logs))
    return {
        "image": {
            "tag": image.tag,
            "engine": image.engine,
            "size_mb": round(docker_image.inspect(image.engine, image.tag)["Size"] / 1e6, 1),
            "built_s": None if image.built_s is None else round(image.built_s, 1),
        },
        "stage5": {"venv_mb": _mb(REPO / ".venv"), "model_mb": _mb(Settings().model_dir)},
        "start_s": starts,
    }


def markdown(result: dict[str, Any]) -> str:
    image, stage5, starts = result["image"], result["stage5"], result["start_s"]
    runs = {"docker": "`docker run`", "buildah": "`buildah run` (chroot isolation)"}
    rows = [
        ["the image", runs[image["engine"]], num(image["size_mb"], 0), "the image, model included",
         num(statistics.median(starts["image"]), 2)],
        ["`make stage5`", "`make stage5`", num(stage5["venv_mb"] + stage5["model_mb"], 0),
         f".venv, with torch and the dev tools ({num(stage5['venv_mb'], 0)}), and the model"
         f" ({num(stage5['model_mb'], 0)})", num(statistics.median(starts["stage5"]), 2)],
    ]  # fmt: skip
    headers = ["setup", "started by", "MB on disk", "what that is", "s to the first 200 of /ready"]
    built = image["built_s"]
    note = (
        f"Median of {result['rounds']} starts each, in turns, from the command to the first 200."
        f" Image `{image['tag']}`, built by {image['engine']}"
        + (f" in this run ({num(built, 0)} s)." if built is not None else " before this run (reused).")
    )
    return page(result["stamp"], {"table": table(headers, rows, "llrlr")}, note) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="Folder for image.json and .md.")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.image", args, argv)
    rounds = QUICK_ROUNDS if args.quick else ROUNDS
    result = {"stamp": {}, "rounds": rounds, **measure(rounds, run.logs("image"))}
    result["stamp"] = run.stamp()
    evidence.publish(run, "image", result, markdown, args.out)


if __name__ == "__main__":
    main()
