"""The docs cannot rot: the site builds strictly, every snippet marker exists, every results file too.

That every results page is rendered from its JSON, and that the evidence is current, is checked in
tests/test_evidence.py.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from benchmarks import settings_doc

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
# `--8<-- "path"` or `--8<-- "path:section"`; pymdownx.snippets resolves paths from the repo root.
SNIPPET = re.compile(r'--8<--\s+"([^"]+)"')
# Generated files a chapter links to or includes: docs/results/*, docs/img/*.
RESULT_LINK = re.compile(r"(?<![\w/])((?:docs/)?(?:results|img)/[\w.\-/]+\.(?:json|md|png|svg|csv|txt))")


def snippet_problems(doc: Path, repo: Path) -> list[str]:
    """Why each `--8<--` reference in `doc` would not include what it names (empty: all fine)."""
    problems = []
    in_fence = False
    for line in doc.read_text().splitlines():
        in_fence ^= line.lstrip().startswith("```")
        ref = line.strip().removeprefix('--8<-- "').removesuffix('"')
        # Code outside a fence renders as markdown: its `# comments` become headings.
        if line.lstrip().startswith("--8<--") and not in_fence and not ref.split(":")[0].endswith(".md"):
            problems.append(f"{doc.name}: {ref}: code included outside a ``` fence")
    for ref in SNIPPET.findall(doc.read_text()):
        path, _, section = ref.partition(":")
        target = repo / path
        if not target.is_file():
            problems.append(f"{doc.name}: {ref}: no file {path}")
            continue
        if not section:
            continue
        if re.fullmatch(r"[\d:-]+", section):
            problems.append(f"{doc.name}: {ref}: included by line numbers; use a named section")
            continue
        text = target.read_text()
        for edge in ("start", "end"):
            if f"--8<-- [{edge}:{section}]" not in text:
                problems.append(f"{doc.name}: {ref}: no [{edge}:{section}] marker in {path}")
    return problems


def result_problems(doc: Path, repo: Path) -> list[str]:
    problems = []
    for link in RESULT_LINK.findall(doc.read_text()):
        target = repo / link if link.startswith("docs/") else doc.parent / link
        if not target.is_file():
            problems.append(f"{doc.name}: {link} does not exist")
    return problems


def _chapters() -> list[Path]:
    return sorted(p for p in DOCS.glob("*.md") if not p.name.startswith("_"))  # `_*.md`: drafts


def test_every_snippet_reference_names_an_existing_file_and_marker() -> None:
    problems = [p for doc in _chapters() for p in snippet_problems(doc, REPO)]
    assert not problems, "\n".join(problems)


def test_every_results_file_the_docs_name_exists() -> None:
    problems = [p for doc in _chapters() for p in result_problems(doc, REPO)]
    assert not problems, "\n".join(problems)


def test_the_checks_catch_a_removed_marker_and_a_missing_result(tmp_path: Path) -> None:
    (tmp_path / "code.py").write_text("# --8<-- [start:kept]\nx = 1\n# --8<-- [end:kept]\n")
    doc = tmp_path / "docs" / "chapter.md"
    doc.parent.mkdir()
    fence = "```"
    doc.write_text(
        f'{fence}python\n--8<-- "code.py:kept"\n--8<-- "code.py:gone"\n--8<-- "code.py:3:4"\n{fence}\n'
        '\n--8<-- "nope.py"\nSee [the run](results/missing.json).\n'
    )
    problems = snippet_problems(doc, tmp_path)
    assert len(problems) == 5, problems
    outside = [p for p in problems if "outside a ``` fence" in p]
    assert outside == ["chapter.md: nope.py: code included outside a ``` fence"]
    rest = [p for p in problems if p not in outside]
    assert "no [start:gone] marker" in rest[0] and "no [end:gone] marker" in rest[1]
    assert "line numbers" in rest[2]
    assert result_problems(doc, tmp_path) == ["chapter.md: results/missing.json does not exist"]


def test_the_settings_table_is_generated_from_the_current_settings() -> None:
    """docs/results/settings.md is what settings-doc renders from the class today."""
    committed = settings_doc.OUT.read_text()
    assert committed == settings_doc.render(), "run `python -m benchmarks.settings_doc` and commit the result"
    assert "`MAX_QUEUE`" in committed


@pytest.mark.timeout(180)
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner about its successor
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (site / "index.html").exists() and (site / "operating" / "index.html").exists()
    # offline: the theme pulls nothing from a CDN or Google Fonts
    assert "fonts.googleapis.com" not in (site / "index.html").read_text()
    _tables_fit(site)


# The pages as a reader sees them: a 1400 px wide browser window.
WIDTH = 1400
_WIDE_TABLES = """() => [...document.querySelectorAll('article table')].map((table, i) => {
    const room = (table.closest('.md-typeset__table') || table.parentElement).clientWidth;
    const head = [...table.querySelectorAll('th')].slice(0, 3).map(th => th.innerText).join(' | ');
    return {i, width: table.scrollWidth, room, head};
}).filter(t => t.width > t.room + 2)"""


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def _tables_fit(site: Path) -> None:
    """No table on the built site scrolls sideways at 1400 px (Chromium; `make tools`)."""
    from playwright.sync_api import sync_playwright

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pages = sorted(p.parent.relative_to(site) for p in site.glob("*/index.html") if p.parent.name != "search")
    too_wide = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            tab = browser.new_page(viewport={"width": WIDTH, "height": 1000})
            for page in pages:
                tab.goto(f"http://127.0.0.1:{server.server_address[1]}/{page}/")
                too_wide += [
                    f"{page}: table {t['i']} ({t['head']}): {t['width']} px in {t['room']} px"
                    for t in tab.evaluate(_WIDE_TABLES)
                ]
            browser.close()
    finally:
        server.shutdown()
    assert not too_wide, "tables wider than the page at 1400 px:\n" + "\n".join(too_wide)
