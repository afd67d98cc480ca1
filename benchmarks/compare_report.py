"""Turn the figures of one `make compare` run into docs/results/compare.md and the PNGs in docs/img/."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtests.evidence import save_figure
from loadtests.harness import Profile
from loadtests.tables import num, page, table

STAGE_LABELS = {
    "stage1_naive": "1 naive",
    "stage2_threadpool": "2 thread pool",
    "stage3_batching": "3 batching",
    "stage4_cache_backpressure": "4 cache + backpressure",
    "stage5_metrics": "5 metrics",
}


def add_ratios(
    points: list[dict[str, Any]], profiles: Sequence[Profile], ceiling: dict[str, Any]
) -> list[dict[str, Any]]:
    """Per point: throughput over the previous stage's (same profile), and over the engine ceiling."""
    by_profile = {p.name: p for p in profiles}
    previous: dict[str, dict[str, Any]] = {}
    for point in points:  # in stage order
        profile = by_profile[point["profile"]]
        before = previous.get(point["profile"])
        point["ratio_to_previous"] = point["rps"] / before["rps"] if before and before["rps"] > 0 else None
        point["previous_stage"] = before["stage"] if before else None
        limit = ceiling[profile.text_kind]["texts_per_s"]
        point["ceiling_rps"] = limit / profile.texts_per_request
        point["fraction_of_ceiling"] = point["rps"] / point["ceiling_rps"] if limit > 0 else None
        previous[point["profile"]] = point
    return points


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def markdown(result: dict[str, Any]) -> str:
    """compare.md: the machine, the engine ceiling, one table per profile, the load generator's share."""
    params = result["parameters"]
    note = (
        f"{params['duration_s']:g} s per point after {params['warmup_s']:g} s of warm-up per stage;"
        " every stage with the same texts."
    )
    if result["skipped_stages"]:
        note += f" Skipped (not in this checkout): {', '.join(result['skipped_stages'])}."
    for stage, error in result.get("failed_stages", {}).items():
        note += f"\n\n**{stage} failed** and has no figures: {error}"
    sections: dict[str, list[str]] = {}
    sections["ceiling"] = table(
        ["texts", "engine alone, texts/s", "best batch", "calls side by side"],
        [
            (kind, num(c["texts_per_s"]), c["best_batch"], c.get("best_calls_at_once", 1))
            for kind, c in result["engine_ceiling"].items()
        ],
    )
    for profile in result["profiles"]:
        rows = [p for p in result["points"] if p["profile"] == profile["name"]]
        if not rows:
            continue
        extra = " ".join(profile["options"])
        sections[profile["name"]] = [
            f"`{profile['user_class']}`, {_n(profile['users'], 'user')},"
            f" {_n(profile['texts_per_request'], 'text')} per request,"
            f" {profile['text_kind']} texts{', ' + extra if extra else ''}.",
            "",
            *table(
                ["stage", "req/s", "p50 ms", "p99 ms", "failed: 503 / other", "× previous", "of ceiling",
                 "cores: server / Locust / other"],
                [
                    (STAGE_LABELS.get(p["stage"], p["stage"]), num(p["rps"]), num(p["p50_ms"], 0),
                     num(p["p99_ms"], 0), f"{p['failures']['503']} / {p['failures']['other']}",
                     num(p["ratio_to_previous"], 2, "×"), num(_pct(p["fraction_of_ceiling"]), 0, "%"),
                     f"{p['server_cores']:.2f} / {p['loadgen_cores']:.2f} / {p['other_cores']:.2f}")
                    for p in rows
                ],
            ),
        ]  # fmt: skip
    points = result["points"]
    if points:
        loadgen = [p["loadgen_cores"] for p in points]
        other = [p["other_cores"] for p in points]
        sections["loadgen"] = [
            f"The load generator (one Locust process) used {min(loadgen):.2f} to {max(loadgen):.2f}"
            f" cores per point (mean {sum(loadgen) / len(loadgen):.2f}); everything else on the"
            f" machine used {min(other):.2f} to {max(other):.2f} cores in the same windows.",
        ]
    return page(result["stamp"], sections, note)


def _pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


def plots(result: dict[str, Any], folder: Path) -> list[Path]:
    """Throughput and p99 per stage: unique texts by user count (left), the other profiles (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    stages = result["stages"]
    unique = [p for p in result["profiles"] if p["user_class"] == "UniqueTextUser"]
    others = [p["name"] for p in result["profiles"] if p["user_class"] != "UniqueTextUser"]
    written = []
    for key, label, name, log in (
        ("rps", "requests/s", "compare_throughput.png", False),
        ("p99_ms", "p99 latency (ms)", "compare_p99.png", True),
    ):
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=(1, 1.3))
        for stage in stages:
            xs = [p["users"] for p in unique]
            ys = [
                next((q[key] for q in points if q["stage"] == stage and q["profile"] == p["name"]), None)
                for p in unique
            ]
            pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
            if pairs:
                left.plot(*zip(*pairs, strict=True), marker="o", label=STAGE_LABELS.get(stage, stage))
        left.set_xscale("log", base=2)
        left.set_xticks([p["users"] for p in unique], [str(p["users"]) for p in unique])
        left.minorticks_off()
        left.set_xlabel("concurrent users (unique texts)")
        left.set_ylabel(label)
        if log:
            left.set_yscale("log")
        left.grid(alpha=0.3)
        width = 0.8 / max(len(stages), 1)
        for i, stage in enumerate(stages):
            ys = [
                next((q[key] for q in points if q["stage"] == stage and q["profile"] == n), 0.0)
                for n in others
            ]
            right.bar(
                [j + i * width for j in range(len(others))], ys, width, label=STAGE_LABELS.get(stage, stage)
            )
        right.set_xticks([j + 0.4 - width / 2 for j in range(len(others))], others, fontsize=8)
        right.set_ylabel(label)
        if log:
            right.set_yscale("log")
        right.grid(alpha=0.3, axis="y")
        for ax in (left, right):  # one legend, on the first panel that has anything in it
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
                break
        stamp = result["stamp"]
        tag = " (QUICK run)" if stamp.get("quick") else ""
        fig.suptitle(
            f"{label} per stage, {stamp['machine']['cpu_model']}, {stamp['date'][:10]}{tag}", fontsize=10
        )
        fig.tight_layout()
        written.append(save_figure(fig, folder / name, stamp))
        plt.close(fig)
    return written


def main(argv: Sequence[str] | None = None) -> None:
    """Render compare.md (beside the JSON) and the plots again from a compare.json."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("json", type=Path, nargs="?", default=Path("docs/results/compare.json"))
    parser.add_argument("--img", type=Path, default=Path("docs/img"))
    args = parser.parse_args(argv)
    result = json.loads(args.json.read_text())
    args.json.with_suffix(".md").write_text(markdown(result))
    plots(result, args.img)


if __name__ == "__main__":
    main()
