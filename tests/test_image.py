"""The image ``make image`` builds from ``deploy/docker/Dockerfile``, run as a container.

Built by ``deploy.docker.image.build`` (reused when an image of the same files is there: its tag
is a hash of the Dockerfile, every file it copies and the base), run with ``buildah run`` here
and ``docker run`` where a Docker engine answers. In the image: its non-root user, no torch, the
model files its manifest lists. Through a running container: an embed, the OpenAI route,
``/health``, ``/ready``, ``/metrics``, a bad input; then SIGTERM with a request in flight, which is
answered before the server exits.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from common import corpus
from common.engine import Engine
from deploy.docker.image import Container, Image, build, inspect, run_once, running
from loadtests.procs import free_port, wait_http, wait_until
from stage0_script.quality import GATE_MEAN_COSINE

# The first build makes the base, installs torch and builds the model inside: minutes. Later runs
# reuse the image, or rebuild only the stages whose files changed.
pytestmark = pytest.mark.timeout(2400)
USER = 10001  # the Dockerfile's `useradd --uid`


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    log = tmp_path_factory.mktemp("image") / "build.log"
    with log.open("w") as out:
        try:
            return build(out)
        except subprocess.CalledProcessError:
            pytest.fail(f"the image did not build:\n{log.read_text()[-6000:]}")


def _log(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:] if path.exists() else ""


@contextmanager
def _start(image: Image, log_dir: Path) -> Iterator[Container]:
    log = log_dir / "container.log"
    with log.open("wb") as out, running(image, free_port(), log=out) as container:
        try:
            wait_http(f"{container.url}/ready", container.process, timeout=120)
        except RuntimeError as exc:
            pytest.fail(f"{exc}\n{_log(log)}")
        yield container


@pytest.fixture(scope="module")
def container(image: Image, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    with _start(image, tmp_path_factory.mktemp("container")) as running_container:
        yield running_container


# --- what is in the image ---------------------------------------------------------------------------
IN_THE_IMAGE = """
import hashlib, importlib.util, json, os
from common.settings import Settings
folder = Settings().model_dir
manifest = json.loads((folder / "manifest.json").read_text())
print(json.dumps({
    "uid": os.getuid(),
    "torch": importlib.util.find_spec("torch") is not None,
    "present": sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()),
    "listed": manifest["files"],
    "sha256": {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in manifest["files"]},
    "gate": manifest["gate"]["passed"],
}))
"""


def test_the_image_runs_as_its_user_without_torch_and_its_model_matches_the_manifest(image: Image) -> None:
    config = inspect(image.engine, image.tag)
    assert config["User"] == f"{USER}:{USER}"
    assert config["Cmd"] == ["python", "-m", "common.serve", "stage5"]
    assert config["Healthcheck"]["Test"] == ["CMD", "python", "-m", "deploy.docker.healthcheck"]
    seen = json.loads(run_once(image, ["python", "-c", IN_THE_IMAGE]))
    assert seen["uid"] == USER  # a command run with no --user runs as the image's user
    assert not seen["torch"], "the runtime image has torch"
    assert seen["present"] == sorted([*seen["listed"], "manifest.json"])
    assert seen["sha256"] == {f: meta["sha256"] for f, meta in seen["listed"].items()}
    assert seen["gate"]
    # the host's pip configuration was mounted for the build's RUN steps only
    config = run_once(image, ["python", "-m", "pip", "config", "list"])
    assert "index-url" not in config and "find-links" not in config, config


# --- the API through the container ------------------------------------------------------------------
def test_the_api_contract_through_the_container(container: Container, fp32_engine: Engine) -> None:
    assert psutil.Process(container.server_pid()).uids().real == USER
    with httpx.Client(base_url=container.url, timeout=60) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/ready").status_code == 200

        texts = ["how do I bake bread", "the central bank raises interest rates"]
        r = client.post("/v1/embed", json={"inputs": texts})
        assert r.status_code == 200, r.text
        vectors = np.asarray(r.json()["embeddings"])
        assert vectors.shape == (2, 384) and r.json()["truncated"] == [False, False]
        # the image's INT8 model, against this checkout's fp32 build: the build's own quality gate
        cosines = (vectors * fp32_engine.embed(texts).vectors).sum(axis=1)
        assert cosines.mean() >= GATE_MEAN_COSINE, cosines

        r = client.post("/v1/embeddings", json={"input": texts[0], "model": r.json()["model"]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0]
        np.testing.assert_allclose(body["data"][0]["embedding"], vectors[0], atol=1e-5)

        bad = client.post("/v1/embed", json={"inputs": []})
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "inputs", bad.text

        metrics = client.get("/metrics")
        assert metrics.status_code == 200
        ok = re.search(r'^embedserve_requests_total\{[^}]*status="200"[^}]*\} (\S+)', metrics.text, re.M)
        assert ok and float(ok.group(1)) >= 2, metrics.text[:3000]


def _in_the_model(url: str) -> bool:
    """Stage 5's own gauges: texts queued or a batch inside the model."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = re.findall(r"^embedserve_(?:queue_depth_texts|batches_in_flight) (\S+)$", text, re.M)
    return any(float(v) > 0 for v in values)


def test_sigterm_answers_the_request_in_flight_then_the_server_exits(image: Image, tmp_path: Path) -> None:
    texts = corpus.texts(64, seed=36, kind="passage")  # new to the server: all of it goes to the model
    answers: list[httpx.Response] = []
    with _start(image, tmp_path) as container:
        server = psutil.Process(container.server_pid())

        def send(url: str = container.url) -> None:
            answers.append(httpx.post(f"{url}/v1/embed", json={"inputs": texts}, timeout=120))

        request = threading.Thread(target=send)
        request.start()
        wait_until(lambda url=container.url: _in_the_model(url), timeout=30, every=0.01)
        assert not answers, "the request was answered before the signal"
        container.signal(signal.SIGTERM)
        request.join(timeout=60)
        assert len(answers) == 1 and answers[0].status_code == 200, answers
        assert len(answers[0].json()["embeddings"]) == len(texts)
        server.wait(timeout=30)  # the server exits: the drain (DRAIN_TIMEOUT_S 20 s) is over
        container.process.wait(timeout=30)  # and so does the container
        log = _log(tmp_path / "container.log")
        assert "draining" in log and "Finished server process" in log, log
        assert "Traceback" not in log, log
