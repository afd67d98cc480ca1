"""Stage 2's two thread settings, measured together: WORKER_THREADS x ONNX_INTRA_THREADS (x spinning).

    python -m benchmarks.stage2_threads            # about 9 minutes; run it on a quiet machine
    python -m benchmarks.stage2_threads --quick    # about a minute, to see that it works

The pool runs WORKER_THREADS model calls at once and each call uses ONNX_INTRA_THREADS
threads (0: ONNX Runtime's default, one per core), so on 2 cores ``2 x 2`` asks for four
busy threads plus the event loop. With ONNX_SPINNING on, idle ONNX threads spin instead of
sleeping, which burns the cores the HTTP side needs. Each combination runs as a stage 2
server and is loaded by 8 and 32 closed-loop clients sending one unique sentence per
request, in rounds (see ``sweep``).

Writes docs/results/stage2_threads.json and .md (tables for the chapter), and
docs/img/stage2_threads.png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson

from common.settings import Settings
from loadtests.harness import REPO, running_stage, settle
from loadtests.httpload import post_requests, run_load
from loadtests.machine import machine_info
from loadtests.procs import free_port
from stage0_script import corpus

RESULTS = REPO / "docs" / "results" / "stage2_threads.json"
PLOT = REPO / "docs" / "img" / "stage2_threads.png"
HOST = "127.0.0.1"
WORKERS = (1, 2)
INTRA = (1, 2, 0)
SPINNING = (False, True)
CLIENTS = (8, 32)


def _env(workers: int, intra: int, spinning: bool) -> dict[str, str]:
    return {
        "WORKER_THREADS": str(workers),
        "ONNX_INTRA_THREADS": str(intra),
        "ONNX_SPINNING": str(spinning).lower(),
    }


def sweep(seconds: float, warmup: float, clients: tuple[int, ...], rounds: int) -> list[dict[str, Any]]:
    """Every combination runs as its own server, all at once (idle ones cost nothing); the rounds
    visit them in a new random order each time, so a busy spell of the machine hits them all alike.
    A point's figure is the median of its rounds."""
    texts = corpus.texts(20_000, seed=2, kind="sentence")
    requests = post_requests("/v1/embed", [orjson.dumps({"inputs": [t]}) for t in texts])
    combos = list(itertools.product(WORKERS, INTRA, SPINNING))
    rng = random.Random(0)
    runs: dict[tuple[int, int, bool, int], list[dict[str, Any]]] = {}
    with ExitStack() as stack:
        servers = {}
        for combo in combos:
            port = free_port()
            log = REPO / ".benchmarks" / "threads-{}-{}-{}.log".format(*combo)
            process = stack.enter_context(running_stage("stage2_threadpool", HOST, port, log, _env(*combo)))
            servers[combo] = (port, process)
        for r in range(rounds):
            for combo in rng.sample(combos, len(combos)):
                port, process = servers[combo]
                for n in clients:
                    settle(process.pid, f"http://{HOST}:{port}")
                    run = run_load(HOST, port, requests, n, seconds, warmup)
                    print(json.dumps({"round": r, "combo": combo, **run}), flush=True)
                    runs.setdefault((*combo, n), []).append(run)
    points = []
    for (workers, intra, spinning, _clients), rs in runs.items():
        median = sorted(rs, key=lambda x: x["requests_per_s"])[len(rs) // 2]
        points.append(
            {
                "worker_threads": workers,
                "onnx_intra_threads": intra,
                "onnx_spinning": spinning,
                **median,
                "rounds_requests_per_s": [x["requests_per_s"] for x in rs],
            }
        )
    points.sort(
        key=lambda p: (p["worker_threads"], p["onnx_intra_threads"], p["onnx_spinning"], p["clients"])
    )
    return points


def summarize(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The combination with the most requests/s summed over the client counts (ties: lower p99)."""
    by_combo: dict[tuple[int, int, bool], list[dict[str, Any]]] = {}
    for p in points:
        by_combo.setdefault((p["worker_threads"], p["onnx_intra_threads"], p["onnx_spinning"]), []).append(p)

    def score(item: tuple[tuple[int, int, bool], list[dict[str, Any]]]) -> tuple[float, float]:
        _, ps = item
        return (sum(p["requests_per_s"] for p in ps), -max(p["p99_ms"] or 0 for p in ps))

    (workers, intra, spinning), ps = max(by_combo.items(), key=score)
    defaults = Settings.model_fields
    return {
        "best": {"worker_threads": workers, "onnx_intra_threads": intra, "onnx_spinning": spinning},
        "best_points": ps,
        "settings_defaults": {
            "worker_threads": defaults["worker_threads"].default,
            "onnx_intra_threads": defaults["onnx_intra_threads"].default,
            "onnx_spinning": defaults["onnx_spinning"].default,
        },
    }


def plot(points: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients = sorted({p["clients"] for p in points})
    fig, axes = plt.subplots(1, len(clients), figsize=(5 * len(clients), 4), sharey=True, squeeze=False)
    for ax, n in zip(axes[0], clients, strict=True):
        ps = [p for p in points if p["clients"] == n]
        labels = [
            f"{p['worker_threads']}x{p['onnx_intra_threads'] or 'auto'}"
            + (" spin" if p["onnx_spinning"] else "")
            for p in ps
        ]
        colors = ["tab:red" if p["onnx_spinning"] else "tab:blue" for p in ps]
        ax.barh(labels, [p["requests_per_s"] for p in ps], color=colors)
        ax.set_title(f"{n} clients")
        ax.set_xlabel("requests/s (one sentence each)")
    fig.suptitle("Stage 2: WORKER_THREADS x ONNX_INTRA_THREADS (red: ONNX_SPINNING on)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def markdown(result: dict[str, Any]) -> str:
    """docs/results/stage2_threads.md: snippet sections for the stage 2 chapter."""
    m = result["machine"]
    lines = [f"<!-- generated by `{result['command']}`; do not edit -->", "<!-- --8<-- [start:machine] -->"]
    lines.append(
        f"Measured by `{result['command']}` on {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB"
        f" memory, {m['date']}; {result['rounds']} round(s) of {result['seconds_per_point']} s per point,"
        " median round shown."
    )
    lines += ["<!-- --8<-- [end:machine] -->", "", "<!-- --8<-- [start:table] -->"]
    clients = sorted({p["clients"] for p in result["points"]})
    head = "| WORKER_THREADS | ONNX_INTRA_THREADS | ONNX_SPINNING |"
    head += "".join(f" req/s @{n} | p99 ms @{n} |" for n in clients)
    lines += [head, "|---|---|---|" + "---|---|" * len(clients)]
    best = result["best"]
    combos = sorted(
        {(p["worker_threads"], p["onnx_intra_threads"], p["onnx_spinning"]) for p in result["points"]}
    )
    for workers, intra, spinning in combos:
        row = f"| {workers} | {intra if intra else '0 (auto)'} | {'on' if spinning else 'off'} |"
        for n in clients:
            p = next(
                x
                for x in result["points"]
                if (x["worker_threads"], x["onnx_intra_threads"], x["onnx_spinning"], x["clients"])
                == (workers, intra, spinning, n)
            )
            row += f" {p['requests_per_s']} | {p['p99_ms']} |"
        if (workers, intra, spinning) == (
            best["worker_threads"],
            best["onnx_intra_threads"],
            best["onnx_spinning"],
        ):
            row = row.replace(f"| {workers} |", f"| **{workers}** |", 1)
        lines.append(row)
    lines += ["<!-- --8<-- [end:table] -->", "", "<!-- --8<-- [start:best] -->"]
    d = result["settings_defaults"]

    def combo(x: dict[str, Any]) -> str:
        spin = str(x["onnx_spinning"]).lower()
        threads = f"WORKER_THREADS={x['worker_threads']}, ONNX_INTRA_THREADS={x['onnx_intra_threads']}"
        return f"{threads}, ONNX_SPINNING={spin}"

    lines.append(
        f"Best in this run (most requests/s over both client counts): {combo(best)}."
        f" The defaults in `common/settings.py`: {combo(d)}."
    )
    lines += ["<!-- --8<-- [end:best] -->", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="one round of 2 s points, to check that it works"
    )
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per point and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--render", action="store_true", help="only rewrite the .md and .png from --out")
    args = parser.parse_args(argv)
    if args.render:
        result = json.loads(args.out.read_text())
        args.out.with_suffix(".md").write_text(markdown(result))
        plot(result["points"], args.plot)
        return
    seconds, warmup, rounds = (2.0, 0.5, 1) if args.quick else (args.duration, 1.0, args.rounds)
    (REPO / ".benchmarks").mkdir(exist_ok=True)
    points = sweep(seconds, warmup, CLIENTS, rounds)
    command = "python -m benchmarks.stage2_threads" + (" --quick" if args.quick else "")
    result = {
        "command": command,
        "machine": machine_info(),
        "seconds_per_point": seconds,
        "rounds": rounds,
        "text_kind": "sentence",
        "texts_per_request": 1,
        "points": points,
        **summarize(points),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    plot(points, args.plot)
    print(json.dumps(result["best"]), "->", args.out)


if __name__ == "__main__":
    main()
