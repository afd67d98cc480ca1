"""What the commands in the chapters print, captured from real runs (`make results ONLY=docs-outputs`).

    python -m benchmarks.docs_outputs                 # every output, into out/results/outputs/
    python -m benchmarks.docs_outputs --record        # into docs/results/outputs/ (what the chapters show)
    python -m benchmarks.docs_outputs --only stage1-embed,stage1-health
    python -m benchmarks.docs_outputs --list          # the manifest: name, stage, command

``OUTPUTS`` below is the manifest: one ``Output`` per command a chapter shows. For each, the stage
it needs is started as ``make stageN`` starts it (``loadtests.procs``, on a free port, with the
output's settings), the command runs in bash from the repository root with ``URL`` set to that
server, and ``outputs/<name>.txt`` gets the command line (``$ `` before it) and what it printed,
with long lists of numbers cut (an embedding is 384 of them). A chapter includes the file inside
a fence::

    ```console
    --8<-- "docs/results/outputs/stage1-embed.txt"
    ```

``outputs.json`` (stamped like every results file) holds every output's text too, and
``tests/test_docs_outputs.py`` runs each command again and checks that it prints the same
*shape*: the same lines once numbers, hex ids and timings are masked (``shape``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.serve import resolve
from loadtests import evidence
from loadtests.procs import running_stage
from loadtests.tables import page, table

FOLDER = "outputs"  # under the results folder: docs/results/outputs/<name>.txt
KEEP = 3  # numbers kept from a long list, the rest counted


@dataclass(frozen=True)
class Output:
    """One command a chapter shows, and what it needs to run."""

    name: str  # the file: outputs/<name>.txt (lower case, digits and dashes)
    command: str  # bash, run from the repository root; a server's address is in $URL
    stage: str | None = None  # "stage1" .. "stage5": started fresh for this output alone
    env: Mapping[str, str] = field(default_factory=dict)  # the server's settings (its environment)
    any_order: bool = False  # its lines may come in any order (two commands that end together)
    timeout_s: float = 120.0


_POST = "curl -s $URL/v1/embed -H 'content-type: application/json'"
# A request long enough to keep the model busy for a while: 64 passages of about 200 words.
_LONG = (
    '.venv/bin/python -c \'import json; print(json.dumps({"inputs": ["many words " * 100] * 64}))\' |\n'
    "  curl -s -o /dev/null -w 'embed answered after %{time_total} s\\n' $URL/v1/embed \\\n"
    "       -H 'content-type: application/json' -d @- &\n"
    "sleep 0.5   # the long request is in the model now\n"
    "curl -s -o /dev/null -w 'health answered after %{time_total} s\\n' $URL/health\n"
    "wait"
)

# --8<-- [start:manifest]
OUTPUTS: tuple[Output, ...] = (
    # stage 0: the model files and the script
    Output("stage0-sizes", "du -h models/all-MiniLM-L6-v2/*/model.onnx"),
    Output(
        "stage0-summary",
        'make stage0 ARGS=\'--summary "How do I reset my password?" "I forgot my login password."\'',
    ),
    Output("stage0-vectors", "make stage0 ARGS='\"a first text\"'"),
    # stage 1: a script pays for the model load on every run; the server pays once
    Output("stage1-script-time", "time make stage0 ARGS='--summary \"a first text\"'"),
    Output("stage1-health", "curl -s $URL/health; echo\ncurl -s $URL/ready; echo", stage="stage1"),
    Output(
        "stage1-embed",
        _POST + ' \\\n     -d \'{"inputs": ["a first text", "a second one"]}\'; echo',
        stage="stage1",
    ),
    Output(
        "stage1-headers",
        "curl -s -D - -o /dev/null $URL/v1/embed -H 'content-type: application/json' \\\n"
        "     -d '{\"inputs\": [\"a first text\"]}' | grep -i '^x-'",
        stage="stage1",
    ),
    Output("stage1-bad-input", _POST + ' -d \'{"input": ["a text"]}\'; echo', stage="stage1"),
    Output("stage1-blocked", _LONG, stage="stage1", any_order=True),  # both answers come together
    # stage 2: the same long request, and /health answered meanwhile
    Output("stage2-not-blocked", _LONG, stage="stage2"),
    # stage 3: 32 requests at once, on stage 2 (one model call each) and on stage 3 (batches)
    Output(
        "stage3-without",
        r"""curl --no-progress-meter -Z -o /dev/null \
     -w '%header{x-total-time} ms in all, %header{x-inference-time} ms in the model\n' \
     -H 'content-type: application/json' -d '{"inputs": ["a sentence sent by 32 clients at once"]}' \
     "$URL/v1/embed?[1-32]" | sort -n | sed -n '1p;16p;32p'""",
        stage="stage2",
    ),
    Output(
        "stage3-run",
        r"""curl --no-progress-meter -Z -o /dev/null \
     -w '%header{x-total-time} ms in all, %header{x-queue-time} ms queued, batch of %header{x-batch-size}\n' \
     -H 'content-type: application/json' -d '{"inputs": ["a sentence sent by 32 clients at once"]}' \
     "$URL/v1/embed?[1-32]" | sort -n | sed -n '1p;16p;32p'
curl -s $URL/v1/batcher/metrics | python3 -c 'import json, sys; m = json.load(sys.stdin)
print({k: m[k] for k in ("texts", "batches", "model_calls", "average_batch_size", "tiers")})'""",
        stage="stage3",
    ),
    # stage 4: what stage 3 lacks (a cache, a bound), then the cache, the bound and a 504 by hand
    Output(
        "stage4-without-cache",
        r"""for i in 1 2 3; do
  curl -s -o /dev/null -w '%header{x-inference-time} ms in the model\n' $URL/v1/embed \
       -H 'content-type: application/json' -d '{"inputs": ["the same sentence, sent again"]}'
done""",
        stage="stage3",
    ),
    Output(
        "stage4-without-bound",
        r"""passage=$(python3 -c 'print("a long passage of words " * 40)')
curl --no-progress-meter -Z --parallel-max 200 -o /dev/null -w '%{http_code} after %{time_total} s\n' \
     -H 'content-type: application/json' -d "{\"inputs\": [\"$passage\"]}" \
     "$URL/v1/embed?[1-200]" | sort -k3 -n | sed -n '1p;100p;200p'""",
        stage="stage3",
    ),
    Output(
        "stage4-run",
        r"""for i in 1 2 3; do
  curl -s -o /dev/null -w '%header{x-cache}: %header{x-inference-time} ms in the model\n' $URL/v1/embed \
       -H 'content-type: application/json' -d '{"inputs": ["the same sentence, sent again"]}'
done
body=$(python3 -c 'import json; print(json.dumps({"inputs": [f"passage {i}: " + "words to read " * 60 for i in range(16)]}))')
curl --no-progress-meter -Z --parallel-immediate -o /dev/null -H 'content-type: application/json' \
     -d "$body" "$URL/v1/embed?[1-32]"
curl -s $URL/v1/cache/metrics | python3 -c 'import json, sys; m = json.load(sys.stdin)
print({"hits": m["cache"]["hits"], "deduplicated": m["deduplicated"], "rejected": m["rejected"]})'""",
        stage="stage4",
    ),
    Output(
        "stage4-run-bound",
        r"""passage=$(python3 -c 'print("a long passage of words " * 40)')
curl --no-progress-meter -Z --parallel-max 200 -o /dev/null -w '%{http_code}\n' -H 'content-type: application/json' \
     -d "{\"inputs\": [\"$passage\"], \"cache\": false}" "$URL/v1/embed?[1-200]" | sort | uniq -c""",
        stage="stage4",
        env={"MAX_QUEUE": "4"},
    ),
    Output(
        "stage4-run-504",
        r"""curl -s -H 'X-Request-Timeout: 0.000001' \
     -H 'content-type: application/json' \
     -d '{"inputs": ["a text that is not in the cache yet"]}' $URL/v1/embed; echo""",
        stage="stage4",
    ),
    # stage 5: what stage 4 can tell, then what stage 5 counts
    Output(
        "stage5-without",
        r"""curl -s -o /dev/null -w 'GET /metrics: %{http_code}\n' $URL/metrics
curl -s $URL/v1/cache/metrics | python3 -c 'import json, sys; print(sorted(json.load(sys.stdin)))'""",
        stage="stage4",
    ),
    Output(
        "stage5-run",
        r"""curl --no-progress-meter -Z -o /dev/null -H 'content-type: application/json' \
     -d '{"inputs": ["a sentence sent by 32 clients at once"]}' "$URL/v1/embed?[1-32]"
curl -s $URL/metrics | grep -E '^embedserve_(requests_total\{route="/v1/embed"|batches_total|queue_depth)'
curl -s $URL/v1/metrics | python3 -c 'import json, sys; m = json.load(sys.stdin)
print(sorted(m), sorted(m["last_minute"]))'""",
        stage="stage5",
    ),
)
# --8<-- [end:manifest]


# --- running a command -------------------------------------------------------------------
_NUMBER_LIST = re.compile(rf"\[\s*(?:-?\d[\d.eE+-]*\s*,\s*){{{KEEP},}}-?\d[\d.eE+-]*\s*\]")


def cut(text: str, keep: int = KEEP) -> str:
    """Long lists of numbers (vectors) shortened to their first ``keep`` and a count of the rest."""

    def shorten(m: re.Match[str]) -> str:
        values = [v.strip() for v in m.group(0)[1:-1].split(",")]
        if len(values) <= keep + 1:
            return m.group(0)
        return f"[{', '.join(values[:keep])}, … {len(values) - keep} more]"

    return _NUMBER_LIST.sub(shorten, text)


def shown(command: str) -> str:
    """The command as a chapter shows it: a prompt before the first line."""
    return "$ " + command


def run_command(output: Output, url: str | None) -> dict[str, Any]:
    """Run ``output.command`` with ``URL`` set; what it printed, cut, and how it exited."""
    # A `make` started from `make results` would otherwise print "make[1]: Entering directory".
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "URL")}
    env.update({"URL": url} if url else {})
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", output.command],
        cwd=evidence.REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=output.timeout_s,
    )
    printed = cut(done.stdout.rstrip("\n"))
    if done.returncode != 0:
        raise RuntimeError(f"{output.name}: exit {done.returncode}\n{shown(output.command)}\n{printed}")
    return {
        "name": output.name,
        "stage": output.stage,
        "env": dict(output.env),
        "command": output.command,
        "exit_code": done.returncode,
        "seconds": round(time.monotonic() - started, 2),
        "text": f"{shown(output.command)}\n{printed}\n",
    }


def capture(outputs: Sequence[Output]) -> Iterator[dict[str, Any]]:
    """Each output's run, in manifest order, each against a server of its own started fresh."""
    for output in outputs:
        if output.stage is None:
            yield run_command(output, None)
            continue
        logs = evidence.OUT / "logs" / "docs_outputs"
        # The reader's own API_KEY must not reach the server: the chapters' commands send none.
        with running_stage(resolve(output.stage), logs, output.env, without=("API_KEY",)) as server:
            yield run_command(output, server.url)


# --- shape: what a fresh run must keep ---------------------------------------------------
_MASKS = (
    (re.compile(r"\b(?=[0-9]*[a-f])[0-9a-f]{8,}\b"), "#"),  # request ids, digests (a letter in them)
    (re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"), "#"),  # every number: values, timings, sizes
)


def shape(text: str) -> list[str]:
    """The lines of ``text`` with numbers, hex ids and timings masked, and each run of spaces as one
    (a count of another width moves the padding around it: `uniq -c`, tables)."""
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


# --- the results page --------------------------------------------------------------------
def markdown(result: dict[str, Any]) -> str:
    """outputs.md: which command each captured output ran, against what."""
    rows = []
    for o in result["outputs"]:
        settings = " ".join(f"{k}={v}" for k, v in o["env"].items())
        first = o["command"].splitlines()[0]
        rows.append((f"`{o['name']}`", o["stage"] or "–", settings or "defaults", f"`{first[:60]}`"))
    listing = table(["output", "stage", "settings", "command (first line)"], rows, "llll")
    return page(result["stamp"], {"outputs": listing}) + "\n"


def write(result: dict[str, Any], results_dir: Path) -> list[Path]:
    """outputs.json, outputs.md and one outputs/<name>.txt per output."""
    folder = results_dir / FOLDER
    written = [evidence.write_text(folder / f"{o['name']}.txt", o["text"]) for o in result["outputs"]]
    written.append(evidence.write_json(results_dir / "outputs.json", result))
    written.append(evidence.write_text(results_dir / "outputs.md", markdown(result)))
    return written


def merge(earlier: dict[str, Any] | None, fresh: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every output in manifest order: this run's, else an earlier run's (``--only``)."""
    by_name = {o["name"]: o for o in (earlier or {}).get("outputs", [])}
    by_name.update({o["name"]: o for o in fresh})
    return [by_name[o.name] for o in OUTPUTS if o.name in by_name]


def select(only: str | None) -> list[Output]:
    if not only:
        return list(OUTPUTS)
    wanted = {n.strip() for n in only.split(",") if n.strip()}
    unknown = sorted(wanted - {o.name for o in OUTPUTS})
    if unknown:
        raise SystemExit(f"unknown output(s) {unknown}; `--list` shows them")
    return [o for o in OUTPUTS if o.name in wanted]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", help="comma-separated output names (the others are kept)")
    parser.add_argument("--list", action="store_true", help="print the manifest and stop")
    parser.add_argument(
        "--out", type=Path, help="results folder (default: out/results, docs/results with --record)"
    )
    evidence.add_arguments(parser)  # --quick is accepted for `make results`; the commands are short anyway
    args = parser.parse_args(argv)
    if args.list:
        for o in OUTPUTS:
            print(f"{o.name:24s} {o.stage or '-':8s} {o.command.splitlines()[0]}")
        return 0
    run = evidence.start("benchmarks.docs_outputs", args, argv)
    folder = args.out or run.results_dir
    fresh = []
    for done in capture(select(args.only)):
        print(done["text"], flush=True)
        fresh.append(done)
    earlier_path = folder / "outputs.json"
    earlier = json.loads(earlier_path.read_text()) if args.only and earlier_path.is_file() else None
    result = {"stamp": run.stamp(), "outputs": merge(earlier, fresh)}
    for path in write(result, folder):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
