"""How fast is a model variant? Measured so that a shared machine cannot fool the comparison.

The quantization study (``quant_study.py``) compares the build's files and its recipes by this:
each variant loaded with one ONNX Runtime thread, the variants taken in turns, round after round,
and the figure compared is texts per CPU-second of the calling thread, which a neighbour on the
machine does not change (wall-clock texts/s is kept beside it).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from common import corpus
from common.engine import Engine


def variants(model_dir: Path, names: list[str], rounds: int, batch: int = 16) -> dict[str, dict[str, float]]:
    """Load time and model throughput at batch 1 and ``batch``, one ONNX thread, variants interleaved.

    The machine is shared, so wall-clock time measures the neighbours too. With one intra-op
    thread ONNX Runtime computes on the calling thread, and that thread's CPU time is what the
    model itself costs: texts per CPU-second (median of rounds) is what the decision uses.
    Wall-clock texts/s (best of rounds) is kept beside it.
    """
    tokenizer = Engine(model_dir, "fp32").tokenize
    # 96 single texts: a call of one text takes a few milliseconds, and fewer let a round's figure
    # swing by a tenth from one run to the next.
    singles = [t.ids for t in tokenizer(corpus.texts(96, seed=12, kind="sentence"))]
    mixed = [[t.ids for t in tokenizer(corpus.texts(32, seed=13 + i, kind="mixed"))] for i in range(2)]
    batches = [call[j : j + batch] for call in mixed for j in range(0, len(call), batch)]
    big = f"b{batch}"
    calls = {"b1": [[ids] for ids in singles], big: batches}
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    for _ in range(rounds):
        for name in names:
            engine = Engine(model_dir, name, intra_threads=1)
            samples[name].setdefault("load", []).append(engine.load_seconds)
            engine.run(batches[0][:4])  # warm-up
            for key, batch_list in calls.items():
                texts = sum(len(b) for b in batch_list)
                cpu, wall = time.thread_time(), time.perf_counter()
                for call in batch_list:
                    engine.run(call)
                samples[name].setdefault(f"{key}_cpu", []).append(texts / (time.thread_time() - cpu))
                samples[name].setdefault(f"{key}_wall", []).append(texts / (time.perf_counter() - wall))
            del engine
    out: dict[str, dict[str, float]] = {}
    for name in names:
        got = samples[name]
        r = out[name] = {
            "load_s": statistics.median(got["load"]),
            "texts_per_cpu_s_b1": statistics.median(got["b1_cpu"]),
            f"texts_per_cpu_s_{big}": statistics.median(got[f"{big}_cpu"]),
            "texts_per_s_b1_wall_best": max(got["b1_wall"]),
            f"texts_per_s_{big}_wall_best": max(got[f"{big}_wall"]),
        }
        print(
            f"  {name:28s} load={r['load_s']:.2f}s  per CPU-second: b1={r['texts_per_cpu_s_b1']:.0f}"
            f"  {big}={r[f'texts_per_cpu_s_{big}']:.0f}  wall best: b1={r['texts_per_s_b1_wall_best']:.0f}"
            f"  {big}={r[f'texts_per_s_{big}_wall_best']:.0f}",
            flush=True,
        )
    return out
