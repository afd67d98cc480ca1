"""What the chapters' commands print, run for real (`make results ONLY=docs-outputs`).

    python -m benchmarks.docs_outputs            # into out/results/outputs/<name>.txt
    python -m benchmarks.docs_outputs --record   # into docs/results/outputs/ (what the chapters show)

``outputs.toml`` lists the commands, verbatim, with the stage each needs and its settings. For
each, that stage starts fresh as ``make stageN`` starts it, the command runs in bash from the
repository root with ``URL`` set to the server, and ``outputs/<name>.txt`` gets ``$ command`` and
what it printed, a vector cut to its first numbers. A chapter includes the file in a ``console``
fence. A demo must show its point: an output that does not match its ``shows`` pattern fails the
run. outputs.json (stamped) holds every text too; ``tests/test_docs_outputs.py`` runs each command
again and compares its ``shape``, the lines with numbers and hex ids masked.

Hand-written rather than cog or markdown-exec: both run a command and paste its output into a
page, but here a command needs a stage started fresh with given settings, its output stamped like
every result and included by snippet, and a shape a test can compare. The pasting is the least
of it, and markdown-exec would start servers inside every docs build.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests import evidence, tables
from loadtests.procs import running_stage

MANIFEST = Path(__file__).with_name("outputs.toml")
KEEP = 3  # numbers kept from a long list (an embedding has 384)


@dataclass(frozen=True)
class Output:
    name: str
    command: str
    stage: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    shows: str = ""
    any_order: bool = False


OUTPUTS = tuple(
    Output(name, **{**entry, "command": entry["command"].strip("\n")})
    for name, entry in tomllib.loads(MANIFEST.read_text()).items()
)
# More than one number beyond those kept: cutting one would save nothing.
_NUMBER_LIST = re.compile(rf"\[\s*(?:-?\d[\d.eE+-]*\s*,\s*){{{KEEP + 1},}}-?\d[\d.eE+-]*\s*\]")
_MASKS = (
    (re.compile(r"\b(?=[0-9]*[a-f])[0-9a-f]{8,}\b"), "#"),  # request ids, digests (a letter in them)
    (re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"), "#"),  # every number: values, timings, sizes
)


def cut(text: str) -> str:
    """Long lists of numbers (vectors) shortened to their first ``KEEP`` and a count of the rest."""

    def shorten(m: re.Match[str]) -> str:
        values = [v.strip() for v in m.group(0)[1:-1].split(",")]
        return f"[{', '.join(values[:KEEP])}, … {len(values) - KEEP} more]"

    return _NUMBER_LIST.sub(shorten, text)


def shape(text: str) -> list[str]:
    """The lines with numbers and hex ids masked, each run of spaces as one (`uniq -c` pads)."""
    lines = []
    for line in text.rstrip("\n").splitlines():
        for pattern, mask in _MASKS:
            line = pattern.sub(mask, line)
        lines.append(" ".join(line.split()))
    return lines


def same_shape(output: Output, fresh: str, committed: str) -> bool:
    """Does a fresh run print what was captured, numbers aside (in any order, if allowed)?"""
    a, b = shape(fresh), shape(committed)
    return sorted(a) == sorted(b) if output.any_order else a == b


def printed(output: Output, text: str) -> str:
    """What the command printed: ``text`` without its ``$ command`` line(s)."""
    return text.removeprefix(f"$ {output.command}\n")


def run(output: Output) -> dict[str, Any]:
    """Run ``output`` against a fresh server of its stage (if any); its text, checked."""
    # A `make` started from `make results` would print "make[1]: Entering directory".
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "URL")}

    def bash(url: str | None) -> str:
        done = subprocess.run(
            ["bash", "-c", output.command], cwd=evidence.REPO, env={**env, **({"URL": url} if url else {})},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{output.name}: exit {done.returncode}\n{done.stdout}")
        return cut(done.stdout.rstrip("\n"))

    if output.stage is None:
        out = bash(None)
    else:  # the reader's own API_KEY must not reach the server: the chapters' commands send none
        logs = evidence.OUT / "logs" / "docs_outputs"
        with running_stage(output.stage, logs, output.env, without=("API_KEY",)) as server:
            out = bash(server.url)
    if not re.search(output.shows, out, re.MULTILINE):
        raise RuntimeError(f"{output.name} does not show its point ({output.shows!r}):\n{out}")
    return {"name": output.name, "stage": output.stage, "env": output.env, "command": output.command,
            "text": f"$ {output.command}\n{out}\n"}  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    """outputs.md: which command each captured output ran, against what."""
    rows = [
        (f"`{o['name']}`", o["stage"] or "–", " ".join(f"{k}={v}" for k, v in o["env"].items()) or "defaults",
         f"`{o['command'].splitlines()[0][:60]}`")
        for o in result["outputs"]
    ]  # fmt: skip
    listing = tables.table(["output", "stage", "settings", "command (first line)"], rows, "llll")
    return tables.page(result["stamp"], {"outputs": listing}) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    evidence.add_arguments(parser)  # --quick is accepted for `make results`: the commands are short
    args = parser.parse_args(argv)
    started = evidence.start("benchmarks.docs_outputs", args, argv)
    captured = []
    for output in OUTPUTS:
        captured.append(run(output))
        print(captured[-1]["text"], flush=True)
    folder = started.results_dir
    for old in (folder / "outputs").glob("*.txt"):
        old.unlink()  # an output taken out of the manifest leaves no file behind
    for o in captured:
        evidence.write_text(folder / "outputs" / f"{o['name']}.txt", o["text"])
    evidence.publish(started, "outputs", {"stamp": started.stamp(), "outputs": captured}, markdown)


if __name__ == "__main__":
    main()
