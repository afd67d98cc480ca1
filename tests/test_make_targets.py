"""``make stageN`` is the front door: each server stage starts from the Makefile's own command line.

The test runs ``make stageN PORT=<free port>`` itself (so a broken recipe, a wrong module
name or a missing print fails here), in its own process group, and kills the group after.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import REPO, SERVER_STAGES, free_port

from common.settings import Settings


def make_target(stage: str) -> str:
    return stage.split("_", 1)[0]  # stage3_batching -> stage3


def _lines(process: subprocess.Popen[str], out: queue.Queue[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        out.put(line)


@pytest.fixture
def make_stage(request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen[str], queue.Queue[str]]]:
    """Start ``make <target> PORT=<port>`` and stop its whole process group afterwards."""
    processes: list[subprocess.Popen[str]] = []
    lines: queue.Queue[str] = queue.Queue()

    def start(target: str, port: int) -> subprocess.Popen[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("HOST", "PORT", "MAKEFLAGS", "MFLAGS")}
        process = subprocess.Popen(
            ["make", "--no-print-directory", target, f"PORT={port}"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: make, python, uvicorn
        )
        threading.Thread(target=_lines, args=(process, lines), daemon=True).start()
        processes.append(process)
        return process

    yield start, lines  # type: ignore[misc]
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def test_makefile_defaults_match_the_settings() -> None:
    """`make stageN` listens on 127.0.0.1:8000 unless HOST/PORT say otherwise."""
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^HOST \?= 127\.0\.0\.1$", makefile, re.M)
    assert re.search(r"^PORT \?= 8000$", makefile, re.M)
    assert re.search(r"^export HOST PORT$", makefile, re.M)
    defaults = Settings.model_fields
    assert defaults["host"].default == "127.0.0.1" and defaults["port"].default == 8000


@pytest.mark.timeout(900)  # a first `make` may have to run setup
@pytest.mark.parametrize("stage", SERVER_STAGES)
def test_make_stage_starts_prints_where_it_listens_and_serves(stage: str, make_stage) -> None:  # type: ignore[no-untyped-def]
    start, lines = make_stage
    port = free_port()
    process = start(make_target(stage), port)
    url = f"http://127.0.0.1:{port}"

    output: list[str] = []
    deadline = time.monotonic() + 600
    while not any(f"listening on {url}" in line for line in output):
        assert process.poll() is None, "".join(output)
        assert time.monotonic() < deadline, "".join(output)
        with contextlib.suppress(queue.Empty):
            output.append(lines.get(timeout=1))
    announced = next(line for line in output if "listening on" in line)
    assert stage in announced

    while True:
        assert process.poll() is None, "".join(output)
        assert time.monotonic() < deadline, "not ready in time"
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)

    r = httpx.post(f"{url}/v1/embed", json={"inputs": ["make is the front door"]}, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["embeddings"][0]) == 384


# --- make help: the front door's list ----------------------------------------------------
GROUPS = ["run", "test", "measure", "deploy", "docs"]
STAGE_FAMILY = "stage0 .. stage5"


def make_help() -> dict[str, list[str]]:
    """The groups `make help` prints, each with the targets it lists, in order."""
    done = subprocess.run(["make", "--no-print-directory", "help"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    groups: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        if line and not line.startswith(" "):
            groups[line.split(":")[0]] = []
        elif line.strip():
            name = STAGE_FAMILY if line.strip().startswith(STAGE_FAMILY) else line.split()[0]
            groups[list(groups)[-1]].append(name)
    return groups


def test_make_help_lists_at_most_twenty_targets_in_five_groups() -> None:
    groups = make_help()
    assert list(groups) == GROUPS
    listed = [t for targets in groups.values() for t in targets]
    assert len(listed) <= 20, listed  # stage0 .. stage5 counts once: one family, one line
    assert len(set(listed)) == len(listed)
    assert {"setup", "test", "tools", "results", "compare", "loadtest", STAGE_FAMILY} <= set(listed)
    # `make` alone prints the same list
    alone = subprocess.run(["make", "--no-print-directory"], cwd=REPO, capture_output=True, text=True)
    assert "measure:" in alone.stdout


def test_every_target_make_help_lists_is_a_target() -> None:
    """A line of help for a target that is gone (or misspelled) fails here: `make -n` knows each one."""
    targets = [t for group in make_help().values() for t in group if t != STAGE_FAMILY]
    targets += [f"stage{n}" for n in range(6)]
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    for target in targets:
        done = subprocess.run(["make", "-n", target], cwd=REPO, env=env, capture_output=True, text=True)
        assert done.returncode == 0 and "No rule to make target" not in done.stderr, (target, done.stderr)


def test_the_docs_name_only_targets_make_help_lists() -> None:
    """`make bench-stage3` in a chapter after the target became `make results ONLY=stage3` fails here."""
    listed = {t for group in make_help().values() for t in group} | {"help"}
    pages = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "docs" / "lab").glob("*.md")]
    pages += (REPO / "exercises").rglob("*.md")
    named = {
        (page.name, m.group(1))
        for page in pages
        for m in re.finditer(r"(?:`|^)make ([a-z][a-z0-9-]*)", page.read_text(), re.M)
    }
    unknown = sorted((page, t) for page, t in named if t not in listed and not re.fullmatch(r"stage\d?", t))
    assert not unknown, unknown


def test_the_docs_name_only_steps_make_results_has() -> None:
    """`make results ONLY=windows` in a chapter after windows became part of another step fails here."""
    from benchmarks.results import STEPS

    steps = {s.name for s in STEPS}
    pages = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "docs" / "lab").glob("*.md")]
    named = {
        (page.name, step)
        for page in pages
        for m in re.finditer(r"make results ONLY=([\w,-]+)", page.read_text())
        for step in m.group(1).split(",")
    }
    unknown = sorted((page, step) for page, step in named if step not in steps)
    assert not unknown, unknown


def test_a_listing_of_the_results_steps_installs_nothing() -> None:
    """`make results LIST=1` prints the steps: it neither installs Ray (an optional extra) nor the
    tools, nor builds the model; a full run needs all three (make -n prints what would run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}

    def dry(*args: str) -> str:
        done = subprocess.run(["make", "-n", "-B", "--no-print-directory", "results", *args], cwd=REPO,
                              env=env, capture_output=True, text=True, check=True)  # fmt: skip
        return done.stdout

    listing, run = dry("LIST=1"), dry()
    assert "--list" in listing and ".[cluster]" not in listing and "apt-get" not in listing
    assert "build_model" not in listing
    assert ".[cluster]" in run and "build_model" in run
