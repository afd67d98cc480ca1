"""One typed settings object for every stage, read from the environment.

Every field below is an environment variable of the same name in upper case
(``MAX_BATCH_SIZE=16 make stage3``). The table in the docs chapter
"Operating it" is generated from this class, so the two cannot drift.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "all-MiniLM-L6-v2"


class Settings(BaseSettings):
    """Settings shared by the engine and every server stage."""

    model_config = SettingsConfigDict(env_prefix="", case_sensitive=False, extra="ignore")

    # --- model and engine -------------------------------------------------
    model_dir: Path = Field(DEFAULT_MODEL_DIR, description="Folder written by `make model`.")
    model_variant: Literal["int8", "int8-dynamic", "int8-static", "int8-rowwise", "fp32"] = Field(
        "int8", description="Which ONNX file to serve; `int8` is the mode the build chose."
    )
    onnx_intra_threads: int = Field(
        0,
        ge=0,
        description="ONNX Runtime intra-op threads per call (0: the cores shared out among the "
        "model calls that run at once: WORKER_THREADS in stage 2, BATCH_CONCURRENCY in 3-5, in each "
        "of the WORKERS).",
    )
    onnx_spinning: bool = Field(
        False,
        description="Let ONNX Runtime threads spin between calls. Off: an idle spinning thread keeps "
        "its core busy, CPU other processes need (stage 2's lab notes sweep it).",
    )

    # --- HTTP server ------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address `make stageN` binds to.")
    port: int = Field(8000, description="Port `make stageN` binds to.")
    workers: int = Field(
        1,
        ge=1,
        description="Server processes on HOST:PORT (uvicorn's workers), each with its own model, cache, "
        "queue and metrics; the cores are shared out among them (ONNX_INTRA_THREADS=0) and only the "
        "Redis tier (CACHE_URL) is common (measured in the Beyond one machine chapter).",
    )

    # --- request limits (the API contract) --------------------------------
    max_items: int = Field(64, ge=1, description="Most texts in one request.")
    max_chars: int = Field(20_000, ge=1, description="Longest text, in characters, before tokenizing.")
    max_body_bytes: int = Field(2_000_000, ge=1, description="Largest request body; larger gets 413.")
    body_timeout_s: float = Field(
        15.0, gt=0, description="Longest time a request body may take to arrive; slower gets 408."
    )
    model_aliases: str | None = Field(
        None,
        description="Comma-separated extra names `model` may take, such as a client's default "
        "(`text-embedding-3-small`); unset: those get a 404 naming the served model.",
    )

    # --- stage 2: thread pool ---------------------------------------------
    worker_threads: int = Field(
        2, ge=1, description="Threads that run the model at once (stage 2; its lab notes sweep the layouts)."
    )

    # --- stage 3: dynamic batching -----------------------------------------
    batcher: Literal["refined", "textbook"] = Field(
        "refined",
        description="`textbook`: the batcher of `stage3_batching/batcher.py` alone (one window, "
        "arrival order, one call a batch); `refined`: with the chapter's four refinements.",
    )
    max_batch_size: int = Field(32, ge=1, description="Most texts in one model call.")
    batch_concurrency: int = Field(
        2,
        ge=1,
        description="Batches in the model at once (stages 3-5); with ONNX_INTRA_THREADS=0 each "
        "gets the cores divided by this (the engine ceiling's calls side by side and stage 2's "
        "thread layouts measure one call against two).",
    )
    max_batch_tokens: int = Field(
        8192, ge=1, description="Most padded tokens (rows x longest row) in one model call."
    )
    batch_window_ms: float = Field(
        0.0,
        ge=0,
        description="How long a batch waits to fill up, counted from its oldest text (MEDIUM tier; "
        "a LOW-tier batch never waits; 0: no wait, a busy model slot fills the next batch; "
        "stage 3's lab notes measure windows by load).",
    )
    batch_window_high_ms: float = Field(
        0.0,
        ge=0,
        description="The same wait for a HIGH-tier batch (BATCH_HIGH_THRESHOLD texts queued or more).",
    )
    batch_low_threshold: int = Field(
        3, ge=1, description="Below this many queued texts a batch goes at once (LOW tier)."
    )
    batch_high_threshold: int = Field(
        10, ge=1, description="From this many queued texts on the tier is HIGH."
    )
    batch_tier_rule: Literal["depth", "rate"] = Field(
        "depth",
        description="What picks a batch's load tier: `depth`, the texts queued now (the two thresholds "
        "above); `rate`, the texts served over the last second (BATCH_RATE_LOW, BATCH_RATE_HIGH). The "
        "stage 3 chapter measures both.",
    )
    batch_rate_low: float = Field(
        100.0, gt=0, description="BATCH_TIER_RULE=rate: below this many texts served a second, LOW."
    )
    batch_rate_high: float = Field(
        200.0, gt=0, description="BATCH_TIER_RULE=rate: from this many texts served a second on, HIGH."
    )
    group_by_length: bool = Field(True, description="Pick texts of similar length for one batch.")
    group_window: int = Field(
        96,
        ge=1,
        description="How many queued texts length grouping sorts at once; no text is overtaken by "
        "more than this many minus one later ones.",
    )
    split_by_length: bool = Field(
        True,
        description="Run a batch as several model calls of similar lengths when that saves more "
        "padding than the calls cost; a request's texts in one batch stay in one call.",
    )
    call_overhead_tokens: int = Field(
        32, ge=0, description="Cost of one more model call, in padded tokens (for SPLIT_BY_LENGTH)."
    )

    # --- stage 4: cache, queue, deadlines, drain ----------------------------
    cache_url: SecretStr | None = Field(
        None, description="redis:// or rediss:// URL of a shared cache; unset: in-process only."
    )
    cache_enabled: bool = Field(True, description="Use the cache tiers; false turns every tier off.")
    cache_max_items: int = Field(100_000, ge=0, description="In-process cache size, in entries.")
    cache_max_bytes: int = Field(256 * 2**20, ge=0, description="In-process cache size, in bytes.")
    cache_ttl_s: int = Field(3600, ge=1, description="Time to live of a cache entry.")
    cache_ca_file: Path | None = Field(
        None,
        description="CA certificate that signed the Redis server's, for a rediss:// CACHE_URL "
        "(unset: the system's CAs). A certificate that does not verify turns the Redis tier off.",
    )
    cache_client: Literal["pooled", "per-command"] = Field(
        "pooled",
        description="`per-command` is the stage 4 chapter's lesson, never for production: a new "
        "connection (TCP and TLS handshakes) for every Redis command, the bug it measures.",
    )
    cache_timeout_ms: float = Field(50.0, gt=0, description="Longest wait for Redis before failing open.")
    max_queue: int = Field(
        1024,
        ge=1,
        description="Most texts waiting for a model slot; a request past it gets OVERLOAD_STATUS "
        "(one larger than the bound still goes into an empty queue).",
    )
    overload_status: Literal[503, 429] = Field(503, description="Status code for a full queue.")
    shed_delay_ms: float = Field(
        50.0,
        ge=0,
        description="While the queue is full, how long a refused request waits for its 503: a client "
        "that sends again at once is slowed down, so refusals leave the cores to admitted work "
        "(the stage 4 chapter measures delays under a flood).",
    )
    request_timeout_s: float = Field(
        30.0, gt=0, description="Default deadline; `X-Request-Timeout` overrides it per request."
    )
    drain_delay_s: float = Field(
        0.0,
        ge=0,
        description="After SIGTERM, how long the server goes on serving with readiness 503 before it "
        "stops accepting; set it above your load balancer's probe interval times the failed probes it "
        "waits for (0: stop at once).",
    )
    drain_timeout_s: float = Field(
        20.0, gt=0, description="Longest wait for the requests in progress once the server stops accepting."
    )

    # --- stage 5: metrics, logs, access -----------------------------------
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    log_format: Literal["json", "text"] = Field("json", description="Request log format.")
    api_key: SecretStr | None = Field(
        None, description="Comma-separated bearer keys; when set, /v1/* requires one."
    )
    protect_metrics: bool = Field(
        True, description="With API_KEY set, /metrics and /dashboard require a key too."
    )

    @field_validator("overload_status", mode="before")
    @classmethod
    def _status_from_text(cls, value: object) -> object:
        """The environment gives text ("429"); a literal of numbers takes no text, so read it first."""
        return int(value) if isinstance(value, str) and value.strip().isdigit() else value


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The settings of this process (read once from the environment)."""
    return Settings()
