"""Every stage chapter has the same shape, the main path stays short, and no command hard-codes a port.

The shape (docs/stage0.md .. stage5.md): a `# Stage N · title`, a box saying what the stage wins and
under which load, then exactly these `##` sections in this order: what goes wrong without it, the
idea, the code, run it, measured (against the stage before), recap, exercises; the chapter ends with
a link to its lab notes when it has some. The main path (index and the six stage chapters) stays
under MAIN_PATH_WORDS words, counted as `wc -w` counts them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
STAGES = range(6)
SECTIONS = (
    "What goes wrong without it",
    "The idea",
    "The code",
    "Run it",
    "Measured",  # "Measured against stage N-1" (stage 0: fp32 against INT8)
    "Recap",
    "Exercises",
)
MAIN_PATH = ("index.md", *(f"stage{n}.md" for n in STAGES))
MAIN_PATH_WORDS = 12_000
RECAP_LINES = 5
FENCE = re.compile(r"^\s*(```|~~~)")
# A command that names a port where $URL (or a make variable) belongs: localhost:8000, 127.0.0.1:8089 ...
# (a Redis URL is a setting's value, CACHE_URL, and 6379 Redis's own default: not the server's address)
HARD_PORT = re.compile(r"(?<!redis://)(?<!rediss://)\b(?:localhost|127\.0\.0\.1|0\.0\.0\.0|\[::1\]):\d+")
SHELL = ("bash", "console", "sh", "shell", "")


def outside_fences(text: str) -> list[str]:
    """The lines of a page that are not inside a ``` fence."""
    lines, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
            continue
        if fence is None:
            lines.append(line)
    return lines


def shell_blocks(text: str) -> list[list[str]]:
    """The lines of every fenced block whose language is a shell (or none)."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    fence: str | None = None
    for line in text.splitlines():
        m = re.match(r"^\s*(```|~~~)\s*([\w-]*)", line)
        if m and fence is None:
            fence = m.group(1)
            current = [] if m.group(2) in SHELL else None
            continue
        if m and line.strip() == fence:
            if current is not None:
                blocks.append(current)
            fence, current = None, None
            continue
        if current is not None:
            current.append(line)
    return blocks


def h2(text: str) -> list[str]:
    return [line[3:].strip() for line in outside_fences(text) if line.startswith("## ")]


def shape_problems(name: str, text: str, stage: int, repo: Path = REPO) -> list[str]:
    """Why ``text`` (the chapter of ``stage``) does not have the chapter shape (empty: it has)."""
    problems = []
    prose = outside_fences(text)
    if not prose or not re.match(rf"# Stage {stage} · \S", prose[0]):
        problems.append(f"{name}: the first line is not `# Stage {stage} · <title>`")
    headings = h2(text)
    expected = list(SECTIONS)
    if len(headings) != len(expected) or not all(
        h == e or (e == "Measured" and h.startswith("Measured"))
        for h, e in zip(headings, expected, strict=False)
    ):
        problems.append(f"{name}: `##` sections {headings}, expected {expected} in this order")
    first_h2 = next((i for i, line in enumerate(prose) if line.startswith("## ")), len(prose))
    if not any(line.startswith("!!! abstract") for line in prose[:first_h2]):
        problems.append(
            f"{name}: no `!!! abstract` box (what this stage wins, and under which load) before `##`"
        )
    opening = text.split("\n## ", 1)[0]
    if stage >= 1 and "export URL=" not in opening:
        problems.append(f"{name}: no `export URL=...` reminder before the first section")
    recap = _section(text, "Recap")
    if len([line for line in recap if line.strip()]) > RECAP_LINES:
        problems.append(f"{name}: the recap has more than {RECAP_LINES} lines")
    exercises = "\n".join(_section(text, "Exercises"))
    if (
        list(repo.glob(f"exercises/stage{stage}_*/app.py"))
        and f"make exercise STAGE={stage}" not in exercises
    ):
        problems.append(f"{name}: the exercises do not give `make exercise STAGE={stage}`")
    if (repo / "docs" / "lab" / f"stage{stage}.md").is_file():
        tail = "\n".join(line for line in prose if line.strip())[-300:]
        if f"lab/stage{stage}.md" not in tail:
            problems.append(f"{name}: it does not end with a link to lab/stage{stage}.md")
    return problems


def _section(text: str, title: str) -> list[str]:
    """The lines under ``## title``, fenced blocks included, up to the next ``##``."""
    out, inside, fence = [], False, None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
        elif fence is None and line.startswith("## "):
            inside = line[3:].strip() == title
            continue
        if inside:
            out.append(line)
    return out


def port_problems(name: str, text: str) -> list[str]:
    """Commands that spell out a host and port instead of $URL (`export URL=...` defines it once)."""
    problems = []
    for block in shell_blocks(text):
        for line in block:
            if HARD_PORT.search(line) and not line.lstrip().lstrip("$ ").startswith("export "):
                problems.append(f"{name}: {line.strip()}")
    for line in outside_fences(text):
        for code in re.findall(r"`([^`]+)`", line):
            if HARD_PORT.search(code) and re.match(r"\s*(curl|make|http|wget|python)", code):
                problems.append(f"{name}: `{code}`")
    return problems


def words(text: str) -> int:
    return len(text.split())  # what `wc -w` counts


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_chapter_has_the_sections_in_order(stage: int) -> None:
    path = DOCS / f"stage{stage}.md"
    problems = shape_problems(path.name, path.read_text(), stage)
    assert not problems, "\n".join(problems)


def test_the_main_path_is_short_enough() -> None:
    counts = {name: words((DOCS / name).read_text()) for name in MAIN_PATH}
    total = sum(counts.values())
    print(f"main path: {total} words {counts}")
    assert total < MAIN_PATH_WORDS, f"{total} words on the main path (limit {MAIN_PATH_WORDS}): {counts}"


def test_no_command_in_the_docs_hard_codes_a_port() -> None:
    pages = sorted(p for p in DOCS.rglob("*.md") if not p.name.startswith("_"))  # `_*.md`: drafts
    problems = [
        p for page in pages if "results" not in page.parts for p in port_problems(page.name, page.read_text())
    ]
    assert not problems, "use $URL (or HOST/PORT, WEB_PORT, DOCS_PORT):\n" + "\n".join(problems)


def test_the_locust_and_docs_ports_are_settable() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^WEB_PORT \?= \d+$", makefile, re.M) and "--web-port $(WEB_PORT)" in makefile
    assert re.search(r"^DOCS_PORT \?= \d+$", makefile, re.M) and ":$(DOCS_PORT)" in makefile


def test_the_checks_catch_a_chapter_out_of_shape(tmp_path: Path) -> None:
    good = "\n".join([
        "# Stage 2 · a thread pool", "", '!!! abstract "What it wins"', "    More requests.", "",
        "```bash", "export URL=http://127.0.0.1:8000", "```", "",
        *[f"## {s}{' against stage 1' if s == 'Measured' else ''}\n\ntext\n" for s in SECTIONS],
        "Lab notes: [lab/stage2.md](lab/stage2.md).",
    ])  # fmt: skip
    (tmp_path / "docs" / "lab").mkdir(parents=True)
    (tmp_path / "docs" / "lab" / "stage2.md").write_text("# notes\n")
    assert shape_problems("stage2.md", good, 2, tmp_path) == []
    swapped = (
        good.replace("## The idea", "## TMP")
        .replace("## The code", "## The idea")
        .replace("## TMP", "## The code")
    )
    assert "in this order" in shape_problems("stage2.md", swapped, 2, tmp_path)[0]
    assert any(
        "abstract" in p
        for p in shape_problems("stage2.md", good.replace("!!! abstract", "!!! note"), 2, tmp_path)
    )
    assert any(
        "lab/stage2.md" in p for p in shape_problems("stage2.md", good.rsplit("\n", 1)[0], 2, tmp_path)
    )
    long_recap = good.replace("## Recap\n\ntext\n", "## Recap\n\n" + "a line\n" * 6)
    assert any("recap" in p for p in shape_problems("stage2.md", long_recap, 2, tmp_path))
    ports = "```bash\nexport URL=http://127.0.0.1:8000\ncurl -s localhost:8000/health\n```\n"
    ports += "Run `make stage1 PORT=9000`, `CACHE_URL=redis://127.0.0.1:6379/0 make stage4`.\n"
    assert port_problems("x.md", ports) == ["x.md: curl -s localhost:8000/health"]
    assert port_problems("x.md", "Then `curl -s http://127.0.0.1:8000/ready`.") != []
