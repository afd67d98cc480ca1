"""What a soak run leaves behind: its JSON, the Markdown tables the docs include, and the plot.

Kept apart from ``soak.py`` (which runs the soak) so each file reads on its own; this module works
on the saved JSON alone (``soak.py`` imports it, never the other way round).

    python -m benchmarks.reliability.soak_report docs/results/soak.json docs/img/soak.png   # redraw
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from loadtests import evidence
from loadtests.tables import page, table


def plot(payload: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    intervals, interval_s = payload["intervals"], payload["interval_s"]
    t = [iv["t"] for iv in intervals]
    fig, (lat, rss, rate, cpu) = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    for key, style in (("p50_ms", "-"), ("p95_ms", "--"), ("p99_ms", ":")):
        lat.plot(t, [iv[key] for iv in intervals], style, label=key.removesuffix("_ms"))
    lat.set_ylabel("latency (ms)")
    lat.legend(loc="upper right")
    rss.plot(t, [iv["rss_mib"] for iv in intervals], color="tab:purple")
    rss.set_ylabel("server RSS (MiB)")
    rate.plot(t, [iv["requests"] / interval_s for iv in intervals], label="answered / s")
    rate.plot(t, [iv["errors"] for iv in intervals], color="tab:red", label="errors")
    rate.set_ylabel("requests")
    rate.legend(loc="upper right")
    # Who had the cores: a stall with "other processes" up is a neighbour's, not the server's.
    for key, label in (
        ("server_cpu_pct", "server"),
        ("client_cpu_pct", "load client"),
        ("redis_cpu_pct", "Redis"),
        ("others_cpu_pct", "other processes"),
        ("steal_pct", "steal"),
    ):
        cpu.plot(t, [iv.get(key, 0.0) for iv in intervals], label=label)
    cpu.set_ylabel("CPU (% of one core)")
    cpu.set_xlabel("seconds")
    cpu.legend(loc="upper right", fontsize="small", ncol=5)
    for ax in (lat, rss, rate, cpu):
        ax.axvspan(0, payload["warmup_s"], color="0.9")
        ax.grid(alpha=0.3)
    verdict = "PASS" if payload["verdict"].get("passed") else "FAIL"
    target, capacity = payload["target_rps"], payload["capacity_rps"]
    fig.suptitle(
        f"stage 5 soak, Redis tier on: {target:.0f} req/s ({target / capacity:.0%} of {capacity:.0f}), "
        f"{payload['duration_s'] / 60:.0f} min, {payload['errors']} errors: {verdict}"
    )
    fig.tight_layout()
    evidence.save_figure(fig, path, payload["stamp"], dpi=100)
    plt.close(fig)
    return path


def write(payload: dict[str, Any], out: Path) -> Path:
    """``out`` (JSON, every interval) and the same name with ``.md`` (the tables the docs include)."""
    evidence.write_json(out, payload, indent=1)
    evidence.write_text(out.with_suffix(".md"), markdown(payload))
    return out


def markdown(payload: dict[str, Any]) -> str:
    """soak.md: the verdict and who had the cores."""
    v, load = payload["verdict"], payload["load_average"]
    note = (
        f"1-minute load average {load['before'][0]} before the soak, {load['after'][0]} after:"
        " the machine is shared."
    )
    windows = ", ".join(f"{c:g}" for c in payload.get("capacity_windows_rps", []))
    yes = {True: "yes", False: "**no**"}
    verdict = table(
        ["duration", "capacity, lowest window (req/s)", "sent at", "requests", "errors",
         "p99, first / last third", "RSS after warm-up → end", "passed"],
        [(f"{payload['duration_s']:g} s", f"{payload['capacity_rps']} ({windows})",
          f"{payload['target_rps']} req/s", payload["sent"], payload["errors"],
          f"{v['p99_first_third_ms']} / {v['p99_last_third_ms']} ms",
          f"{v['rss_after_warmup_mib']} → {v['rss_end_mib']} MiB ({v['rss_growth'] * 100:+.1f}%)",
          yes[v["passed"]])],
    )  # fmt: skip
    return page(payload["stamp"], {"verdict": verdict, "cores": _cores(payload)}, note)


def _cores(payload: dict[str, Any]) -> list[str]:
    """Who had the cores after warm-up (percent of one core), and what the server itself saw:
    its queue and its Redis errors."""
    steady = [iv for iv in payload["intervals"] if iv["t"] > payload["warmup_s"]]

    def med(key: str) -> str:
        values = sorted(iv.get(key) or 0.0 for iv in steady)
        return f"{values[len(values) // 2]:g}"

    def top(key: str) -> str:
        return f"{max((iv.get(key) or 0.0) for iv in steady):g}"

    keys = ("server_cpu_pct", "client_cpu_pct", "redis_cpu_pct", "others_cpu_pct", "steal_pct")
    redis_errors = max((iv.get("redis_errors") or 0.0) for iv in payload["intervals"])
    return table(
        [f"after warm-up, per {payload['interval_s']:g} s", "server CPU", "client CPU", "Redis CPU",
         "other processes", "steal", "server queue (texts)", "Redis errors (whole run)"],
        [("median", *(f"{med(k)}%" for k in keys), med("queue_depth"), f"{redis_errors:g}"),
         ("highest", *(f"{top(k)}%" for k in keys), top("queue_depth"), "")],
    )  # fmt: skip


def redraw(out: Path, plot_path: Path) -> None:
    """Rewrite the Markdown and the plot from a soak's JSON, without running it again."""
    saved = json.loads(out.read_text())
    evidence.write_text(out.with_suffix(".md"), markdown(saved))
    plot(saved, plot_path)


if __name__ == "__main__":
    redraw(Path(sys.argv[1]), Path(sys.argv[2]))
