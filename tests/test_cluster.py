"""Stage 5 on a real two-node Ray cluster on this machine (``make cluster``), tested as a client sees it.

Both designs, one cluster each: ``whole`` (``deploy/ray/serve.yaml``: every replica the whole stage
5) and ``composed`` (``deploy/ray/composed.yaml``: an ingress deployment calling a model deployment,
batched by ``@serve.batch``, through a handle). Each is started with ``make cluster`` (the reader's
command, ``CLUSTER_CONFIG`` naming the design), on free ports, with the Redis tier shared by both
ingress replicas, and stopped with ``make cluster-down``. In order:

1. the whole API contract suite (``test_contract.py``), collected again here against the cluster;
2. placement (one replica a node) and the shared cache (a text computed by one replica is a
   Redis hit on the other, as Ray's own metrics export of that replica says);
3. one Prometheus, the shipped configuration, finding every node from Ray's service discovery
   file and scraping every replica, with stage 5's recording rules;
4. a flood against a tiny queue (``serve deploy`` of a config with MAX_QUEUE=4, for one test):
   every refusal is a replica's own, in the API's JSON error shape, with Retry-After;
5. the worker node killed (SIGKILL at once to its ``ray start --block``, so to its raylet and
   agents, and to its replica, by the pid Ray's state API reports) under a steady load: every
   request answered, failures only among those in flight, a retry gets 200, then the node comes
   back and a replica with it. In the composed design a request whose model replica died gets
   its 503 from the ingress, which maps the handle's actor error to it;
6. MAX_BATCH_SIZE and BATCH_WINDOW_MS reach the batcher: stage 3's (whole), ``@serve.batch`` (composed).

``make cluster-down`` must leave no process of the cluster behind: every process found before it
(by the session folder and the GCS address in their command lines, and all they started) is gone.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import psutil
import pytest
import yaml
from fresh import fresh_texts
from prometheus_client.parser import text_string_to_metric_families
from prometheus_support import prometheus_log, query, running_prometheus
from redis_support import any_redis

# The contract suite, collected again in this module: its tests use the `server` fixture below.
from test_contract import *  # noqa: F403

from deploy.ray import nodes
from deploy.ray.settings import ClusterSettings
from loadtests.procs import free_port

REPO = Path(__file__).resolve().parent.parent
TEMP_DIR = "/tmp/ray-estest"  # not /tmp/ray-embedserve: a reader's `make cluster` may be up
DEADLINE_S = 10.0
DESIGNS = {
    "whole": REPO / "deploy" / "ray" / "serve.yaml",
    "composed": REPO / "deploy" / "ray" / "composed.yaml",
}


@dataclass
class Cluster:
    design: str
    url: str
    env: dict[str, str]
    settings: ClusterSettings
    head: str
    worker: str
    worker_pid: int  # the worker node's `ray start --block`
    replicas: dict[str, str] = field(default_factory=dict)  # x-served-by -> node id prefix

    def log(self) -> str:
        """Every replica's and the proxy's log of this session (what `test_server_log...` reads)."""
        logs = self.settings.temp_dir / "session_latest" / "logs"
        files = [
            *logs.glob("serve/replica_*.log"),
            *logs.glob("serve/proxy_*.log"),
            *logs.glob("worker-*.err"),
        ]
        return "\n".join(f.read_text(errors="replace") for f in files)

    def command(self, *args: str, timeout: float = 300) -> str:
        done = subprocess.run(
            [*args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout


def cluster_processes(cs: ClusterSettings) -> dict[int, psutil.Process]:
    """Every process of the cluster: those whose command line names its session folder or GCS
    address (the nodes' `ray start`, raylets, agents), and everything they started (workers keep no
    such command line: Ray renames them `ray::...`)."""
    marks = (str(cs.temp_dir), f"127.0.0.2:{cs.gcs_port}")
    found = {}
    for proc in psutil.process_iter():
        try:
            if any(mark in " ".join(proc.cmdline()) for mark in marks) and proc.pid != os.getpid():
                found[proc.pid] = proc
        except psutil.Error:
            continue
    for proc in list(found.values()):
        try:
            found.update({child.pid: child for child in proc.children(recursive=True)})
        except psutil.Error:
            continue
    return found


def _running(procs: dict[int, psutil.Process]) -> list[str]:
    out = []
    for proc in procs.values():
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.Error:
            continue
    return out


@pytest.fixture(scope="module", params=list(DESIGNS))
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("cluster")
    with any_redis(work) as redis_url:
        env = {
            **os.environ,
            "HOST": "127.0.0.1",
            "PORT": str(free_port()),
            "CLUSTER_GCS_PORT": str(free_port()),
            "CLUSTER_DASHBOARD_PORT": str(free_port()),
            "CLUSTER_TEMP_DIR": TEMP_DIR,
            "CLUSTER_STATE_FILE": str(work / "state.json"),
            "CLUSTER_CONFIG": str(DESIGNS[request.param]),
            "CACHE_URL": redis_url,  # one tier for both replicas
            # Every request's deadline (the node-kill test counts on it), above the time Ray takes to
            # declare the killed node dead (3 missed health checks 1 s apart, cluster.node_env): a
            # request sent to the lost node gets its retryable 503 then, not a 504 (composed: the
            # ingress's deadline). With Ray's defaults (5 x 3 s) a retry sent there waited past it.
            "REQUEST_TIMEOUT_S": str(DEADLINE_S),
        }
        ports = {"gcs_port": env["CLUSTER_GCS_PORT"], "dashboard_port": env["CLUSTER_DASHBOARD_PORT"]}
        cs = ClusterSettings(temp_dir=Path(TEMP_DIR), state_file=work / "state.json", **ports)
        assert not _running(cluster_processes(cs)), f"a cluster in {TEMP_DIR} is still running"
        started = time.monotonic()
        up = subprocess.run(["make", "cluster"], cwd=REPO, env=env, capture_output=True, text=True)
        try:
            assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
            print(f"make cluster: {time.monotonic() - started:.1f} s\n{up.stdout[-1500:]}")
            state = json.loads(cs.state_file.read_text())
            (head, _), (worker, worker_pid) = state["nodes"].items()
            yield Cluster(request.param, state["url"], env, cs, head, worker, worker_pid)
        finally:
            before = cluster_processes(cs)
            down = subprocess.run(["make", "cluster-down"], cwd=REPO, env=env, capture_output=True, text=True)
            assert down.returncode == 0, down.stdout + down.stderr
            # Each node's `ray start` returns once it has stopped what it started; a process those
            # started in turn may take a moment more to end (seen once: 1 of 29, gone within a second).
            deadline = time.monotonic() + 10
            left = _running(before) + _running(cluster_processes(cs))
            while left and time.monotonic() < deadline:
                time.sleep(0.5)
                left = _running(before) + _running(cluster_processes(cs))
            assert not left, f"make cluster-down left {left} of {len(before)} processes running"


# --- 1. the contract suite ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(cluster: Cluster) -> Cluster:
    """What the contract suite talks to: the cluster's one address (the proxy on the head)."""
    return cluster


# --- 2. placement and the shared cache -----------------------------------------------------------
def served_by(client: httpx.Client, want: int, tries: int = 200) -> dict[str, str]:
    """Replica names seen at /ready until ``want`` differ: name -> node id prefix."""
    seen: dict[str, str] = {}
    for _ in range(tries):
        name = client.get("/ready").headers["x-served-by"]
        seen[name] = name.split("@")[1]
        if len(seen) >= want:
            break
    return seen


def test_one_replica_on_each_node(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.url, timeout=30) as client:
        replicas = served_by(client, 2)
    assert len(replicas) == 2, replicas
    assert sorted(replicas.values()) == sorted([cluster.head[:8], cluster.worker[:8]])
    cluster.replicas = replicas


def test_a_text_one_replica_computed_is_a_redis_hit_on_the_other(cluster: Cluster) -> None:
    body = {"inputs": fresh_texts(1)}
    with httpx.Client(base_url=cluster.url, timeout=30) as client:
        first = client.post("/v1/embed", json=body)
        assert first.status_code == 200 and first.headers["x-cache"] == "miss"
        origin = first.headers["x-served-by"]
        for _ in range(100):  # the proxy picks; ask again until the other replica answers
            again = client.post("/v1/embed", json=body)
            assert again.status_code == 200 and again.headers["x-cache"] == "hit"
            if again.headers["x-served-by"] != origin:
                break
        else:
            pytest.fail("the other replica never answered")
    assert again.json()["embeddings"] == first.json()["embeddings"]
    # That replica had never seen the text: its hit came from the Redis tier. Ray's metrics export
    # says so, within a few of its report intervals.
    other = again.headers["x-served-by"].split("@")[0]
    deadline = time.monotonic() + 60
    while (hits := redis_hits(cluster).get(other, 0.0)) < 1 and time.monotonic() < deadline:
        time.sleep(1)
    assert hits >= 1, redis_hits(cluster)


def ray_targets(cluster: Cluster) -> list[str]:
    """Every metrics address in Ray's own Prometheus service discovery file."""
    listed = json.loads((cluster.settings.temp_dir / "prom_metrics_service_discovery.json").read_text())
    return [target for group in listed for target in group["targets"]]


def redis_hits(cluster: Cluster) -> dict[str, float]:
    """`embedserve_cache_hits_total{tier="redis"}` of each replica, from Ray's export on every node."""
    hits: dict[str, float] = {}
    for target in ray_targets(cluster):
        text = httpx.get(f"http://{target}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "ray_embedserve_cache_hits_total" and sample.labels.get("tier") == "redis":
                    replica = sample.labels["replica"]
                    hits[replica] = hits.get(replica, 0.0) + sample.value
    return hits


# --- 3. one Prometheus for every replica -----------------------------------------------------------
def test_prometheus_scrapes_every_replica_with_the_shipped_config(cluster: Cluster, tmp_path: Path) -> None:
    # The shipped file, with its two paths pointed at this test's cluster.
    shipped = (REPO / "deploy" / "ray" / "prometheus.yml").read_text()
    sd_file = "/tmp/ray-embedserve/prom_metrics_service_discovery.json"
    assert sd_file in shipped
    config = shipped.replace(sd_file, str(cluster.settings.temp_dir / "prom_metrics_service_discovery.json"))
    config = config.replace("../../stage5_metrics/", f"{REPO}/stage5_metrics/")
    (tmp_path / "prometheus.yml").write_text(config)
    with running_prometheus(tmp_path / "prometheus.yml") as api:
        deadline = time.monotonic() + 90
        replicas: set[str] = set()
        rates: list[dict] = []  # type: ignore[type-arg]
        while time.monotonic() < deadline and (len(replicas) < 2 or not rates):
            time.sleep(1)
            replicas = {r["metric"]["replica"] for r in query(api, "embedserve_requests_total")}
            rates = query(api, "embedserve:requests:rate1m")
        log = prometheus_log(tmp_path / "prometheus.yml")
        assert len(replicas) == 2, f"Prometheus saw {replicas}\n{log}"
        # The recording rules of one server work across the fleet: one rate per route and status.
        assert rates and all("route" in r["metric"] and "status" in r["metric"] for r in rates), log
        # Every node's export Ray lists is scraped and up.
        up = query(api, 'up{job="ray"}')
        assert len(up) == len(ray_targets(cluster)) >= 2 and all(r["value"][1] == "1" for r in up), up


# --- 4. refusals under a flood ---------------------------------------------------------------------
async def _flood(url: str, n: int, texts: int) -> list[httpx.Response]:
    # Fresh texts in every request: the same texts in flight at once would be computed once (stage 4).
    # A deadline of their own: the cluster's (REQUEST_TIMEOUT_S) is the node-kill test's, and on a
    # shared machine an admitted request may pass it; this test is about the queue.
    bodies = [{"inputs": [" ".join(fresh_texts(8)) for _ in range(texts)]} for _ in range(n)]
    headers = {"x-request-timeout": "60"}
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as client:
        return list(await asyncio.gather(*(client.post("/v1/embed", json=body) for body in bodies)))


def test_a_floods_refusals_are_the_replicas_own_json_errors(cluster: Cluster, tmp_path: Path) -> None:
    """A tiny queue in each replica (MAX_QUEUE=4, through the config's runtime_env): Serve hands
    the replicas every request (max_ongoing_requests above what they admit), so every refusal is
    stage 5's own, in the API's error shape, with Retry-After and the replica's name; nothing else
    but 200."""
    with redeployed(cluster, tmp_path, {"MAX_QUEUE": "4"}):
        answers = asyncio.run(_flood(cluster.url, 40, 16))
        statuses = [r.status_code for r in answers]
        refused = [r for r in answers if r.status_code == 503]
        assert set(statuses) <= {200, 503} and refused and 200 in statuses, statuses
        for r in refused:
            error = r.json()["error"]
            assert error["code"] == 503 and int(r.headers["retry-after"]) >= 1
            assert "MAX_QUEUE=4" in error["message"] and "@" in r.headers["x-served-by"], error


@contextmanager
def redeployed(cluster: Cluster, tmp_path: Path, settings: dict[str, str]) -> Iterator[None]:
    """The design's config deployed again with these stage settings (its `runtime_env`), for one
    test; then the config as it was."""
    config = yaml.safe_load(DESIGNS[cluster.design].read_text())
    config["applications"][0]["runtime_env"] = {"env_vars": settings}
    (tmp_path / "changed.yaml").write_text(yaml.safe_dump(config))
    changed = {**cluster.env, "CLUSTER_CONFIG": str(tmp_path / "changed.yaml")}
    command = [".venv/bin/python", "-m", "deploy.ray.cluster", "redeploy"]
    done = subprocess.run(command, cwd=REPO, env=changed, capture_output=True)
    try:
        assert done.returncode == 0, done.stderr[-3000:]
        yield
    finally:
        back = cluster.command(".venv/bin/python", "-m", "deploy.ray.cluster", "redeploy")
        assert "redeployed" in back


# --- 6. the batch settings reach the batcher ------------------------------------------------------
def test_max_batch_size_and_the_window_reach_the_batcher(cluster: Cluster, tmp_path: Path) -> None:
    """MAX_BATCH_SIZE=4 and a long window (BATCH_WINDOW_MS=400): 16 texts sent at once, one per
    request, fill batches of 4 and never more (x-batch-size), whether stage 3's batcher forms them
    (whole) or ``@serve.batch`` in the model deployment (composed)."""
    with redeployed(cluster, tmp_path, {"MAX_BATCH_SIZE": "4", "BATCH_WINDOW_MS": "400"}):
        answers = asyncio.run(_flood(cluster.url, 16, 1))
    sizes = [int(size) for r in answers for size in r.headers["x-batch-size"].split(",")]
    assert all(r.status_code == 200 for r in answers) and max(sizes) == 4, sizes


# --- 5. a node lost under load, and back -----------------------------------------------------------
@dataclass
class Outcome:
    status: int  # 0: no answer at all
    started: float
    seconds: float
    served_by: str | None
    retry_after: str | None
    body: bytes


async def _attempt(client: httpx.AsyncClient, body: bytes) -> Outcome:
    started = time.monotonic()
    try:
        r = await client.post("/v1/embed", content=body, headers={"content-type": "application/json"})
    except httpx.HTTPError as exc:
        return Outcome(0, started, time.monotonic() - started, type(exc).__name__, None, body)
    return Outcome(
        r.status_code,
        started,
        time.monotonic() - started,
        r.headers.get("x-served-by"),
        r.headers.get("retry-after"),
        body,
    )


async def steady_load_with_a_kill(cluster: Cluster, clients: int, before_s: float, after_s: float):  # type: ignore[no-untyped-def]
    """``clients`` users, each sending one fresh text at a time, retrying a failure once after its
    Retry-After; the worker node is killed ``before_s`` in (what ``cluster kill-node`` does) and
    the load runs ``after_s`` more."""
    firsts: list[Outcome] = []
    retries: list[Outcome] = []
    stop = asyncio.Event()
    texts = iter(fresh_texts(5000))

    async def user() -> None:  # one keep-alive connection each, as a client process has
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(base_url=cluster.url, limits=limits, timeout=15.0) as client:
            while not stop.is_set():
                body = orjson.dumps({"inputs": [next(texts)]})
                first = await _attempt(client, body)
                firsts.append(first)
                if first.status != 200:
                    await asyncio.sleep(float(first.retry_after or 0))
                    retries.append(await _attempt(client, body))

    workers = nodes.node_workers(cluster.settings, cluster.worker)  # its replica, as Ray reports it
    assert workers, "Ray lists no actor on the worker node"
    users = [asyncio.create_task(user()) for _ in range(clients)]
    await asyncio.sleep(before_s)
    killed_at = time.monotonic()
    nodes.kill_node(cluster.worker_pid, workers)
    await asyncio.sleep(after_s)
    stop.set()
    await asyncio.gather(*users)
    return firsts, retries, killed_at


def test_killing_the_worker_node_under_load(cluster: Cluster) -> None:
    clients = 8
    firsts, retries, killed_at = asyncio.run(steady_load_with_a_kill(cluster, clients, 4.0, 8.0))
    worker_replica = next(n for n, node in served_by_names(firsts).items() if node == cluster.worker[:8])
    failed = [o for o in firsts if o.status != 200]
    counts = _count(firsts)
    print(f"node kill: {len(firsts)} requests {counts}; {len(retries)} retried {_count(retries)}")
    # Every request got an answer, none waited past its deadline by much.
    assert all(o.status != 0 for o in firsts + retries), [o for o in firsts + retries if o.status == 0]
    assert max(o.seconds for o in firsts) < DEADLINE_S + 2.0
    # Only what the dead node held failed, each with a retryable status and Retry-After.
    assert len(failed) <= clients
    assert all(o.status in (503, 429) and o.retry_after for o in failed), failed
    assert all(o.started < killed_at + 1.0 for o in failed), [o.started - killed_at for o in failed]
    # A client that retries once gets 200.
    assert [o.status for o in retries] == [200] * len(failed)
    # New requests go to the surviving replica: everything sent a moment after the kill.
    later = [o for o in firsts if o.started > killed_at + 1.0]
    assert later and all(o.status == 200 and o.served_by != worker_replica for o in later)
    cluster.replicas = {"lost": worker_replica}


def served_by_names(outcomes: list[Outcome]) -> dict[str, str]:
    return {o.served_by: o.served_by.split("@")[1] for o in outcomes if o.served_by and "@" in o.served_by}


def _count(outcomes: list[Outcome]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    return counts


def test_the_node_comes_back_with_a_replica(cluster: Cluster) -> None:
    out = cluster.command(".venv/bin/python", "-m", "deploy.ray.cluster", "add-node")
    assert "joined" in out
    deadline = time.monotonic() + 120
    with httpx.Client(base_url=cluster.url, timeout=30) as client:
        while time.monotonic() < deadline:
            replicas = served_by(client, 2, tries=20)
            if len(replicas) == 2:
                break
            time.sleep(1)
    assert len(replicas) == 2, replicas
    assert cluster.replicas.get("lost") not in replicas  # a new replica, on the new node
    assert cluster.worker[:8] not in replicas.values()
