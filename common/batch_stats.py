"""What the batcher reports: one record per batch, and running totals for /v1/batcher/metrics.

Stage 3's batcher fills them in (``stage3_batching/batcher.py``); stage 4's admission check and
stage 5's metrics read them (``on_batch``), so they live here, beside the rest of what the stages share.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class BatchRecord:
    """One batch, for /v1/batcher/metrics and the ``on_batch`` observers (stage 5 hooks in here)."""

    size: int  # texts in the batch
    padded_tokens: int  # rows x longest row, summed over the calls: what the model computes
    real_tokens: int  # sum of row lengths: what was asked for
    tier: str  # the load tier, low | medium | high (refined.py); "" here: one window for every batch
    queue_ms: list[float]  # per text: enqueued -> its model slot starts the batch
    inference_ms: float  # the model slot's time on the batch (every call, the split and retries)
    error: str | None  # exception type name when the model raised
    calls: int = 1  # model calls the batch ran as (more with the refinements)
    started: float = 0.0  # perf_counter when its model slot started it
    slot: str = ""  # the model slot (executor thread) that ran it
    model_s: float = 0.0  # seconds that slot was busy with it


@dataclass(slots=True)
class BatcherStats:
    """Running totals, for /v1/batcher/metrics."""

    batches: int = 0
    texts: int = 0
    calls: int = 0
    padded_tokens: int = 0
    real_tokens: int = 0
    failed_batches: int = 0
    skipped_texts: int = 0  # cancelled or past their deadline, dropped before the model
    tiers: Counter[str] = field(default_factory=Counter)
    sizes: Counter[int] = field(default_factory=Counter)
    slot_busy_s: dict[str, float] = field(default_factory=dict)  # model slot -> seconds it computed

    def add(self, r: BatchRecord) -> None:
        self.batches, self.texts, self.calls = self.batches + 1, self.texts + r.size, self.calls + r.calls
        self.padded_tokens += r.padded_tokens
        self.real_tokens += r.real_tokens
        self.failed_batches += r.error is not None
        self.tiers[r.tier] += 1
        self.sizes[r.size] += 1
        self.slot_busy_s[r.slot] = self.slot_busy_s.get(r.slot, 0.0) + r.model_s

    @property
    def padding_ratio(self) -> float:
        """Share of the model's token slots spent on padding (0: none, 0.5: half the work wasted)."""
        return 1 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches, "texts": self.texts, "model_calls": self.calls,
            "average_batch_size": self.texts / self.batches if self.batches else 0.0,
            "batch_size_distribution": {str(k): v for k, v in sorted(self.sizes.items())},
            "tiers": {t: self.tiers[t] for t in ("low", "medium", "high")},
            "padded_tokens": self.padded_tokens, "real_tokens": self.real_tokens,
            "padding_ratio": round(self.padding_ratio, 4), "failed_batches": self.failed_batches,
            "skipped_texts": self.skipped_texts,
            "slot_busy_s": {slot: round(s, 3) for slot, s in sorted(self.slot_busy_s.items())},
        }  # fmt: skip
