"""Schema fuzzing: schemathesis against each stage's own ``/openapi.json``, over real sockets.

For every operation a stage documents, hypothesis generates schema-valid bodies (positive) and
schema-breaking ones (negative); schemathesis sends them and checks every answer: no 5xx; status,
content type, headers and body as documented; schema-breaking input refused with a 4xx.

One check is left out on purpose: ``positive_data_acceptance`` expects every schema-valid body
to be accepted, but some limits are checks the schema cannot carry (a text's tokens with
``truncate`` off, the body's bytes), so a schema-valid body can still get a 4xx. And one answer
is added to those that count as refusing schema-breaking input: 413, for a body over
MAX_BODY_BYTES (the size is checked first, and 413 is the documented answer).

``make test`` runs FUZZ_EXAMPLES (default 25) examples per operation and mode, ``make fuzz`` 500;
the test records what it sent (``observe``) for ``python -m benchmarks.reliability``.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

import httpx
import pytest
import schemathesis
from conftest import SERVER_STAGES, Server
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import APIOperation, GenerationMode
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import positive_data_acceptance

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))


def fuzz(url: str, examples: int) -> tuple[Counter[str], Counter[int], list[str]]:
    """Requests sent per "METHOD /path mode", the statuses answered, and every failed check
    (collected, not raised, so that one failure does not hide the rest)."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    rejection = schema.config.checks.negative_data_rejection
    rejection.expected_statuses = [*rejection.expected_statuses, "413"]
    sent: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    for result in schema.get_all_operations():
        if not isinstance(result, Ok):  # an operation its own schema does not describe validly
            failures.append(f"invalid schema: {result.err()}")
            continue
        operation = result.ok()
        parts = (
            operation.body,
            operation.query,
            operation.path_parameters,
            operation.headers,
            operation.cookies,
        )
        # A route without parameters or body has no negative input: nothing to break.
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if any(len(p) for p in parts) else [])
        for mode in modes:
            key = f"{operation.method.upper()} {operation.path} {mode.value}"
            try:
                _fuzz_operation(operation, mode, url, examples, key, sent, statuses)
            except Unsatisfiable:  # every generated case was filtered out: nothing was sent
                pass
            except Exception as exc:  # a failed check: keep it, fuzz the remaining operations
                failures.append(f"{key}: {exc}")
    return sent, statuses, failures


def _fuzz_operation(
    operation: APIOperation,
    mode: GenerationMode,
    url: str,
    examples: int,
    key: str,
    sent: Counter[str],
    statuses: Counter[int],
) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def run(case: schemathesis.Case) -> None:
        response = case.call_and_validate(
            base_url=url, excluded_checks=[positive_data_acceptance], timeout=60
        )
        sent[key] += 1
        statuses[response.status_code] += 1

    run()


@pytest.mark.parametrize("stage", SERVER_STAGES)
def test_schema_fuzz(stage: str, stage_server, observe: Callable[..., None]) -> None:  # type: ignore[no-untyped-def]
    server: Server = stage_server(stage)
    sent, statuses, failures = fuzz(server.url, EXAMPLES)
    observe(
        stage=stage,
        examples=EXAMPLES,
        requests=sum(sent.values()),
        statuses={str(k): v for k, v in sorted(statuses.items())},
        failures=len(failures),
    )
    assert not failures, "\n\n".join(failures)
    # It really exercised the embedding routes, with both kinds of input.
    for route in ("POST /v1/embed", "POST /v1/embeddings"):
        assert sent[f"{route} positive"] > 0
        assert sent[f"{route} negative"] > 0
    assert 200 in statuses and 422 in statuses
    assert not any(status >= 500 for status in statuses)
    assert httpx.get(server.url + "/health").status_code == 200
    assert "Traceback" not in server.log()
