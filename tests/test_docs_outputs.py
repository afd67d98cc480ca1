"""What the chapters show a command printing is what it prints today (benchmarks/docs_outputs.py).

Every captured output is run again, against a freshly started stage, and must keep its *shape*:
the same lines once numbers, hex ids and timings are masked. A changed route, header, message or
log line fails here; a different latency does not. Each output is included by a chapter, and a
demo's output shows its point (its ``shows`` pattern).
"""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import docs_outputs
from benchmarks.docs_outputs import OUTPUTS, Output, cut, printed, same_shape, shape
from loadtests import evidence

FOLDER = evidence.RESULTS / "outputs"


def test_long_vectors_are_cut_and_short_lists_kept() -> None:
    vector = "[" + ",".join(f"{i / 1000:.4f}" for i in range(384)) + "]"
    text = '{"embeddings":[' + vector + '],"truncated":[false],"pair":[1,2]}'
    short = "[0.0000, 0.0010, 0.0020, … 381 more]"
    assert cut(text) == '{"embeddings":[' + short + '],"truncated":[false],"pair":[1,2]}'
    assert cut("[1, 2, 3, 4]") == "[1, 2, 3, 4]"  # one more than kept: nothing to gain


def test_the_shape_masks_numbers_ids_and_timings_and_nothing_else() -> None:
    one = "embed answered after 0.731 s\nrequest 5f3a9c01d2e4b6a7 took 12 ms"
    two = "embed answered after 1.2 s\nrequest 0000aaaa1111bbbb took 3 ms"
    assert shape(one) == shape(two) == ["embed answered after # s", "request # took # ms"]
    assert shape(one) != shape(one.replace("embed", "health"))  # a word changed
    assert shape(one) != shape(one + "\nanother line")  # a line added
    assert shape(one) != shape("\n".join(reversed(one.splitlines())))  # the order changed


def test_only_an_output_marked_any_order_may_change_its_order() -> None:
    lines = "embed answered after 1.2 s\nhealth answered after 0.7 s\n"
    swapped = "health answered after 0.6 s\nembed answered after 1.3 s\n"
    assert same_shape(Output("x", "true", any_order=True), swapped, lines)
    assert not same_shape(Output("x", "true"), swapped, lines)
    assert not same_shape(Output("x", "true", any_order=True), swapped + "more\n", lines)


def test_a_demo_that_does_not_show_its_point_fails_the_capture() -> None:
    assert docs_outputs.run(Output("x", "echo \"{'deduplicated': 12}\"", shows="'deduplicated': [1-9]"))
    with pytest.raises(RuntimeError, match="does not show its point"):
        docs_outputs.run(Output("x", "echo \"{'deduplicated': 0}\"", shows="'deduplicated': [1-9]"))


def test_the_manifest_names_are_files() -> None:
    assert all(re.fullmatch(r"[a-z0-9-]+", o.name) for o in OUTPUTS), [o.name for o in OUTPUTS]


def test_every_output_is_captured_shows_its_point_and_is_in_a_chapter() -> None:
    """outputs/<name>.txt for every manifest entry, the same text as outputs.json holds, matching
    its ``shows`` pattern, and included by a page of the docs; no other file."""
    recorded = json.loads((evidence.RESULTS / "outputs.json").read_text())
    by_name = {o["name"]: o for o in recorded["outputs"]}
    assert list(by_name) == [o.name for o in OUTPUTS], "run `make results ONLY=docs-outputs RECORD=1`"
    pages = "".join(p.read_text() for p in (evidence.REPO / "docs").rglob("*.md"))
    for output in OUTPUTS:
        text = (FOLDER / f"{output.name}.txt").read_text()
        assert text == by_name[output.name]["text"] and text.startswith(f"$ {output.command}\n"), output.name
        assert re.search(output.shows, printed(output, text), re.MULTILINE), output.name
        assert f'--8<-- "docs/results/outputs/{output.name}.txt"' in pages, f"{output.name}: in no chapter"
    assert sorted(p.stem for p in FOLDER.glob("*.txt")) == sorted(by_name)


@pytest.mark.timeout(1200)
def test_every_captured_command_prints_the_same_shape_today() -> None:
    differ = []
    for output in OUTPUTS:
        fresh = docs_outputs.run(output)["text"]
        committed = (FOLDER / f"{output.name}.txt").read_text()
        if not same_shape(output, fresh, committed):
            differ.append(f"--- {output.name}: committed\n{committed}--- today\n{fresh}")
    rerun = "run `make results ONLY=docs-outputs RECORD=1` if the change is right:\n"
    assert not differ, rerun + "\n".join(differ)
