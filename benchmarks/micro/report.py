"""pytest-benchmark's JSON -> bench.md (the table the docs include); ``benchmarks.micro`` calls it."""

from __future__ import annotations

import re
from typing import Any

from loadtests.evidence import describe
from loadtests.tables import num, page, table


def trim(data: dict[str, Any]) -> dict[str, Any]:
    """Drop the raw per-round times, which would make the file megabytes (the statistics stay)."""
    for bench in data["benchmarks"]:
        bench["stats"].pop("data", None)
    return data


def _order(bench: dict[str, Any]) -> tuple[str, list[Any]]:
    """By group, then by name with numbers compared as numbers (``[8]`` before ``[64]``)."""
    parts = re.split(r"(\d+)", bench["name"])
    return bench.get("group") or "", [int(p) if p.isdigit() else p for p in parts]


def _items(bench: dict[str, Any]) -> int:
    extra = bench.get("extra_info", {})
    return int(extra.get("texts") or extra.get("requests") or extra.get("keys") or 1)


def markdown(data: dict[str, Any]) -> str:
    rows = [
        (b.get("group") or "", f"`{b['name']}`", num(s["median"] * 1e6), num(s["mean"] * 1e6),
         num(s["min"] * 1e6), s["rounds"], num(s["median"] / _items(b) * 1e6))
        for b in sorted(data["benchmarks"], key=_order)
        for s in [b["stats"]]
    ]  # fmt: skip
    bench = [
        f"{describe(data['stamp'])} Times in microseconds.",
        "",
        *table(["group", "benchmark", "median µs", "mean µs", "min µs", "rounds", "per item µs"], rows),
    ]
    return page(data["stamp"], {"bench": bench})


def headline(data: dict[str, Any]) -> dict[str, float]:
    return {f"{b['name']} median µs": b["stats"]["median"] * 1e6 for b in data["benchmarks"]}
