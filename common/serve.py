"""Run one server stage: ``python -m common.serve stage3_batching`` (what ``make stageN`` calls).

One command line for the Makefile and the tests, so the tests start each stage exactly as a
reader does. HOST and PORT come from the settings (environment).
"""

from __future__ import annotations

import argparse
import copy
import importlib
from typing import Any

import uvicorn

from common.settings import get_settings

STAGES = (
    "stage1_naive",
    "stage2_threadpool",
    "stage3_batching",
    "stage4_cache_backpressure",
    "stage5_metrics",
)


def available_stages() -> list[str]:
    """The server stages that exist in this checkout (a later stage is tested the day it appears)."""
    found = []
    for stage in STAGES:
        try:
            importlib.import_module(f"{stage}.app")
        except ModuleNotFoundError as exc:
            if exc.name not in (stage, f"{stage}.app"):
                raise
            continue
        found.append(stage)
    return found


def resolve(name: str) -> str:
    """Accept `stage3`, `3` or `stage3_batching`; a dotted package such as `exercises.stage2_threadpool`
    (a learner's version of a stage, with its own `app.py`) is served as it is."""
    if "." in name:
        return name
    key = name.removeprefix("stage")
    for stage in STAGES:
        if stage == name or stage.removeprefix("stage").split("_")[0] == key:
            return stage
    raise SystemExit(f"unknown stage {name!r}; one of {', '.join(STAGES)}")


def app_of(stage: str) -> tuple[str, bool]:
    """uvicorn's target for a stage, and whether it is a factory: a stage's ``app.py`` holds its
    ``app``, or an app factory ``create_app`` where the app must be built by uvicorn (stage 5
    configures uvicorn's own log lines)."""
    module = importlib.import_module(f"{stage}.app")
    factory = callable(getattr(module, "create_app", None)) and not hasattr(module, "app")
    return (f"{stage}.app:create_app" if factory else f"{stage}.app:app"), factory


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's own logging configuration, with the stages' ``embedserve.*`` loggers written the
    same way (stage 4's drain and cache lines); stage 5 replaces it with its JSON lines."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["embedserve"] = {"handlers": ["default"], "level": level, "propagate": False}
    return config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("stage", help="stage1 .. stage5, or the folder name")
    args = parser.parse_args(argv)
    stage = resolve(args.stage)
    settings = get_settings()
    workers = f" ({settings.workers} worker processes)" if settings.workers > 1 else ""
    print(f"{stage} listening on http://{settings.host}:{settings.port}{workers}", flush=True)
    target, factory = app_of(stage)
    uvicorn.run(
        target,
        factory=factory,
        log_config=log_config(settings.log_level.upper()),
        host=settings.host,
        port=settings.port,
        workers=settings.workers,  # several: one socket, each process imports the app and loads the model
        # Off: stage 5 writes its own line per request, with the counts uvicorn's would lack.
        access_log=False,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
    )


if __name__ == "__main__":
    main()
