"""The tables and the plot of ``python -m benchmarks.stage3`` (stage3.md, stage3_sweep.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtests.evidence import save_figure
from loadtests.tables import num, page, table

HTTP_HEAD = ["clients", "req/s", "p50 ms", "p99 ms", "avg batch", "padding"]


def _http_table(points: list[dict[str, Any]], first: str, key: str) -> list[str]:
    return table(
        [first, *HTTP_HEAD],
        [
            (p[key] if key in p else p["stage"], p["clients"], num(p["requests_per_s"]), num(p["p50_ms"]),
             num(p["p99_ms"]), num(p.get("average_batch_size") or None),
             "–" if p.get("padding_ratio") is None else f"{p['padding_ratio']:.0%}")
            for p in points
        ],
    )  # fmt: skip


def _setting(point: dict[str, Any]) -> str:
    keys = ("group_by_length", "split_by_length", "model_variant")
    return ", ".join(f"{k.upper()}={point[k]}" for k in keys if k in point) or "defaults"


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def markdown(out: dict[str, Any]) -> str:
    e, cores = out["engine"], out["stamp"]["machine"]["logical_cores"]
    call, load = e["call_overhead"], out["load_average"]
    note = (
        f"{out['duration_s']:.0f} s per point; 1-minute load average {load['before']:.1f} before the run"
        f" and {load['after']:.1f} after"
        + (f" (above {cores} before it: other work shared the cores, and the absolute numbers are low)."
           if load["before"] > cores else ".")
    )  # fmt: skip
    summary = out["summary"]
    sections = {
        "engine": [f"Engine alone on the same sentences: **{e['texts_per_s']:.0f} texts/s** at batch "
                   f"{e['best_batch']}, {e.get('best_calls_at_once', 1)} call(s) side by side. "
                   f"One more model call costs about {call['fixed_ms']:.2f} ms of CPU, "
                   f"as much as **{call['tokens']:.0f} padded tokens**."],
        "engine_batches": table(["batch size", *e["by_batch"]],
                                [["texts/s", *(num(v, 0) for v in e["by_batch"].values())]]),
        "targets": _http_table(out["targets"], "stage", "stage"),
        "summary": table(["ratio", "measured", "target", "met"],
                         [(k, f"{v:.2f}", summary["target"][k], "yes" if summary["met"][k] else "**no**")
                          for k, v in summary["measured"].items()], align="lrrl"),
        "batch_size": _http_table(out["batch_size"], "MAX_BATCH_SIZE", "max_batch_size"),
        "window": _http_table(out["window"], "BATCH_WINDOW_MS", "batch_window_ms"),
        "concurrency": _http_table(
            [{**p, "setting": f"{p['batch_concurrency']}, {p['batch_window_ms']:g} ms"}
             for p in out.get("concurrency", [])],
            "BATCH_CONCURRENCY, BATCH_WINDOW_MS", "setting"),
        "mixed": _http_table([{**p, "setting": _setting(p)} for p in out["mixed"]], "setting", "setting"),
        "variant": _http_table([{**p, "setting": _setting(p)} for p in out["variant"]], "setting", "setting"),
        "burst": table(["texts", "grouping", "buckets", "batches", "model calls", "padding", "texts/s"],
                       [(b["texts"], _on(b["group_by_length"]), _on(b["split_by_length"]), b["batches"],
                         b["model_calls"], f"{b['padding_ratio']:.0%}", num(b["texts_per_s"]))
                        for b in out["burst"]]),
        "batch_mates": table(["variant", "texts", "min cosine", "mean cosine"],
                             [(v, c["texts"], num(c["min_cosine"], 4), num(c["mean_cosine"], 4))
                              for v, c in out["batch_mates"].items()]),
    }  # fmt: skip
    return page(out["stamp"], sections, note)


def plot(out: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, x_key, label in (
        (axes[0], "batch_size", "max_batch_size", "MAX_BATCH_SIZE (32 clients)"),
        (axes[1], "window", "batch_window_ms", "BATCH_WINDOW_MS (32 clients)"),
    ):
        points = [p for p in out[key] if p["clients"] == 32]
        xs = [str(p[x_key]) for p in points]
        ax.bar(xs, [p["requests_per_s"] for p in points], color="#4a7ab0", label="stage 3 req/s")
        ax.axhline(out["engine"]["texts_per_s"], color="#999", linestyle="--", label="engine alone")
        ax.set_xlabel(label)
        ax.set_ylabel("requests/s")
        twin = ax.twinx()
        twin.plot(xs, [p["p99_ms"] for p in points], color="#c0392b", marker="o")
        twin.set_ylabel("p99 latency (ms)", color="#c0392b")
        twin.set_ylim(bottom=0)
        ax.legend(loc="lower right")
    stamp = out["stamp"]
    m = stamp["machine"]
    fig.suptitle(
        f"stage 3, unique sentences: {m['cpu_model']} ({m['logical_cores']} cores), {stamp['date'][:10]}"
    )
    fig.tight_layout()
    save_figure(fig, path, stamp)
    plt.close(fig)
    return path
