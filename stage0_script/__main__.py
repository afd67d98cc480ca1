"""Stage 0: the model as a plain script. No server, no concurrency: the baseline.

    python -m stage0_script "first text" "second text"      # JSON vectors on stdout
    python -m stage0_script --file texts.txt --summary     # one text per line
    echo "some text" | python -m stage0_script --summary   # stdin
    python -m stage0_script --bench                        # fp32 vs INT8: size, load, latency, items/s

``--bench`` prints a table (and writes its figures as JSON with ``--out``): the baseline every
later stage is measured against. ``make results ONLY=stage0`` (benchmarks/stage0.py) records the
same measurement, stamped, beside the quantization study, for the docs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from common import corpus
from common.engine import Engine
from common.settings import get_settings

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
VARIANTS = ("fp32", "int8-dynamic", "int8-static", "int8-rowwise")


def read_texts(args: argparse.Namespace) -> list[str]:
    if args.texts:
        return list(args.texts)
    if args.file:
        source = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")  # noqa: SIM115
        with source:
            return [line.rstrip("\n") for line in source if line.strip()]
    if not sys.stdin.isatty():
        return [line.rstrip("\n") for line in sys.stdin if line.strip()]
    return []


# --8<-- [start:embed]
def embed(args: argparse.Namespace) -> int:
    texts = read_texts(args)
    if not texts:
        print("no texts: pass them as arguments, with --file, or on stdin", file=sys.stderr)
        return 2
    settings = get_settings()
    engine = Engine(settings.model_dir, variant=args.variant, intra_threads=settings.onnx_intra_threads)
    out = engine.embed(texts, normalize=not args.raw)
    if args.summary:
        print(
            f"model {engine.model_name}: {len(texts)} texts -> {out.vectors.shape}, "
            f"{out.timings['inference_ms']:.1f} ms"
        )
        for text, vec, n, cut in zip(texts, out.vectors, out.n_tokens, out.truncated, strict=True):
            head = ", ".join(f"{x:+.4f}" for x in vec[:4])
            print(
                f"  [{head}, ...] norm={np.linalg.norm(vec):.3f} tokens={n}{' (truncated)' if cut else ''}"
                f"  {text[:60]!r}"
            )
    else:
        json.dump(
            {
                "model": engine.model_name,
                "embeddings": out.vectors.tolist(),
                "truncated": out.truncated,
                "tokens": out.n_tokens,
            },
            sys.stdout,
        )
        print()
    return 0


# --8<-- [end:embed]


# --8<-- [start:bench]
def bench_variant(model_dir: Path, variant: str, texts: list[str], seconds: float) -> dict[str, Any]:
    path = model_dir / variant / "model.onnx"
    engine = Engine(model_dir, variant=variant, intra_threads=get_settings().onnx_intra_threads)
    engine.warmup()
    ids = [t.ids for t in engine.tokenize(texts)]
    # Latency of one call with one text: the floor for any request.
    latencies = []
    for i in range(max(20, int(seconds * 50))):
        t0 = time.perf_counter()
        engine.run([ids[i % len(ids)]])
        latencies.append((time.perf_counter() - t0) * 1e3)
    throughput = {}
    for bs in BATCH_SIZES:
        done, t0, i = 0, time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            batch = [ids[(i + k) % len(ids)] for k in range(bs)]
            engine.run(batch)
            done, i = done + bs, i + bs
        throughput[str(bs)] = round(done / (time.perf_counter() - t0), 1)
    return {
        "variant": variant,
        "size_mb": round(path.stat().st_size / 1e6, 1),
        "load_s": round(engine.load_seconds, 3),
        "latency_ms_batch1": {
            "p50": round(statistics.median(latencies), 2),
            "p90": round(float(np.percentile(latencies, 90)), 2),
        },
        "items_per_s": throughput,
        "best": max(throughput.items(), key=lambda kv: kv[1]),
        "quality": engine.manifest.get("quality", {}).get("variants", {}).get(variant, {}),
    }


def measure(seconds: float, model_dir: Path | None = None) -> dict[str, Any]:
    """Every variant on the same 256 unique sentences, with ONNX Runtime's default threads (wall
    clock: what a reader's machine does, neighbours included): the figures ``--bench`` prints."""
    model_dir = model_dir or get_settings().model_dir
    texts = corpus.texts(256, seed=11, kind="sentence")  # 12-20 word sentences, unique
    manifest = Engine(model_dir, variant="fp32").manifest
    return {
        "texts": {"kind": "sentence", "count": len(texts), "seed": 11},
        "seconds_per_measurement": seconds,
        "int8_default": manifest.get("int8_default"),
        "variants": [bench_variant(model_dir, v, texts, seconds) for v in VARIANTS],
    }


def bench(args: argparse.Namespace) -> int:
    result = measure(args.seconds)
    rows = result["variants"]
    header = f"{'variant':13s} {'MB':>6s} {'load s':>7s} {'p50 ms':>7s} " + " ".join(
        f"{'bs' + str(b):>7s}" for b in BATCH_SIZES
    )
    print(header)
    for r in rows:
        tput = " ".join(f"{r['items_per_s'][str(b)]:7.0f}" for b in BATCH_SIZES)
        print(
            f"{r['variant']:13s} {r['size_mb']:6.1f} {r['load_s']:7.2f} "
            f"{r['latency_ms_batch1']['p50']:7.2f} {tput}"
        )
    print("items/s by batch size; quality from the build manifest:")
    for r in rows:
        print(f"  {r['variant']:13s} {r['quality']}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


# --8<-- [end:bench]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stage0_script",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("texts", nargs="*", help="texts to embed")
    parser.add_argument("--file", help="read one text per line from this file ('-' for stdin)")
    parser.add_argument("--summary", action="store_true", help="print a short summary, not the vectors")
    parser.add_argument("--raw", action="store_true", help="do not L2-normalize")
    parser.add_argument("--variant", default="int8", choices=["int8", *VARIANTS])
    parser.add_argument("--bench", action="store_true", help="benchmark fp32 and INT8, print a table")
    parser.add_argument("--seconds", type=float, default=2.0, help="--bench: seconds per measurement")
    parser.add_argument("--out", help="--bench: also write the figures to this JSON file")
    args = parser.parse_args(argv)
    return bench(args) if args.bench else embed(args)


if __name__ == "__main__":
    raise SystemExit(main())
