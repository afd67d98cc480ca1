"""Build the stage 5 image from ``deploy/docker/Dockerfile`` and run it (what ``make image`` runs).

    python -m deploy.docker.image build    # the image, tagged by a hash of the files it is built from
    python -m deploy.docker.image run      # serve it on HOST:PORT until Ctrl-C

Where a Docker engine answers, ``docker build`` and ``docker run``. Elsewhere (these machines)
buildah with chroot isolation, on a base of Debian's own packages in place of the python image
that cannot be pulled: debootstrap writes bookworm's python3 into a ``buildah from scratch``
container, and a venv first on its PATH gives the Dockerfile the ``python`` and ``pip`` the python
image has. The base is made once, tagged by a hash of its recipe.

Inside the build, pip uses the index the host's pip is configured with: the host's merged
configuration goes in as ``/etc/pip.conf``, every local folder or file it names is mounted
read-only at its own path, and its extra index is the Dockerfile's PIP_EXTRA_INDEX_URL. A RUN
step's mounts are no layer: none of it stays in the image, and nothing of it is in the repository.
A Docker build can mount nothing: it gets the http(s) extra indexes only.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
NAME = "embedserve"
# Used only where an engine already runs: `make tools` installs buildah, never Docker.
DOCKER = "docker"

# The base: what the python image gives the Dockerfile, from Debian's packages.
BASE_RECIPE = 1  # bump when base() changes: the base is remade under a new tag
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
VENV = "/opt/venv"
BASE_ENV = {
    "PATH": f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
# What the slim images leave out: the downloaded packages, apt's lists, docs, manuals and
# translations; /dev is the runtime's to fill.
SLIM = ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
        "usr/share/info", "usr/share/locale", "dev")  # fmt: skip


def _out(*command: str) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


def _say(text: str) -> None:
    print(f"make image: {text}", flush=True)


def engine() -> str:
    """``docker`` where a Docker engine answers, else ``buildah`` (with debootstrap for the base)."""
    if shutil.which(DOCKER) and subprocess.run([DOCKER, "info"], capture_output=True).returncode == 0:
        return "docker"
    found = {"buildah": shutil.which("buildah"), "debootstrap": shutil.which("debootstrap")}
    if missing := [program for program, path in found.items() if path is None]:
        raise SystemExit(f"no Docker engine, and {' and '.join(missing)} missing: `make tools` installs them")
    return "buildah"


def exists(kind: str, tag: str) -> bool:
    command = (
        [DOCKER, "image", "inspect", tag]
        if kind == "docker"
        else ["buildah", "inspect", "--type", "image", tag]
    )
    return subprocess.run(command, capture_output=True).returncode == 0


def inspect(kind: str, tag: str) -> dict[str, Any]:
    """The image's configuration (Cmd, User, Env, ...) and its size in bytes, unpacked."""
    if kind == "docker":
        data = json.loads(_out(DOCKER, "image", "inspect", tag))[0]
        return {**data["Config"], "Size": data["Size"]}
    data = json.loads(_out("buildah", "inspect", "--type", "image", tag))
    layers = json.loads(data["Manifest"])["layers"]  # uncompressed tars in local storage, as Docker's Size
    return {**data["Docker"]["config"], "Size": sum(x["size"] for x in layers)}


# --- the base, from Debian's packages -------------------------------------------------------------
def suite() -> str:
    """The Debian release of the Dockerfile's base (``python:3.11.11-slim-bookworm``: bookworm)."""
    found = re.search(r"^ARG PYTHON_IMAGE=\S+-(\w+)$", DOCKERFILE.read_text(), re.M)
    assert found, "the Dockerfile's PYTHON_IMAGE names no Debian release"
    return found.group(1)


def debian_mirror(release: str) -> str:
    """The mirror apt uses for ``release``, from its sources (one-line or deb822)."""
    apt = Path("/etc/apt")
    for path in [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*"))]:
        text = path.read_text() if path.is_file() else ""
        if path.suffix == ".sources":
            for block in re.split(r"\n\s*\n", text):
                fields = dict(re.findall(r"^([\w-]+):[ \t]*(.*)$", block, re.M))
                if "deb" in fields.get("Types", "").split() and release in fields.get("Suites", "").split():
                    return fields["URIs"].split()[0]
        for line in text.splitlines():
            words = re.sub(r"\[[^]]*\]", "", line).split()
            if words[:1] == ["deb"] and len(words) > 2 and words[2] == release:
                return words[1]
    raise SystemExit(f"apt has no source for Debian {release}: the base is made from its mirror")


def base_tag(release: str) -> str:
    recipe = json.dumps([BASE_RECIPE, release, BASE_PACKAGES, VENV, BASE_ENV, SLIM])
    return f"localhost/{NAME}-base:{release}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


# --8<-- [start:base]
def base() -> str:
    """The base image's tag, made first if missing: debootstrap into a scratch container's root,
    then a venv with pip upgraded as ``make setup`` upgrades it (bookworm's pip 23.0 backtracks
    for many minutes over the build extra's versions)."""
    release = suite()
    tag = base_tag(release)
    if exists("buildah", tag):
        return tag
    mirror = debian_mirror(release)
    _say(f"the base {tag}: Debian {release} from {mirror}, debootstrap (about a minute) ...")
    container = _out("buildah", "from", "scratch")
    try:
        root = Path(_out("buildah", "mount", container))
        include = f"--include={','.join(BASE_PACKAGES)}"
        done = subprocess.run(["debootstrap", "--variant=minbase", include, release, str(root), mirror],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"debootstrap failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        for folder in SLIM:
            for entry in (root / folder).iterdir():
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        _out("buildah", "umount", container)
        chroot = ["buildah", "run", "--isolation", "chroot"]
        _out(*chroot, container, "--", "python3", "-m", "venv", VENV)
        with pip_mounts() as mounts:
            _out(*chroot, *mounts, container, "--", f"{VENV}/bin/pip", "install", "-q", "--upgrade", "pip")
        _out("buildah", "config", *(f"--env={k}={v}" for k, v in BASE_ENV.items()), container)
        _out("buildah", "commit", "--quiet", container, tag)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True)
    return tag


# --8<-- [end:base]


# --- the host's pip configuration, passed in --------------------------------------------------------
def pip_config() -> dict[str, dict[str, str]]:
    """The host's pip configuration as pip merges it: every file, then the PIP_* variables over all."""
    listed = _out(sys.executable, "-m", "pip", "config", "list")
    sections: dict[str, dict[str, str]] = {}
    variables: dict[str, str] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        target = variables if section == ":env:" else sections.setdefault(section, {})
        target[name] = str(ast.literal_eval(value))
    for name, value in variables.items():
        for options in sections.values():
            options.pop(name, None)
        sections.setdefault("global", {})[name] = value
    return sections


def local_paths(config: Mapping[str, Mapping[str, str]]) -> list[Path]:
    """Every local file and folder the configuration names. For a file:// index, the folder above
    it: a local index's pages link to files beside it (``simple/x/`` to ``../../files/``)."""
    found: set[Path] = set()
    for options in config.values():
        for key, value in options.items():
            for word in value.split():
                path = Path(urllib.parse.urlparse(word).path if word.startswith("file://") else word)
                if word.startswith("file://") and key.endswith("index-url"):
                    path = path.parent
                if path.is_absolute() and path.exists():
                    found.add(path)
    return sorted(p for p in found if not any(q in p.parents for q in found))


@contextmanager
def pip_mounts() -> Iterator[list[str]]:
    """buildah's ``--volume`` options that give a RUN step the host's pip configuration."""
    config = pip_config()
    with tempfile.TemporaryDirectory(prefix="image-pip-") as tmp:
        conf = Path(tmp) / "pip.conf"
        conf.write_text("".join(f"[{s}]\n" + "".join(f"{k} = {v}\n" for k, v in o.items())
                                for s, o in config.items()))  # fmt: skip
        yield [f"--volume={conf}:/etc/pip.conf:ro", *(f"--volume={p}:{p}:ro" for p in local_paths(config))]


def _extra_index(config: Mapping[str, Mapping[str, str]], http_only: bool) -> str:
    words = " ".join(o.get("extra-index-url", "") for o in config.values()).split()
    return " ".join(w for w in words if not http_only or w.startswith(("http://", "https://")))


# --- the image ------------------------------------------------------------------------------------
def copied_files() -> list[str]:
    """The files of the build context the Dockerfile's COPY lines read, as git lists them."""
    sources = []
    for line in DOCKERFILE.read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            sources += [w for w in words[1:-1] if not w.startswith("--")]
    listed = _out("git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                  "--", *sources)  # fmt: skip
    return sorted({f for f in listed.split("\0") if f and (REPO / f).is_file()})


def tag_for(kind: str, base_id: str) -> str:
    """``embedserve:<hash>``: the Dockerfile, every file it copies, and the base it builds on."""
    digest = hashlib.sha256(DOCKERFILE.read_bytes() + base_id.encode())
    for name in copied_files():
        path = REPO / name
        digest.update(
            f"{name}\0{os.access(path, os.X_OK)}\0".encode() + hashlib.sha256(path.read_bytes()).digest()
        )
    return f"{'' if kind == 'docker' else 'localhost/'}{NAME}:{digest.hexdigest()[:16]}"


@dataclass
class Image:
    tag: str
    engine: str
    built_s: float | None  # None: an image built from the same files was there already


def build(log: IO[str] | None = None) -> Image:
    """The image of these files, built unless it is there already; also tagged ``embedserve:latest``."""
    kind = engine()
    from_image = "" if kind == "docker" else base()
    tag = tag_for(
        kind, "" if kind == "docker" else inspect("buildah", from_image).get("FromImageID", from_image)
    )
    if exists(kind, tag):
        _say(f"{tag} is built from these files already")
        return Image(tag, kind, None)
    started = time.monotonic()
    if kind == "docker":
        extra = _extra_index(pip_config(), http_only=True)
        args = ["--build-arg", f"PIP_EXTRA_INDEX_URL={extra}"] if extra else []
        command = [DOCKER, "build", "-f", str(DOCKERFILE), "-t", tag, *args, "."]
    with pip_mounts() as mounts:
        if kind == "buildah":
            # Docker's format: OCI's has no HEALTHCHECK. --layers: a stage whose files did not
            # change (the model's) is reused.
            command = ["buildah", "bud", "--isolation", "chroot", "--format=docker", "--layers",
                       "-f", str(DOCKERFILE), "-t", tag, f"--build-arg=PYTHON_IMAGE={from_image}",
                       # The Dockerfile sets PIP_EXTRA_INDEX_URL (empty by default), which would
                       # hide the configuration's own: that one goes in instead.
                       f"--build-arg=PIP_EXTRA_INDEX_URL={_extra_index(pip_config(), http_only=False)}",
                       *mounts, "."]  # fmt: skip
        _say(f"building {tag} with {kind} (the model is built inside: minutes the first time) ...")
        subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
    _out(DOCKER if kind == "docker" else "buildah", "tag", tag, f"{NAME}:latest")
    built = time.monotonic() - started
    _say(f"built {tag} in {built:.0f} s")
    return Image(tag, kind, built)


# --- a container of it ------------------------------------------------------------------------------
@dataclass
class Container:
    """The image's CMD running: ``docker run``, or ``buildah run`` on the host's network."""

    image: Image
    name: str
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def server_pid(self) -> int:
        """The server's process as the host sees it (buildah: no process namespace of its own)."""
        import psutil

        if self.image.engine == "docker":
            return int(_out(DOCKER, "inspect", "--format", "{{.State.Pid}}", self.name))
        for child in psutil.Process(self.process.pid).children(recursive=True):
            if child.name().startswith("python"):
                return int(child.pid)
        raise RuntimeError(f"{self.name}: no server process (exit status {self.process.poll()})")

    def signal(self, sig: signal.Signals) -> None:
        """What ``docker stop`` does: the signal to the server itself."""
        if self.image.engine == "docker":
            _out(DOCKER, "kill", f"--signal={sig.name}", self.name)
        else:
            os.kill(self.server_pid(), sig)


def command(image: Image) -> list[str]:
    cmd: list[str] = inspect(image.engine, image.tag)["Cmd"]
    return cmd


@contextmanager
def running(image: Image, port: int, env: Mapping[str, str] | None = None,
            log: IO[bytes] | None = None) -> Iterator[Container]:  # fmt: skip
    """A container of ``image`` answering on 127.0.0.1:``port``; SIGTERM, then removed, on exit."""
    name = f"{NAME}-{port}"
    values = [f"--env={k}={v}" for k, v in (env or {}).items()]
    if image.engine == "docker":
        argv = [DOCKER, "run", "--rm", "--name", name, "-p", f"127.0.0.1:{port}:8000", *values, image.tag]
    else:  # the host's network: the server's own PORT is the port
        _out("buildah", "from", "--name", name, image.tag)
        argv = [
            "buildah",
            "run",
            "--isolation",
            "chroot",
            f"--env=PORT={port}",
            *values,
            name,
            "--",
            *command(image),
        ]
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    container = Container(image, name, port, process)
    try:
        yield container
    finally:
        if process.poll() is None:
            try:
                container.signal(signal.SIGTERM)
                process.wait(timeout=40)
            except (RuntimeError, subprocess.TimeoutExpired):
                process.kill()
                process.wait()
        if image.engine == "buildah":
            subprocess.run(["buildah", "rm", name], capture_output=True)


def run_once(image: Image, argv: list[str]) -> str:
    """``argv`` in a fresh container of the image, as its user; its output."""
    if image.engine == "docker":
        return _out(DOCKER, "run", "--rm", image.tag, *argv)
    container = _out("buildah", "from", image.tag)
    try:
        return _out("buildah", "run", "--isolation", "chroot", container, "--", *argv)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=("build", "run"))
    args = parser.parse_args(argv)
    image = build()
    if args.what == "run":
        port = int(os.environ.get("PORT", "8000"))
        with running(image, port) as container:
            _say(f"{image.tag} serving on {container.url} (Ctrl-C stops it)")
            with suppress(KeyboardInterrupt):
                container.process.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
