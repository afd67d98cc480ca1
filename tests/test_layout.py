"""The layout the lesson depends on: each stage folder holds its server and nothing else.

Read from the source with ``ast`` (nothing is imported): a stage's modules are all reached from
its ``app.py``; the servers and ``common`` never import the measuring code; no import cycles; no
module a reader has to scroll through for long.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SERVER_STAGES = (
    "stage1_naive",
    "stage2_threadpool",
    "stage3_batching",
    "stage4_cache_backpressure",
    "stage5_metrics",
)
RUNTIME = ("stage0_script", *SERVER_STAGES, "common")
MEASURING = ("loadtests", "benchmarks", "tests")
MOST_LINES = 300
# A lesson's core file reads whole rather than send the reader to four files (STYLE.md): the
# textbook batcher, from the queue to close, with what a caller leaves in the queue.
CORE_FILES = {"stage3_batching.batcher": 350}


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the stages and ``common``."""
    return {
        ".".join(path.relative_to(REPO).with_suffix("").parts): path
        for package in RUNTIME
        for path in sorted((REPO / package).glob("*.py"))
    }


def _imports(path: Path) -> set[str]:
    """Every module name ``path`` imports (``from a import b`` gives a and a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


MODULES = _modules()
GRAPH = {name: {i for i in _imports(path) if i in MODULES and i != name} for name, path in MODULES.items()}


@pytest.mark.parametrize("stage", SERVER_STAGES)
def test_every_module_of_a_stage_is_part_of_its_server(stage: str) -> None:
    reached, todo = set(), [f"{stage}.app"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += [m for m in GRAPH[name] if m.startswith(f"{stage}.")]
    own = {m for m in MODULES if m.startswith(f"{stage}.") and not m.endswith("__init__")}
    assert own - reached == set(), f"{stage}: modules its app.py never reaches (move them out of the stage)"


def test_the_servers_never_import_the_measuring_code() -> None:
    wrong = {
        name: sorted(i for i in _imports(path) if i.split(".")[0] in MEASURING)
        for name, path in MODULES.items()
    }
    assert {name: found for name, found in wrong.items() if found} == {}


def test_no_import_cycles() -> None:
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            cycle = " -> ".join((*path[path.index(name) :], name))
            pytest.fail(f"import cycle: {cycle}")
        if name not in done:
            for dep in sorted(GRAPH[name]):
                visit(dep, (*path, name))
            done.add(name)

    for name in sorted(GRAPH):
        visit(name, ())


def test_no_module_is_longer_than_a_sitting() -> None:
    long = {
        name: n
        for name, path in MODULES.items()
        if (n := len(path.read_text().splitlines())) > CORE_FILES.get(name, MOST_LINES)
    }
    assert long == {}, f"split these modules (at most {MOST_LINES} lines each, {CORE_FILES} for the core)"


def test_the_checks_see_what_they_check() -> None:
    """A check over nothing cannot fail: the walk finds the stages and their imports."""
    assert "stage3_batching.backend" in GRAPH["stage3_batching.app"] and len(MODULES) > 40
    assert "common.api" in GRAPH["stage1_naive.app"]
