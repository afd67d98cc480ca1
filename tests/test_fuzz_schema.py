"""schemathesis against each stage's own OpenAPI schema, over real sockets (``loadtests/fuzz.py``).

``make test`` runs FUZZ_EXAMPLES (default 25) examples per operation and mode; ``make fuzz``
runs many more.
"""

from __future__ import annotations

import os

import httpx
import pytest
from conftest import SERVER_STAGES, Server

from benchmarks.reliability.fuzz import fuzz_server

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))


@pytest.mark.parametrize("stage", SERVER_STAGES)
def test_schema_fuzz(stage: str, stage_server) -> None:  # type: ignore[no-untyped-def]
    server: Server = stage_server(stage)
    report = fuzz_server(server.url, EXAMPLES)
    assert not report.failures, "\n\n".join(report.failures)
    # It really exercised the embedding routes, with both kinds of input.
    for route in ("POST /v1/embed", "POST /v1/embeddings"):
        assert report.requests[f"{route} positive"] > 0
        assert report.requests[f"{route} negative"] > 0
    assert 200 in report.statuses and 422 in report.statuses
    assert not any(status >= 500 for status in report.statuses)
    assert httpx.get(server.url + "/health").status_code == 200
    assert "Traceback" not in server.log()
