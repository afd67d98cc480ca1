"""Stage 2's two thread settings, measured together: WORKER_THREADS x ONNX_INTRA_THREADS (x spinning).

    python -m benchmarks.stage2_threads            # about 7 minutes; run it on a quiet machine
    python -m benchmarks.stage2_threads --quick    # about a minute, to see that it works
    python -m benchmarks.stage2_threads --record   # written to docs/results/ and docs/img/

The pool runs WORKER_THREADS model calls at once and each call uses ONNX_INTRA_THREADS
threads (0: ONNX Runtime's default, one per core), so on 2 cores ``2 x 2`` asks for four
busy threads plus the event loop. With ONNX_SPINNING on, idle ONNX threads spin instead of
sleeping, which burns the cores the HTTP side needs. Each combination runs as a stage 2
server and is loaded by 8 and 32 closed-loop clients sending one unique sentence per
request, in rounds (see ``sweep``).

Writes stage2_threads.json and .md (tables for the chapter), and stage2_threads.png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson

from common import corpus
from common.settings import Settings
from loadtests import evidence
from loadtests.httpload import post_requests, run_load
from loadtests.load import settle
from loadtests.procs import running_stage
from loadtests.tables import page, table

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


def sweep(
    seconds: float, warmup: float, clients: tuple[int, ...], rounds: int, logs: Path
) -> list[dict[str, Any]]:
    """Every combination runs as its own server, all at once (idle ones cost nothing); the rounds
    visit them in a new random order each time, so a busy spell of the machine hits them all alike.
    A point's figure is the median of its rounds."""
    texts = corpus.texts(20_000, seed=2, kind="sentence")
    requests = post_requests("/v1/embed", [orjson.dumps({"inputs": [t]}) for t in texts])
    combos = list(itertools.product(WORKERS, INTRA, SPINNING))
    rng = random.Random(0)
    runs: dict[tuple[int, int, bool, int], list[dict[str, Any]]] = {}
    with ExitStack() as stack:
        servers = {
            combo: stack.enter_context(running_stage("stage2_threadpool", logs, _env(*combo)))
            for combo in combos
        }
        for r in range(rounds):
            for combo in rng.sample(combos, len(combos)):
                server = servers[combo]
                for n in clients:
                    settle(server.pid, server.url)
                    run = run_load(server.host, server.port, requests, n, seconds, warmup)
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


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
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
    evidence.save_figure(fig, path, result["stamp"], dpi=100)
    plt.close(fig)
    return path


def markdown(result: dict[str, Any]) -> str:
    """stage2_threads.md: snippet sections for the stage 2 chapter."""
    note = f"{result['rounds']} round(s) of {result['seconds_per_point']} s per point, median round shown."
    clients = sorted({p["clients"] for p in result["points"]})
    best = result["best"]
    combos = sorted(
        {(p["worker_threads"], p["onnx_intra_threads"], p["onnx_spinning"]) for p in result["points"]}
    )
    rows = []
    for workers, intra, spinning in combos:
        mark = "**" if (workers, intra, spinning) == (
            best["worker_threads"], best["onnx_intra_threads"], best["onnx_spinning"]
        ) else ""  # fmt: skip
        row: list[Any] = [
            f"{mark}{workers}{mark}",
            intra if intra else "0 (auto)",
            "on" if spinning else "off",
        ]
        for n in clients:
            p = next(
                x
                for x in result["points"]
                if (x["worker_threads"], x["onnx_intra_threads"], x["onnx_spinning"], x["clients"])
                == (workers, intra, spinning, n)
            )
            row += [p["requests_per_s"], p["p99_ms"]]
        rows.append(row)
    head = ["WORKER_THREADS", "ONNX_INTRA_THREADS", "ONNX_SPINNING"]
    head += [h for n in clients for h in (f"req/s @{n}", f"p99 ms @{n}")]
    d = result["settings_defaults"]

    def combo(x: dict[str, Any]) -> str:
        spin = str(x["onnx_spinning"]).lower()
        threads = f"WORKER_THREADS={x['worker_threads']}, ONNX_INTRA_THREADS={x['onnx_intra_threads']}"
        return f"{threads}, ONNX_SPINNING={spin}"

    best_line = (
        f"Best in this run (most requests/s over both client counts): {combo(best)}."
        f" The defaults in `common/settings.py`: {combo(d)}."
    )
    return page(result["stamp"], {"table": table(head, rows), "best": [best_line]}, note)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per point and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="folder for stage2_threads.json and .md")
    parser.add_argument("--img", type=Path, help="folder for stage2_threads.png")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.stage2_threads", args, argv)
    seconds, warmup, rounds = (2.0, 0.5, 1) if args.quick else (args.duration, 1.0, args.rounds)
    points = sweep(seconds, warmup, CLIENTS, rounds, run.logs("stage2_threads"))
    result = {
        "stamp": run.stamp(),
        "seconds_per_point": seconds,
        "rounds": rounds,
        "text_kind": "sentence",
        "texts_per_request": 1,
        "points": points,
        **summarize(points),
    }
    out, img = args.out or run.results_dir, args.img or run.img_dir
    written = [
        evidence.write_json(out / "stage2_threads.json", result),
        evidence.write_text(out / "stage2_threads.md", markdown(result)),
        plot(result, img / "stage2_threads.png"),
    ]
    print(json.dumps(result["best"]), "->", ", ".join(str(p) for p in written))


if __name__ == "__main__":
    main()
