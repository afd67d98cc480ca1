"""`make test` installs every program a test or the measuring kit starts.

A fresh machine has none of what a developer's gained by hand. So this test reads the code for the
programs it starts (found with ``shutil.which``, named by a ``/usr/bin/`` path, or first in a
``subprocess`` argument list), asks
Debian which package ships each, and checks that ``make test`` on a machine without any of them
would install that package. A new tool that a test begins to use fails here until the Makefile's
``tools`` target installs it.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from conftest import REPO

# Where programs are started: the tests, the measuring kit, the deployment helpers.
SOURCES = ("tests", "loadtests", "benchmarks", "deploy")
# What every machine that runs `make test` has already: the README asks for make, a clone needs git,
# and apt-get (which `make tools` uses) comes with dpkg.
BASE = {"make", "git", "bash", "dpkg"}
STARTED = re.compile(
    r"""which\(\s*["']([\w.-]+)["']"""  # shutil.which("wrk")
    r"""|["']/usr/bin/([\w.-]+)["']"""  # "/usr/bin/chromium"
    r"""|(?:Popen|run|check_output|check_call|create_subprocess_exec)\(\s*\[\s*["']([\w.-]+)["']"""
)


def programs_started() -> dict[str, list[str]]:
    """Each program a source starts, with the files that start it."""
    found: dict[str, list[str]] = {}
    for folder in SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            for match in STARTED.finditer(path.read_text()):
                name = next(group for group in match.groups() if group)
                found.setdefault(name, []).append(str(path.relative_to(REPO)))
    return found


def debian_package(program: str) -> str:
    where = shutil.which(program)
    assert where, f"{program} is started by the tests or the kit, and is not installed here"
    # The path as found, not resolved: /usr/bin/redis-server is redis-server's link to a redis-tools file.
    owner = subprocess.run(["dpkg", "-S", where], capture_output=True, text=True)
    assert owner.returncode == 0, f"no Debian package ships {where}: `make tools` cannot install it"
    return owner.stdout.split(":", 1)[0]


def packages_make_test_installs_on_a_bare_machine() -> set[str]:
    """What `make test` hands apt-get (`make -n` prints the recipe and runs nothing)."""
    make = shutil.which("make")
    assert make
    plan = subprocess.run(
        [make, "-n", "--no-print-directory", "test"],
        cwd=REPO,
        env={"PATH": "/var/empty", "HOME": "/tmp"},
        capture_output=True,
        text=True,
    )
    assert plan.returncode == 0, plan.stderr
    recipe = plan.stdout.replace("\\\n", " ")  # a recipe line continued with a backslash is one line
    installs = [line for line in recipe.splitlines() if "apt-get install" in line]
    assert installs, f"`make test` installs nothing on a bare machine:\n{plan.stdout}"
    return {word for line in installs for word in line.split("apt-get install", 1)[1].split()}


def test_the_scan_finds_the_programs_it_is_meant_to_find() -> None:
    started = programs_started()
    for program in ("wrk", "prometheus", "promtool", "chromium", "redis-server"):
        assert program in started, f"the scan no longer sees {program}: {sorted(started)}"


def test_make_test_installs_every_program_the_tests_and_the_kit_start() -> None:
    installed = packages_make_test_installs_on_a_bare_machine()
    missing = {
        program: files
        for program, files in programs_started().items()
        if program not in BASE and debian_package(program) not in installed
    }
    assert not missing, f"started but not installed by `make test` (add it to make tools): {missing}"
