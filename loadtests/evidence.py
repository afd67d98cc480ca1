"""Where a result comes from and where it goes: one machine record, one stamp, out/ or docs/results/.

Every results file carries a ``stamp``: the commit (and whether the tree had uncommitted changes),
the date, the machine, the command line, the wall time of the run, QUICK or full, the ONNX file
the servers served (``int8`` resolved to the build's choice), and the server settings it ran
with: each setting that differs from the defaults in ``common.settings.Settings``, and every
default with its fingerprint, so a test can tell which default changed after the run (a setting
added later, at a default that keeps what was measured, leaves the run current).

A reader's run writes to ``out/`` (git-ignored) and prints its tables; only ``--record``
(``make results``, ``RECORD=1``) writes ``docs/results/`` and ``docs/img/``, and it refuses a
tree with uncommitted changes unless ``--allow-dirty``, which marks the stamp dirty.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import shlex
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
from pydantic import SecretStr

from common.engine import load_manifest
from common.settings import REPO_ROOT, Settings

REPO = REPO_ROOT
RESULTS = REPO / "docs" / "results"  # the committed evidence the docs include
IMG = REPO / "docs" / "img"
OUT = REPO / "out"  # git-ignored: a reader's runs, logs, raw files
EVIDENCE_DIRS = ("docs/results", "docs/img")  # written by the runs: not "uncommitted code"
SCHEMA = 1
LAUNCHER_CHOOSES = ("HOST", "PORT")  # every server gets a free port of its own: not a setting of the run
VERSIONS = ("onnxruntime", "tokenizers", "numpy", "fastapi", "uvicorn", "redis", "locust")


# --- the machine -------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# The vector instructions an INT8 model's speed hangs on, widest first: two CPUs of one name can
# differ here by several times (this project's results came from an AVX-512 one and an AVX2 one).
ISA = {"amx_int8": "AMX", "avx512_vnni": "AVX-512 VNNI", "avx512f": "AVX-512", "avx2": "AVX2"}


def _isa() -> str:
    """The widest of ``ISA`` the CPU has ("" where /proc/cpuinfo says nothing)."""
    try:
        flags = next((set(line.split(":", 1)[1].split()) for line in Path("/proc/cpuinfo").read_text()
                      .splitlines() if line.startswith("flags")), set())  # fmt: skip
    except OSError:
        return ""
    return next((name for flag, name in ISA.items() if flag in flags), "")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "missing"


def machine() -> dict[str, Any]:
    """The one machine record every results file carries."""
    return {
        "cpu_model": _cpu_model(),
        "isa": _isa(),
        "logical_cores": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in VERSIONS},
    }


# --- the commit --------------------------------------------------------------------------
def git(*args: str, repo: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


def git_state(repo: Path = REPO) -> tuple[str, list[str]]:
    """(commit, paths with uncommitted changes), the results folders left out: a run writes them.
    Untracked files count (a new module can change what runs). Outside git: ("unknown", ["?"])."""
    try:
        commit = git("rev-parse", "HEAD", repo=repo).strip()
        excluded = [f":(exclude){d}" for d in EVIDENCE_DIRS]
        status = git("status", "--porcelain", "--untracked-files=all", "--", ".", *excluded, repo=repo)
    except (OSError, subprocess.CalledProcessError):
        return "unknown", ["?"]
    return commit, [line[3:] for line in status.splitlines() if line.strip()]


# --- the settings ------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """A settings value as JSON, the same on every checkout (paths relative to the repository)."""
    if isinstance(value, SecretStr):
        return "<secret>" if value.get_secret_value() else ""
    if isinstance(value, Path):
        return value.relative_to(REPO).as_posix() if value.is_relative_to(REPO) else str(value)
    if isinstance(value, Enum):
        return value.value
    return value


def defaults(settings_cls: type[Settings] = Settings) -> dict[str, Any]:
    """Every setting's default, by its environment name."""
    return {
        name.upper(): _plain(info.get_default(call_default_factory=True))
        for name, info in settings_cls.model_fields.items()
    }


def fingerprint(recorded: Mapping[str, Any]) -> str:
    """A short hash of a set of defaults (a stamp keeps both, so either can be checked)."""
    text = json.dumps(dict(recorded), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def defaults_fingerprint(settings_cls: type[Settings] = Settings) -> str:
    """A short hash of every default: it changes when any default (or setting name) changes."""
    return fingerprint(defaults(settings_cls))


def defaults_changed(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The defaults a run recorded that are no longer the defaults: ``{name: (then, now)}``.

    A setting removed since counts (``now`` is None). One added since does not: a new setting
    comes with a default that keeps what the server did before, so the run measured that default.
    """
    return {
        name: (then, now.get(name)) for name, then in recorded.items() if name not in now or now[name] != then
    }


def resolved_settings(env: Mapping[str, str] | None = None, without: Sequence[str] = ()) -> Settings:
    """The settings a server started from this process gets: this environment, plus ``env``,
    less the variables named in ``without`` (what the launchers in ``loadtests.procs`` do)."""
    merged = {k.upper(): v for k, v in os.environ.items()}
    merged.update({k.upper(): v for k, v in (env or {}).items()})
    for name in without:
        merged.pop(name.upper(), None)
    given: dict[str, Any] = {}
    for name, info in Settings.model_fields.items():
        # Every field is passed (default when unset), so nothing else is read from os.environ.
        given[name] = merged.get(name.upper(), info.get_default(call_default_factory=True))
    return Settings(**given)


def served_variant(model_variant: str, model_dir: Path) -> str | None:
    """The ONNX file a server with these settings serves: ``int8`` is the build's choice (its
    manifest's ``int8_default``). None when no model is built there."""
    if model_variant != "int8":
        return model_variant
    try:
        return str(load_manifest(model_dir).get("int8_default", "int8-dynamic"))
    except FileNotFoundError:
        return None


def settings_record(env: Mapping[str, str] | None = None, without: Sequence[str] = ()) -> dict[str, Any]:
    """The settings a run used: those that differ from the defaults, and the defaults themselves."""
    settings, base = resolved_settings(env, without), defaults()
    changed = {}
    for name in Settings.model_fields:
        if name.upper() in LAUNCHER_CHOOSES:
            continue
        value = _plain(getattr(settings, name))
        if value != base[name.upper()]:
            changed[name.upper()] = value
    return {"changed": changed, "defaults": base, "defaults_fingerprint": fingerprint(base)}


# --- one run -----------------------------------------------------------------------------
class DirtyTree(SystemExit):
    """Recording refused: the tree has uncommitted changes."""


def add_arguments(parser: argparse.ArgumentParser, quick: bool = True) -> None:
    """The options every measuring command shares."""
    if quick:
        parser.add_argument("--quick", action="store_true", help="a short run, to see that it all works")
    parser.add_argument(
        "--record",
        action="store_true",
        help="write docs/results/ and docs/img/ (the committed evidence); default: out/",
    )
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help="record from a tree with uncommitted changes (the stamp says so)",
    )


@dataclass
class Run:
    """One run of one measuring command: where it writes and how it stamps."""

    module: str  # "benchmarks.compare": the command line is `python -m <module> <argv>`
    argv: list[str]
    quick: bool = False
    record: bool = False
    allow_dirty: bool = False
    commit: str = "unknown"
    changed: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    date: str = field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    recheck: bool = False  # look at the tree again when stamping (``start`` sets it)

    @property
    def command(self) -> str:
        return shlex.join(["python", "-m", self.module, *self.argv])

    @property
    def dirty(self) -> bool:
        return bool(self.changed)

    @property
    def results_dir(self) -> Path:
        return RESULTS if self.record else OUT / "results"

    @property
    def img_dir(self) -> Path:
        return IMG if self.record else OUT / "img"

    def logs(self, name: str) -> Path:
        """A git-ignored folder for server logs and raw files."""
        path = OUT / "logs" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def stamp(
        self, server_env: Mapping[str, str] | None = None, without: Sequence[str] = ()
    ) -> dict[str, Any]:
        """The provenance of a results file written now.

        A server started late in a long run loads the code as it is then: a tree that changed
        during the run (another commit, an edit) makes the stamp dirty too.
        """
        if self.recheck:
            commit, changed = git_state()
            moved = [f"HEAD moved to {commit[:7]} during the run"] if commit != self.commit else []
            self.changed = sorted(set(self.changed) | set(changed)) + moved
            self.recheck = False
        settings = resolved_settings(server_env, without)
        return {
            "schema": SCHEMA,
            "commit": self.commit,
            "dirty": self.dirty,
            "changed_files": self.changed[:20],
            "date": self.date,
            "command": self.command,
            "wall_s": round(time.monotonic() - self.started, 1),
            "quick": self.quick,
            "machine": machine(),
            "settings": settings_record(server_env, without),
            "model": {"variant": served_variant(settings.model_variant, settings.model_dir)},
        }


def start(module: str, args: argparse.Namespace, argv: Sequence[str] | None = None) -> Run:
    """Begin a run from parsed arguments (see ``add_arguments``); refuse to record a dirty tree."""
    import sys

    run = Run(
        module=module,
        argv=list(sys.argv[1:] if argv is None else argv),
        quick=bool(getattr(args, "quick", False)),
        record=bool(getattr(args, "record", False)),
        allow_dirty=bool(getattr(args, "allow_dirty", False)),
    )
    run.commit, run.changed = git_state()
    run.recheck = True
    if run.record and run.dirty and not run.allow_dirty:
        shown = "\n  ".join(run.changed[:10]) + ("\n  ..." if len(run.changed) > 10 else "")
        raise DirtyTree(
            f"refusing to record {module}: uncommitted changes\n  {shown}\n"
            "commit them, or pass --allow-dirty (ALLOW_DIRTY=1): the results are then marked dirty"
        )
    where = (
        "docs/results/ and docs/img/ (recording)" if run.record else "out/ (pass --record to update docs/)"
    )
    print(f"{run.command}: results go to {where}", flush=True)
    return run


# --- writing -----------------------------------------------------------------------------
def write_json(path: Path, payload: dict[str, Any], indent: int = 2) -> Path:
    """``payload`` as JSON, its ``stamp`` first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = {"stamp": payload["stamp"], **{k: v for k, v in payload.items() if k != "stamp"}}
    path.write_text(json.dumps(ordered, indent=indent) + "\n")
    return path


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def provenance(stamp: dict[str, Any]) -> dict[str, Any]:
    """The part of a stamp a Markdown table or a picture carries (the staleness test reads it)."""
    settings = stamp.get("settings") or {}
    return {
        "commit": stamp.get("commit"),
        "dirty": stamp.get("dirty"),
        "date": stamp.get("date"),
        "command": stamp.get("command"),
        "quick": stamp.get("quick"),
        "defaults_fingerprint": settings.get("defaults_fingerprint"),
    }


PROVENANCE_PREFIX = "<!-- provenance: "


def provenance_comment(stamp: dict[str, Any]) -> str:
    """The first line of every generated Markdown file: where its numbers come from."""
    return f"{PROVENANCE_PREFIX}{json.dumps(provenance(stamp))} (generated; do not edit) -->"


def read_provenance(text: str) -> dict[str, Any] | None:
    """The provenance a Markdown file carries on its first line, or None."""
    first = text.split("\n", 1)[0]
    if not first.startswith(PROVENANCE_PREFIX):
        return None
    body = first.removeprefix(PROVENANCE_PREFIX).rsplit(" (generated", 1)[0]
    try:
        return dict(json.loads(body))
    except ValueError:
        return None


def save_figure(fig: Any, path: Path, stamp: dict[str, Any], dpi: int = 110) -> Path:
    """Save a matplotlib figure as PNG with the provenance in a text chunk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, metadata={"provenance": json.dumps(provenance(stamp))})
    return path


def stamp_png(path: Path, stamp: dict[str, Any]) -> Path:
    """Add the provenance to a PNG written by something else (a browser screenshot)."""
    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("provenance", json.dumps(provenance(stamp)))
    with Image.open(path) as image:
        image.load()
        image.save(path, pnginfo=info)
    return path


def read_png_provenance(path: Path) -> dict[str, Any] | None:
    from PIL import Image

    with Image.open(path) as image:
        text = getattr(image, "text", {}).get("provenance")
    try:
        return dict(json.loads(text)) if text else None
    except ValueError:
        return None


# --- words for the docs ------------------------------------------------------------------
def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "time not recorded"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds / 3600:.1f} hours"


def settings_words(stamp: dict[str, Any]) -> str:
    settings = stamp.get("settings")
    if not settings:
        return "server settings not recorded"
    changed = settings.get("changed") or {}
    listed = ", ".join(f"`{k}={v}`" for k, v in changed.items())
    return f"server settings: the defaults{' except ' + listed if listed else ''}"


def describe(stamp: dict[str, Any]) -> str:
    """One sentence for a results page: command, commit, date, duration, machine, settings."""
    m = stamp["machine"]
    commit = str(stamp.get("commit") or "unknown")[:7]
    when = str(stamp.get("date", "?"))[:16].replace("T", " ")
    dirty = " with uncommitted changes" if stamp.get("dirty") else ""
    where = f"at commit `{commit}`{dirty} on {when} UTC ({_duration(stamp.get('wall_s'))})"
    text = (
        f"Measured by `{stamp.get('command', '?')}` {where}: {m.get('cpu_model', '?')}"
        + (f" ({m['isa']})" if m.get("isa") else "")
        + ","
        f" {m.get('logical_cores', '?')} logical cores, {m.get('memory_gib', '?')} GiB memory,"
        f" Python {m.get('python', '?')}; {settings_words(stamp)}."
    )
    if stamp.get("quick"):
        text += " **QUICK run**: a few seconds per point, to check the tools; the figures are noisy."
    return text


# --- publishing ------------------------------------------------------------------------
def publish(
    run: Run,
    name: str,
    result: dict[str, Any],
    markdown: Callable[[dict[str, Any]], str],
    out: Path | None = None,
) -> Path:
    """Write ``name``.json and ``name``.md (into ``out``, else the run's results folder); print the page."""
    folder = out or run.results_dir
    text = markdown(result)
    write_json(folder / f"{name}.json", result)
    write_text(folder / f"{name}.md", text)
    print(text)
    print(f"wrote {folder / name}.json and .md")
    return folder
