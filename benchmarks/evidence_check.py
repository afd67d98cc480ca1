"""Is the committed evidence current, and does every number in the prose come from it?

    python -m benchmarks.evidence_check            # both checks on docs/; exit 1 on a problem
    python -m benchmarks.evidence_check --stale    # only the results files
    python -m benchmarks.evidence_check --prose    # only the numbers typed in the chapters

``stale_evidence``: every results file ``make results`` writes is there, carries a stamp, was
measured at a clean commit, in a full (not QUICK) run, with today's defaults (every default its
stamp records is still the default in ``common.settings.Settings``; a setting added since is
allowed, see ``loadtests.evidence.defaults_changed``), on the model that setting serves now (a
build that chooses another INT8 file makes every server measurement stale); its page and its
pictures carry the same provenance. The age of a result alone is never a problem: results are
rerun on purpose.

``unsourced_numbers``: a measured-looking number typed in a chapter (a decimal, a number with a
unit such as ``ms``, ``%``, ``x``, ``req/s`` or ``MB``, or one with thousands separators) must be
one a results file holds, at the precision it is written with. Code, inline code, snippet lines
and HTML comments are not prose; a line that quotes a figure from elsewhere says so with
``<!-- quoted -->``, and a worked example (made-up numbers) with ``<!-- example -->``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.results import FROM_CODE, STEPS
from loadtests import evidence

DOCS = evidence.REPO / "docs"
HAND_DRAWN = "remove it, add a step, or keep a hand-drawn picture outside docs/img"
# A line that quotes a figure from elsewhere, or works an example, says so; its numbers are not results.
EXEMPT = ("<!-- quoted -->", "<!-- example -->")


# --- stale results -----------------------------------------------------------------------
def stamp_problems(name: str, stamp: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """Why a results file with this stamp is not current evidence (empty: it is)."""
    if not stamp:
        return [f"{name}: no stamp (not written by a stamped run)"]
    missing = [k for k in ("commit", "dirty", "date", "command", "machine", "settings") if k not in stamp]
    if missing:
        return [f"{name}: stamp without {', '.join(missing)}"]
    problems = []
    if stamp["dirty"]:
        problems.append(f"{name}: measured with uncommitted changes (--allow-dirty)")
    if stamp.get("quick"):
        problems.append(f"{name}: a QUICK run (seconds per point), not evidence")
    settings = stamp.get("settings") or {}
    recorded = settings.get("defaults")
    if not isinstance(recorded, dict):
        return [*problems, f"{name}: the stamp does not record the defaults it ran with"]
    if evidence.fingerprint(recorded) != settings.get("defaults_fingerprint"):
        problems.append(f"{name}: the recorded defaults do not match the fingerprint (edited by hand)")
    model = (stamp.get("model") or {}).get("variant")
    variant = (settings.get("changed") or {}).get("MODEL_VARIANT", now.get("MODEL_VARIANT", "int8"))
    serving = evidence.served_variant(variant, evidence.REPO / str(now.get("MODEL_DIR", "models")))
    if model is None:
        problems.append(f"{name}: the stamp does not say which model it served")
    elif serving is not None and serving != model:
        problems.append(f"{name}: measured on {model}; MODEL_VARIANT={variant} serves {serving} now")
    for setting, (then, today) in evidence.defaults_changed(recorded, now).items():
        gone = "the setting is gone" if setting not in now else f"now {today!r}"
        problems.append(f"{name}: the default of {setting} changed since it was measured ({then!r}, {gone})")
    return problems


def _same(name: str, carried: dict[str, Any] | None, stamp: dict[str, Any]) -> list[str]:
    if carried is None:
        return [f"{name}: no provenance"]
    if carried != evidence.provenance(stamp):
        return [f"{name}: provenance differs from its JSON's stamp (rendered from another run)"]
    return []


def stale_evidence(results: Path = evidence.RESULTS, img: Path = evidence.IMG) -> list[str]:
    """Every reason the evidence in ``results`` and ``img`` is not current (empty: all current)."""
    now, problems = evidence.defaults(), []
    known_files, known_pictures = set(FROM_CODE), set()
    for step in (s for s in STEPS if s.stamped):
        for name in step.writes:
            page = name.removesuffix(".json") + ".md"
            known_files |= {name, page}
            known_pictures |= set(step.images)
            if not (results / name).is_file():
                problems.append(f"{name}: missing (make results writes it)")
                continue
            stamp = json.loads((results / name).read_text()).get("stamp")
            problems += stamp_problems(name, stamp, now)
            if not stamp:
                continue
            md = results / page
            problems += _same(page, evidence.read_provenance(md.read_text()) if md.is_file() else None, stamp)
            for picture in step.images:
                path = img / picture
                carried = evidence.read_png_provenance(path) if path.is_file() else None
                problems += _same(picture, carried, stamp) if path.is_file() else [f"{picture}: missing"]
    for path in sorted(results.glob("*")):
        if path.is_file() and path.name not in known_files:
            problems.append(f"{path.name}: no step of make results writes it (remove it, or add a step)")
    for path in sorted(img.glob("*.png")):
        if path.name not in known_pictures:
            problems.append(f"{path.name}: no step of make results draws it ({HAND_DRAWN})")
    return problems


# --- numbers in prose --------------------------------------------------------------------
# A one-letter or word unit needs a space before it ("45 s", not the plural in "503s").
UNITS = (
    r"\s?(?:%|×|x|ms|µs|us|MB|MiB|GB|GiB|kB|KB|KiB)"
    r"|\s(?:s|sec|seconds?|min|minutes?|h|hours?|req/s|requests/s|texts/s|texts per second|rps|bytes|cores?)"
)
# A number not glued to a word (p99, int8, fp32, L6) or to a version (3.11.7, v1.2), then maybe a unit.
NUMBER = re.compile(
    r"(?<![\w.\-/])(?P<value>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)(?!\.\d)"
    rf"(?P<unit>(?:{UNITS})(?![\w/]))?(?(unit)|(?!\w))"
)
NOT_PROSE = re.compile(r"`[^`]*`|<!--.*?-->|\]\([^)]*\)|https?://\S+|<[^>]+>")
VERSION_WORDS = re.compile(r"(?:Python|version|HTTP/|v|>=|==|~=)\s*$", re.IGNORECASE)
# How a results file may hold what a chapter writes with this unit (a share as 0.92 for "92%",
# seconds for "10 minutes", bytes for "69.3 MB"); a number without a unit must be there as it is.
_TIME = {"ms": (1.0, 1e3), "µs": (1.0, 1e6, 1e3), "us": (1.0, 1e6, 1e3), "h": (1.0, 1 / 3600)}
_TIME |= {u: (1.0, 1e-3) for u in ("s", "sec", "second", "seconds")}
_TIME |= {u: (1.0, 1 / 60) for u in ("min", "minute", "minutes")} | {
    u: (1.0, 1 / 3600) for u in ("hour", "hours")
}
_SIZE = {"MB": (1.0, 1e-6), "GB": (1.0, 1e-9), "kB": (1.0, 1e-3), "KB": (1.0, 1e-3)}
_SIZE |= {"MiB": (1.0, 2**-20), "GiB": (1.0, 2**-30), "KiB": (1.0, 2**-10)}
SCALES: dict[str, tuple[float, ...]] = {"%": (1.0, 100.0), **_TIME, **_SIZE}
LONG_LIST = 60  # per-interval and per-round series: the prose quotes their summaries, not their points


def prose_numbers(text: str) -> Iterator[tuple[int, str, float, int]]:
    """(line, as typed, value, decimals) of every number in ``text`` that looks like a measurement.

    The unit is read back from the typed form (``unit_of``)."""
    fence = None
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        marker = re.match(r"(```|~~~)", stripped)
        if marker:
            fence = None if fence == marker.group(1) else (fence or marker.group(1))
            continue
        if fence or "--8<--" in line or any(mark in line for mark in EXEMPT):
            continue
        prose = NOT_PROSE.sub(" ", line)
        for m in NUMBER.finditer(prose):
            value, unit = m.group("value"), (m.group("unit") or "").strip()
            if VERSION_WORDS.search(prose[: m.start()]):
                continue
            decimals = len(value.split(".")[1]) if "." in value else 0
            if not (decimals or unit or "," in value):
                continue  # a bare integer: a count, a stage, a setting ("stage 3", "8 clients")
            yield n, m.group(0).strip(), float(value.replace(",", "")), decimals


def _numbers_in(value: Any) -> Iterator[float]:
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        if math.isfinite(value):
            yield float(value)
    elif isinstance(value, str):
        for m in re.finditer(r"\d[\d,_]*(?:\.\d+)?", value):
            try:
                yield float(m.group(0).replace(",", "").replace("_", ""))
            except ValueError:
                continue
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers_in(k)
            yield from _numbers_in(v)
    elif isinstance(value, list) and len(value) <= LONG_LIST:
        for v in value:
            yield from _numbers_in(v)


def known_numbers(results: Path = evidence.RESULTS) -> list[float]:
    """Every number the results files hold: JSON values (and numbers inside strings), and pages."""
    found: list[float] = []
    for path in sorted(results.glob("*")):
        if path.suffix == ".json":
            found += _numbers_in(json.loads(path.read_text()))
        elif path.suffix == ".md":
            found += _numbers_in(path.read_text())
    return found


def unit_of(typed: str) -> str:
    """The unit a prose number was typed with ("" when none)."""
    m = NUMBER.fullmatch(typed)
    return (m.group("unit") or "").strip() if m else ""


class Sources:
    """The known numbers, rounded on demand to each precision and unit a chapter asks for."""

    def __init__(self, numbers: Iterable[float]) -> None:
        self.numbers = sorted(set(numbers))
        self._rounded: dict[tuple[int, tuple[float, ...]], set[float]] = {}

    def holds(self, value: float, decimals: int, unit: str = "") -> bool:
        scales = SCALES.get(unit, (1.0,))
        key = (decimals, scales)
        if key not in self._rounded:
            self._rounded[key] = {round(v * s, decimals) for v in self.numbers for s in scales}
        return round(value, decimals) in self._rounded[key]


def unsourced_numbers(chapters: Iterable[Path], sources: Sources) -> list[str]:
    """``chapter.md:line: number`` for every measured-looking number no results file holds."""
    problems = []
    for chapter in chapters:
        for line, typed, value, decimals in prose_numbers(chapter.read_text()):
            if not sources.holds(value, decimals, unit_of(typed)):
                problems.append(f"{chapter.name}:{line}: {typed!r} is in no results file")
    return problems


def chapters(docs: Path = DOCS) -> list[Path]:
    """Every page a reader sees: the chapters and the lab notes (docs/lab/), not the results."""
    pages = [*docs.glob("*.md"), *docs.glob("lab/*.md")]
    return sorted(p for p in pages if not p.name.startswith("_"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stale", action="store_true", help="only the results files")
    parser.add_argument("--prose", action="store_true", help="only the numbers in the chapters")
    args = parser.parse_args(argv)
    both = not (args.stale or args.prose)
    problems = []
    if args.stale or both:
        problems += stale_evidence()
    if args.prose or both:
        problems += unsourced_numbers(chapters(), Sources(known_numbers()))
    print("\n".join(problems) if problems else "the evidence is current; every number has a source")
    if any("defaults changed" in p or "missing" in p for p in problems):
        print("\n-> `make results` at a clean commit regenerates the results files", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
