"""`make results ONLY=cache-distance`: a cache slower than no cache, and its fix (cache_distance.json).

    python -m benchmarks.cache_distance            # about 3 minutes
    python -m benchmarks.cache_distance --quick    # about a minute and a half
    python -m benchmarks.cache_distance --record   # written to docs/results/

Stage 4 with its Redis tier alone (CACHE_MAX_ITEMS=0, so every hit goes to Redis), for each
client (``CACHE_CLIENT=per-command``, the lesson's bug, and the shipped pooled client), plain and
over TLS, on loopback and behind ``loadtests.delay_relay`` at a 30 ms round trip. CACHE_TIMEOUT_MS
is 2000 here, so that a slow lookup shows its whole cost rather than the timeout's bound.

For each row, the write-up's mix: seven requests in ten repeat a text already in Redis. One
client in turn gives the p50 of hits and of misses; eight at once give requests per second.
Beside the rows, the same mix with the cache off (``no_cache_ms``, ``no_cache_req_s``) and the
pooled TLS client at 30 ms with the in-process tier in front (``memory_tier``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import orjson

from common import corpus
from loadtests import evidence
from loadtests.delay_relay import relay
from loadtests.load import Answer, post_bodies
from loadtests.procs import StageProcess, redis_server, running_stage
from loadtests.tables import num, page, table

STAGE = "stage4_cache_backpressure"
LOGS = evidence.OUT / "logs" / "cache_distance"
RUN_SETTINGS = {"CACHE_MAX_ITEMS": "0", "CACHE_TIMEOUT_MS": "2000"}
HIT_SHARE = 0.7
RTTS_MS = (0.0, 30.0)


def _texts(n: int) -> list[str]:
    return corpus.texts(n, seed=random.randrange(2**31), kind="sentence")


def _mix(warm: list[str], n: int) -> list[str]:
    """``n`` requests: HIT_SHARE of them a text from ``warm`` (in Redis), the rest new."""
    hits = round(n * HIT_SHARE)
    texts = random.sample(warm, hits) + _texts(n - hits)
    random.shuffle(texts)
    return texts


def _send(server: StageProcess, texts: list[str], clients: int) -> tuple[list[Answer], float]:
    bodies = [orjson.dumps({"inputs": [t]}) for t in texts]
    started = time.perf_counter()
    answers = asyncio.run(post_bodies(server.url, bodies, clients))
    wall = time.perf_counter() - started
    assert all(a.status == 200 for a in answers), [a.status for a in answers]
    return answers, wall


def _p50(answers: list[Answer], state: str | None = None) -> float:
    ms = [a.ms for a in answers if state is None or a.headers.get("x-cache") == state]
    return round(statistics.median(ms), 2)


def _measure(server: StageProcess, n: int, cached: bool = True) -> dict[str, Any]:
    """Warm a set of texts (into Redis, and into the memory tier when it is on), then the mix:
    one client in turn, then eight at once. Without a cache every request is the model's."""
    warm = _texts(n * 2)
    _send(server, warm, clients=4)  # written behind the answers
    _send(server, _texts(4), clients=1)  # the connections and the allocator warm
    one, _ = _send(server, _mix(warm, n), clients=1)
    many, wall = _send(server, _mix(warm, n * 2), clients=8)
    req_s = round(len(many) / wall, 1)
    if not cached:
        return {"ms": _p50(one), "req_s": req_s}
    return {"hit_ms": _p50(one, "hit"), "miss_ms": _p50(one, "miss"), "req_s": req_s}


@contextmanager
def _redis_at(tls: bool, rtt_ms: float, folder: Path) -> Iterator[tuple[str, Path | None]]:
    """A private Redis (plain or TLS) at ``rtt_ms``: its URL and CA file."""
    folder.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        server = stack.enter_context(redis_server(workdir=folder, tls=tls))
        port = server.port if rtt_ms == 0 else stack.enter_context(relay(server.port, rtt_ms))
        yield f"{'rediss' if tls else 'redis'}://127.0.0.1:{port}/0", server.ca_file


def measure(n: int) -> dict[str, Any]:
    LOGS.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {"requests": n, "hit_share": HIT_SHARE, "settings": RUN_SETTINGS}
    with running_stage(STAGE, LOGS, {"CACHE_ENABLED": "false"}) as server:
        print("no cache", flush=True)
        alone = _measure(server, n, cached=False)  # the model alone
        out["no_cache_ms"], out["no_cache_req_s"] = alone["ms"], alone["req_s"]
    for tls in (False, True):
        for rtt_ms in RTTS_MS:
            folder = LOGS / f"redis-{'tls' if tls else 'plain'}-{rtt_ms:g}"
            with _redis_at(tls, rtt_ms, folder) as (url, ca):
                for client in ("per-command", "pooled"):
                    print(f"{client}, tls={tls}, rtt {rtt_ms:g} ms", flush=True)
                    env = {**RUN_SETTINGS, "CACHE_URL": url, "CACHE_CLIENT": client}
                    if ca is not None:
                        env["CACHE_CA_FILE"] = str(ca)
                    with running_stage(STAGE, LOGS, env) as server:
                        row = _measure(server, n)
                    rows.append({"client": client, "tls": tls, "rtt_ms": rtt_ms, **row})
                if tls and rtt_ms == max(RTTS_MS):
                    print("pooled, tls, with the memory tier in front", flush=True)
                    env = {"CACHE_TIMEOUT_MS": "2000", "CACHE_URL": url, "CACHE_CA_FILE": str(ca)}
                    with running_stage(STAGE, LOGS, env) as server:
                        out["memory_tier"] = {"tls": True, "rtt_ms": rtt_ms, **_measure(server, n)}
    out["rows"] = rows
    out["derived"] = derived(out)
    return out


def derived(r: dict[str, Any]) -> dict[str, float]:
    """What the chapter reads off the table. A hit at a distance costs the loopback hit plus the
    round trip, and so does the lookup before a miss: the cache pays while, at the hit share,
    ``hit_share * (hit + rtt) + (1 - hit_share) * (miss + rtt)`` stays below no cache."""
    row = {(x["client"], x["tls"], x["rtt_ms"]): x for x in r["rows"]}
    far, near = max(RTTS_MS), min(RTTS_MS)
    pooled, naive, local = row["pooled", True, far], row["per-command", True, far], row["pooled", True, near]
    mix = r["hit_share"] * local["hit_ms"] + (1 - r["hit_share"]) * local["miss_ms"]
    return {
        "per_command_over_pooled_hit": round(naive["hit_ms"] / pooled["hit_ms"], 1),
        "per_command_hit_over_no_cache": round(naive["hit_ms"] / r["no_cache_ms"], 1),
        "pooled_hit_over_no_cache": round(pooled["hit_ms"] / r["no_cache_ms"], 1),
        "break_even_rtt_ms_hits": round(r["no_cache_ms"] - local["hit_ms"], 1),
        "break_even_rtt_ms_mix": round(r["no_cache_ms"] - mix, 1),
    }


def markdown(r: dict[str, Any]) -> str:
    rows = [
        (row["client"], "TLS" if row["tls"] else "plain", f"{row['rtt_ms']:g}", num(row["hit_ms"]),
         num(row["miss_ms"]), num(row["req_s"], 0))
        for row in sorted(r["rows"], key=lambda x: (x["rtt_ms"], x["tls"], x["client"]))
    ]  # fmt: skip
    m, d, far = r["memory_tier"], r["derived"], max(RTTS_MS)
    sections = {
        "distance": [
            f"**A Redis tier at a distance** (stage 4, Redis tier only, {r['requests']} requests of one "
            f"sentence in turn for the p50s and {2 * r['requests']} from 8 clients for req/s; "
            f"{100 * r['hit_share']:.0f}% of the texts already in Redis):",
            "",
            *table(
                ["client", "Redis", "round trip ms", "hit p50 ms", "miss p50 ms", "req/s"], rows, "llrrrr"
            ),
            "",
            f"No cache at all: {num(r['no_cache_ms'])} ms a request (p50), "
            f"{num(r['no_cache_req_s'], 0)} req/s. "
            f"The pooled client over TLS at {m['rtt_ms']:g} ms with the in-process tier in front: a "
            f"repeat of a text it has seen is {num(m['hit_ms'], 2)} ms, and {num(m['req_s'], 0)} req/s.",
        ],
        "reading": [
            f"- Far ({far:g} ms) and over TLS, a per-command hit is {d['per_command_hit_over_no_cache']}x "
            f"the request with no cache; a pooled hit is {d['pooled_hit_over_no_cache']}x, "
            f"{d['per_command_over_pooled_hit']}x cheaper than the per-command one.",
            f"- A hit costs the loopback hit plus the round trip, and so does the lookup before a miss: "
            f"against this model a hit stops paying at a round trip of {d['break_even_rtt_ms_hits']:g} ms, "
            f"the {100 * r['hit_share']:.0f}% mix at {d['break_even_rtt_ms_mix']:g} ms.",
        ],
    }
    return page(r["stamp"], sections) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, help="requests in turn per row (default 60, quick 20)")
    parser.add_argument("--out", type=Path, help="folder for cache_distance.json and .md")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.cache_distance", args, argv)
    result = measure(args.requests or (20 if args.quick else 60))
    result["stamp"] = run.stamp(RUN_SETTINGS)
    evidence.publish(run, "cache_distance", result, markdown, args.out)


if __name__ == "__main__":
    main()
