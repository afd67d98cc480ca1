"""`make results ONLY=stage4`: the stage 4 measurements (stage4.json and stage4.md).

    python -m benchmarks.stage4            # about 3 minutes (--quick: about 1.5, --record: docs/results/)

1. A Redis tier at a distance: the lesson's client (CACHE_CLIENT=per-command) and the pooled one,
   plain and TLS, near and 30 ms away (``loadtests.delay_relay``); and no cache at all.
2. The lookup's bound (CACHE_TIMEOUT_MS) under load: at the model's cost, and the default.
3. The overload run on stage 4 (MAX_QUEUE=5) and stage 3 (no bound), as a write-up ran it.
4. A flood of clients that wait a refusal's Retry-After or send again at once, by SHED_DELAY_MS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import psutil

from common import corpus
from common.settings import Settings
from loadtests import evidence, load
from loadtests.delay_relay import relay
from loadtests.load import Answer, bodies_for, post_bodies, process_cpu, settle
from loadtests.procs import StageProcess, redis_server, running_stage
from loadtests.tables import num, page, table

S3, S4 = "stage3_batching", "stage4_cache_backpressure"
LOGS = evidence.OUT / "logs" / "stage4"  # git-ignored server logs
HIT_SHARE, FAR_MS = 0.7, 30.0
LONG = {"CACHE_MAX_ITEMS": "0", "CACHE_TIMEOUT_MS": "2000"}  # the Redis tier alone, waited for
FLOOD = {"MAX_QUEUE": "8"}
KINDS = {"honour": "wait Retry-After", "resend": "send again at once"}
Sent = tuple[list[Answer], float]  # the answers, and the wall time they took


def _texts(n: int, kind: str = "sentence") -> list[str]:
    return corpus.texts(n, seed=random.randrange(2**31), kind=kind)


def _send(server: StageProcess, texts: list[str], clients: int, alive: bool = True) -> Sent:
    """Each text once, one text per request, ``clients`` at a time (closed loop); and the wall time."""
    bodies = [orjson.dumps({"inputs": [t]}) for t in texts]
    started = time.perf_counter()
    answers = asyncio.run(post_bodies(server.url, bodies, clients, keep_alive=alive))
    return answers, time.perf_counter() - started


def _mix(warm: list[str], n: int) -> list[str]:
    """``n`` requests: HIT_SHARE of them a text from ``warm`` (in Redis), the rest new."""
    hits = round(n * HIT_SHARE) if warm else 0  # no cache: the model computes them all alike
    texts = random.sample(warm, hits) + _texts(n - hits)
    random.shuffle(texts)
    return texts


def _p50(answers: list[Answer], state: str | None = None) -> float:
    assert all(a.status == 200 for a in answers), [a.status for a in answers]
    return round(statistics.median(a.ms for a in answers if state in (None, a.headers.get("x-cache"))), 2)


def _measure(server: StageProcess, warm: list[str], n: int) -> dict[str, Any]:
    """The mix: ``n`` requests from one client in turn (p50s), ``2n`` from eight at once (req/s)."""
    _send(server, _texts(4), 1)  # the connections and the allocator warm
    one, _ = _send(server, _mix(warm, n), 1)
    many, wall = _send(server, _mix(warm, 2 * n), 8)
    req_s = round(len(many) / wall, 1)
    if not warm:  # no cache: every request is the model's
        return {"ms": _p50(one), "req_s": req_s}
    return {"hit_ms": _p50(one, "hit"), "miss_ms": _p50(one, "miss"), "req_s": req_s}


def distance(n: int, load_requests: int) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": n, "hit_share": HIT_SHARE, "settings": LONG}
    with running_stage(S4, LOGS, {"CACHE_ENABLED": "false"}) as server:
        alone = _measure(server, [], n)
    out["no_cache_ms"], out["no_cache_req_s"] = alone["ms"], alone["req_s"]
    rows: list[dict[str, Any]] = out.setdefault("rows", [])
    for tls in (False, True):
        (folder := LOGS / f"redis-{'tls' if tls else 'plain'}").mkdir(parents=True, exist_ok=True)
        with redis_server(workdir=folder, tls=tls) as redis, relay(redis.port, FAR_MS) as far_port:
            ca = {"CACHE_CA_FILE": str(redis.ca_file)} if redis.ca_file else {}
            warm = _texts(2 * n)
            for rtt, port in ((0.0, redis.port), (FAR_MS, far_port)):
                env = {**LONG, **ca, "CACHE_URL": f"{'rediss' if tls else 'redis'}://127.0.0.1:{port}/0"}
                for client in ("pooled", "per-command"):
                    with running_stage(S4, LOGS, {**env, "CACHE_CLIENT": client}) as server:
                        if not rows or rows[-1]["tls"] != tls:  # the first server fills this Redis
                            _send(server, warm, 4)
                        row = _measure(server, warm, n)
                    rows.append({"client": client, "tls": tls, "rtt_ms": rtt, **row})
            if not tls:
                out["bound"] = bound(redis.url, out["no_cache_ms"], load_requests)
                continue
            with running_stage(S4, LOGS, {**env, "CACHE_MAX_ITEMS": "100000"}) as server:  # far, pooled
                _send(server, warm, 4)  # into its memory tier too
                out["memory_tier"] = {"tls": True, "rtt_ms": FAR_MS, **_measure(server, warm, n)}
    return out


def bound(url: str, model_ms: float, requests: int) -> dict[str, Any]:
    """32 clients, the mix, on the loopback Redis: a bound as low as the model's cost, and the default."""
    out: dict[str, Any] = {"clients": 32, "requests": requests, "repeats": round(requests * HIT_SHARE)}
    warm = _texts(out["repeats"])
    for name, timeout in (("model", model_ms), ("default", Settings().cache_timeout_ms)):
        env = {"CACHE_URL": url, "CACHE_MAX_ITEMS": "0", "CACHE_TIMEOUT_MS": f"{timeout:g}"}
        with running_stage(S4, LOGS, env) as server:
            if name == "model":  # into Redis, once for both
                _send(server, warm, 4)
            before = httpx.get(f"{server.url}/v1/cache/metrics", timeout=10).json()["cache"]
            answers, wall = _send(server, _mix(warm, requests), 32)
            after = httpx.get(f"{server.url}/v1/cache/metrics", timeout=10).json()["cache"]
        hits = sum(a.headers.get("x-cache") == "hit" for a in answers)
        timeouts = after["errors"].get("timeout", 0) - before["errors"].get("timeout", 0)
        skipped, req_s = after["skipped"] - before["skipped"], round(len(answers) / wall, 1)
        out[name] = dict(timeout_ms=timeout, hits=hits, timeouts=timeouts, skipped=skipped, req_s=req_s)
    return out


def _ms(values: list[float]) -> dict[str, float]:
    p50, p99 = (round(float(np.percentile(values, q)), 3) for q in (50, 99))
    return {"n": len(values), "p50_ms": p50, "p99_ms": p99}


def _fire(server: StageProcess, texts: list[str], concurrency: int, alive: bool = True) -> dict[str, Any]:
    """Status 0: no answer (counted). ``alive=False``: a connection a request, as independent clients."""
    answers, wall = _send(server, texts, concurrency, alive)
    by_status: dict[str, Any] = {}
    for status in sorted({a.status for a in answers}):
        mine = [a for a in answers if a.status == status]
        by_status[str(status)] = _ms([a.ms for a in mine])
        own = [float(a.headers["x-total-time"]) for a in mine if "x-total-time" in a.headers]
        if own:  # the server's own time
            by_status[str(status)]["server_p50_ms"] = _ms(own)["p50_ms"]
    return {"requests": len(texts), "concurrency": concurrency, "wall_s": round(wall, 3),
            "rps": round(len(texts) / wall, 1), "latency": _ms([a.ms for a in answers]),
            "by_status": by_status}  # fmt: skip


def overload(requests: int, concurrency: int, max_queue: int) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": requests, "concurrency": concurrency, "max_queue": max_queue}
    for stage, env in ((S4, {"MAX_QUEUE": str(max_queue)}), (S3, {})):
        with running_stage(stage, LOGS, env) as server:
            _fire(server, _texts(32), 8)
            out[stage] = _fire(server, _texts(requests, kind="passage"), concurrency, alive=False)
            started = time.perf_counter()
            out[stage]["healthy_after"] = httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            out[stage]["health_after_ms"] = round((time.perf_counter() - started) * 1e3, 2)
    return out


def _wrk(server: StageProcess, clients: int, seconds: float, seed: int, polite: bool) -> dict[str, Any]:
    """``clients`` wrk connections for ``seconds``: 200s/s, refusals/s, p50 and the server's cores."""
    process = psutil.Process(server.pid)
    cpu, started = process_cpu(process), time.perf_counter()
    bodies = bodies_for("sentence", 60_000, seed)
    out = load.wrk(server.url, bodies, clients, seconds, honour_retry_after=polite)
    cores = (process_cpu(process) - cpu) / (time.perf_counter() - started)
    return {"ok_per_s": out["requests_per_s"], "refused_per_s": out["non_2xx_per_s"], "p50_ms": out["p50_ms"],
            "socket_errors": out["socket_errors"], "server_cores": round(cores, 2)}  # fmt: skip


def flood(clients: int, delays: Sequence[float], seconds: float) -> dict[str, Any]:
    with running_stage(
        S4, LOGS
    ) as server:  # the capacity the flood is read against: the defaults, 32 clients
        load.wrk(server.url, bodies_for("sentence", 20_000, 7000), 32, 2)  # warm-up
        settle(server.pid, server.url)
        capacity = _wrk(server, 32, seconds, 7100, polite=False)
    rows = []
    for delay in delays:
        with running_stage(S4, LOGS, {**FLOOD, "SHED_DELAY_MS": f"{delay:g}"}) as server:
            load.wrk(server.url, bodies_for("sentence", 20_000, 7200), 32, 2)  # warm-up
            row: dict[str, Any] = {"delay_ms": delay}
            for kind in KINDS:
                settle(server.pid, server.url)
                polite = kind == "honour"  # new texts for each point: none is a cache hit
                row[kind] = _wrk(server, clients, seconds, 7300 + polite, polite)
                row[kind]["goodput"] = round(row[kind]["ok_per_s"] / capacity["ok_per_s"], 4)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {"clients": clients, "duration_s": seconds, "settings": FLOOD, "capacity": capacity,
            "capacity_per_s": capacity["ok_per_s"], "default_delay_ms": Settings().shed_delay_ms,
            "by_delay": rows}  # fmt: skip


def _reading(d: dict[str, Any]) -> list[str]:
    """The chapter's four steps, in words generated from the table."""
    row = {(x["client"], x["tls"], x["rtt_ms"]): x for x in d["rows"]}
    far, near, naive = row["pooled", True, FAR_MS], row["pooled", True, 0.0], row["per-command", True, FAR_MS]
    share, none, memory = d["hit_share"], d["no_cache_ms"], d["memory_tier"]["hit_ms"]
    mix = share * near["hit_ms"] + (1 - share) * near["miss_ms"]

    def than_none(ms: float) -> str:  # a hit against the request with no cache, in words
        word = "slower" if ms > none else "faster"
        return f"{ms / none:.1f}x the request with no cache: a cache {word} than none"

    fix = naive["hit_ms"] / far["hit_ms"]  # what the pool does to the far hit
    pooled = f"{fix:.1f}x cheaper" if fix > 1 else f"{1 / fix:.1f}x dearer"
    return [
        "In this one run (one pass of each row):",
        "",
        f"- Far ({FAR_MS:g} ms) and over TLS, a per-command hit is {than_none(naive['hit_ms'])}.",
        f"- The pooled client makes that hit {pooled}.",
        f"- A hit costs the loopback hit plus the round trip (here"
        f" {far['hit_ms'] - near['hit_ms'] - FAR_MS:.1f} ms more, the relay that makes the distance), and so"
        " does the lookup before a miss: "
        f"against this model a hit stops paying at a round trip of {none - near['hit_ms']:.1f} ms, the "
        f"{100 * share:.0f}% mix at {none - mix:.1f} ms. At {FAR_MS:g} ms a pooled hit is "
        f"{than_none(far['hit_ms'])}.",
        f"- With the in-process tier in front of that far Redis, a repeat of a text this server has "
        f"seen is {memory:.2f} ms, {far['hit_ms'] / memory:.0f}x less than the far pooled hit.",
    ]


def _bound(b: dict[str, Any], model_ms: float) -> list[str]:
    low, high = b["model"], b["default"]
    return [
        f"**The lookup's bound under load** ({b['clients']} clients at once, {b['requests']} requests, "
        f"{b['repeats']} of them a text already in a Redis on the loopback; the Redis tier alone):",
        "",
        *table(["CACHE_TIMEOUT_MS", "Redis hits", "timeouts", "lookups skipped (backing off)", "req/s"],
               [(f"{m['timeout_ms']:g}", m["hits"], m["timeouts"], m["skipped"], num(m["req_s"], 0))
                for m in (low, high)], "rrrrr"),
        "",
        f"Bounded at the cost of a request with no cache ({model_ms:g} ms): {low['hits']} of {b['repeats']} "
        f"repeats hit, {num(low['req_s'], 0)} req/s. At the default, {high['timeout_ms'] / model_ms:.1f}x "
        f"that: {high['hits']} hit, {num(high['req_s'], 0)} req/s ({high['req_s'] / low['req_s']:.2f}x). "
        f"The default's price: a Redis that stops answering may add {high['timeout_ms'] / model_ms:.1f}x a "
        f"request's time to it, not 1x. Under this load, in this one run, it gets "
        f"{_more(high['hits'], low['hits'], 'hits')} and serves "
        f"{_more(high['req_s'], low['req_s'], 'requests a second')}.",
    ]  # fmt: skip


def _more(a: float, b: float, what: str) -> str:
    """``a`` against ``b`` in words, with the ratio: "more hits (1.94x)", "as many hits (1.02x)"."""
    if not b:
        return f"{'more' if a else 'as many'} {what} (none at the model's cost)"
    return f"{'as many' if abs(a / b - 1) < 0.05 else 'more' if a > b else 'fewer'} {what} ({a / b:.2f}x)"


def _flood(f: dict[str, Any], no_cache_ms: float) -> list[str]:
    by, default = {row["delay_ms"]: row for row in f["by_delay"]}, f["default_delay_ms"]
    rows = [(f"{d:g}", who, num(m["ok_per_s"], 0), num(m["refused_per_s"], 0), f"{100 * m['goodput']:.0f} %",
             num(m["p50_ms"], 1), num(m["server_cores"], 2))
            for d, row in by.items() for kind, who in KINDS.items() for m in [row[kind]]]  # fmt: skip
    polite = [100 * row["honour"]["goodput"] for row in f["by_delay"]]
    kept = ", ".join(f"{100 * row['resend']['goodput']:.0f}% at {d:g} ms" for d, row in by.items())
    p50 = {d: num(row["resend"]["p50_ms"], 1) for d, row in by.items()}
    best = max(by, key=lambda d: by[d]["resend"]["goodput"])  # the delay that keeps the most from resenders
    most = f"in this one run (one point a delay), the most at {best:g} ms; the default is {default:g} ms"
    return [
        f"**A flood** (stage 4, MAX_QUEUE={f['settings']['MAX_QUEUE']}, {f['clients']} `wrk` connections, "
        f"one new sentence per request, {f['duration_s']:g} s per point; capacity in this run, stage 4"
        " with its defaults under wrk "
        f"at 32 connections: {f['capacity_per_s']:.0f} answers/s):",
        "",
        *table(["SHED_DELAY_MS", f"{f['clients']} clients that ...", "200s/s", "503s/s", "of capacity",
                "p50 ms, every answer", "server cores"], rows, align="rlrrrrr"),
        "",
        f"Clients that send again at once keep {kept} of the capacity ({most}); clients that wait "
        f"Retry-After keep {min(polite):.0f}-{max(polite):.0f}% at every delay. Each refusal waits the "
        f"delay: the resending clients' p50 answer is {p50[default]} ms at the default {default:g} ms and "
        f"{p50[max(by)]} ms at {max(by):g}, where this run's request with no cache, one client at a time"
        f" (the distance study's), takes {no_cache_ms:g} ms (p50).",
    ]  # fmt: skip


def markdown(r: dict[str, Any]) -> str:
    d, ov = r["distance"], r["overload"]
    m, sections = d["memory_tier"], {}
    sections["distance"] = [
        f"**A Redis tier at a distance** (stage 4, Redis tier only, {d['requests']} requests of one "
        f"sentence in turn for the p50s and {2 * d['requests']} from 8 clients for req/s; "
        f"{100 * d['hit_share']:.0f}% of the texts already in Redis; CACHE_TIMEOUT_MS=2000):",
        "",
        *table(["client", "Redis", "round trip ms", "hit p50 ms", "miss p50 ms", "req/s"],
               [(x["client"], "TLS" if x["tls"] else "plain", f"{x['rtt_ms']:g}", num(x["hit_ms"]),
                 num(x["miss_ms"]), num(x["req_s"], 0))
                for x in sorted(d["rows"], key=lambda x: (x["rtt_ms"], x["tls"], x["client"]))], "llrrrr"),
        "",
        f"No cache at all: {num(d['no_cache_ms'])} ms a request (p50), {num(d['no_cache_req_s'], 0)} req/s. "
        f"The pooled client over TLS at {m['rtt_ms']:g} ms with the in-process tier in front: a repeat of "
        f"a text it has seen is {num(m['hit_ms'], 2)} ms, a new text {num(m['miss_ms'])} ms, "
        f"and {num(m['req_s'], 0)} req/s.",
    ]  # fmt: skip
    sections["reading"] = _reading(d)
    sections["bound"] = _bound(d["bound"], d["no_cache_ms"])
    rows = [(stage, "connection failed" if status == "0" else status, s["n"], num(s["p50_ms"]),
             num(s["p99_ms"]), num(s["server_p50_ms"], 2) if "server_p50_ms" in s else "–")
            for stage in (S4, S3) for status, s in ov[stage]["by_status"].items()]  # fmt: skip
    sections["overload"] = [
        f"**Overload** ({ov['requests']} requests of one passage each at concurrency {ov['concurrency']}; "
        f"stage 4 with MAX_QUEUE={ov['max_queue']}, stage 3 unbounded):",
        "",
        *table(["stage", "status", "count", "p50 ms", "p99 ms", "p50 ms, the server's own (x-total-time)"],
               rows, align="llrrrr"),
        "",
        *(f"- {stage}: all answered in {ov[stage]['wall_s']} s; `/health` right after: "
          f"{ov[stage]['health_after_ms']} ms." for stage in (S4, S3)),
    ]  # fmt: skip
    sections["flood"] = _flood(r["flood"], d["no_cache_ms"])
    return page(r["stamp"], sections) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--requests", type=int, help="per row of part 1, in turn (default 40, quick 16)")
    parser.add_argument("--flood-seconds", type=float, help="seconds per flood point (default 8, quick 2)")
    parser.add_argument("--out", type=Path, help="folder for stage4.json and stage4.md")
    evidence.add_arguments(parser)
    args = parser.parse_args(argv)
    run = evidence.start("benchmarks.stage4", args, argv)
    seconds = args.flood_seconds or (2.0 if args.quick else 8.0)
    print("1-2/4 a Redis tier at a distance; the lookup's bound under load", flush=True)
    result = {"distance": distance(args.requests or (16 if args.quick else 40), 160 if args.quick else 400)}
    print("3/4 overload, stage 4 and stage 3", flush=True)
    result["overload"] = overload(300, 200, 5)
    print("4/4 a flood, polite and impolite clients, by SHED_DELAY_MS", flush=True)
    result["flood"] = flood(200, (0.0, Settings().shed_delay_ms, 200.0), seconds)
    result["stamp"] = run.stamp()
    evidence.publish(run, "stage4", result, markdown, args.out)


if __name__ == "__main__":
    main()
