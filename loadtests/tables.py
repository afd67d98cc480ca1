"""The one way results become Markdown: tables by ``tabulate``, named sections the docs include.

A results page is its provenance line, then named sections (``--8<-- [start:name]`` ...
``[end:name]``) that the chapters include with ``--8<-- "docs/results/x.md:name"``. Keep tables to
about eight short columns: the docs render at about 1400 px, and a wider table scrolls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tabulate import tabulate

from loadtests.evidence import describe, provenance_comment

ALIGN = {"l": "left", "r": "right", "c": "center"}


def num(value: float | None, digits: int = 1, suffix: str = "") -> str:
    """A number for a table cell: thousands separated, ``–`` when missing."""
    return "–" if value is None else f"{value:,.{digits}f}{suffix}"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> list[str]:
    """A Markdown pipe table; ``align`` is one letter per column (default: ``l`` then ``r``)."""
    rows = [["–" if cell is None else str(cell) for cell in row] for row in rows]
    align = align or "l" + "r" * (len(headers) - 1)
    text = tabulate(rows, headers=list(headers), tablefmt="pipe", disable_numparse=True,
                    colalign=[ALIGN[a] for a in align])  # fmt: skip
    return text.splitlines()


def section(name: str, lines: Sequence[str]) -> list[str]:
    """A named part of a results page, for ``--8<-- "docs/results/page.md:name"``."""
    return [f"<!-- --8<-- [start:{name}] -->", *lines, f"<!-- --8<-- [end:{name}] -->", ""]


def stage_label(stage: str) -> str:
    """``stage3_batching`` -> ``stage 3``, for a table's column or row; any other name as it is."""
    number = stage.removeprefix("stage").split("_")[0]
    return f"stage {number}" if stage.startswith("stage") and number.isdigit() else stage


def page(stamp: Mapping[str, Any], sections: Mapping[str, Sequence[str]], machine_note: str = "") -> str:
    """A whole results page: the provenance line, a ``machine`` section from the stamp, then ``sections``."""
    lines = [provenance_comment(dict(stamp)), ""]
    lines += section("machine", [describe(dict(stamp)) + (f" {machine_note}" if machine_note else "")])
    for name, body in sections.items():
        lines += section(name, body)
    return "\n".join(lines)
