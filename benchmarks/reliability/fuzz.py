"""Schema fuzzing: schemathesis against a running server's own ``/openapi.json``.

For every operation the server documents, hypothesis generates schema-valid bodies
(positive) and schema-breaking ones (negative), sends them over a real socket and runs
schemathesis' checks on each answer: no 5xx, status, content type, headers and body as
documented, and schema-invalid input refused with a 4xx.

One check is left out on purpose: ``positive_data_acceptance`` expects every
schema-valid body to be accepted, but the limits that make some of them 422 (MAX_ITEMS,
MAX_CHARS, no empty strings) are runtime settings the schema does not carry. And one
answer is added to those that count as rejecting schema-breaking input: 413, for a body
over MAX_BODY_BYTES (a 500-example run generated a 2.4 MB string, over ``maxLength``
and over the body limit; the size is checked first, and 413 is the documented answer).

``make fuzz`` runs it through tests/test_fuzz_schema.py; ``make results ONLY=reliability`` counts it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import APIOperation, GenerationMode
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import positive_data_acceptance


@dataclass
class FuzzReport:
    url: str
    examples_per_operation: int
    requests: dict[str, int] = field(default_factory=dict)  # "POST /v1/embed positive" -> sent
    statuses: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())


def fuzz_server(url: str, examples: int = 25, headers: dict[str, str] | None = None) -> FuzzReport:
    """Fuzz every operation of the server at ``url``; failures are collected, not raised."""
    started = time.perf_counter()
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    rejection = schema.config.checks.negative_data_rejection
    rejection.expected_statuses = [*rejection.expected_statuses, "413"]
    report = FuzzReport(url, examples)
    for result in schema.get_all_operations():
        if not isinstance(result, Ok):  # an operation its own schema does not describe validly
            report.failures.append(f"invalid schema: {result.err()}")
            continue
        operation = result.ok()
        has_input = any(
            len(p)
            for p in (
                operation.body,
                operation.query,
                operation.path_parameters,
                operation.headers,
                operation.cookies,
            )
        )
        # A route without parameters or body has no negative input: nothing to break.
        modes = (
            (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_input else (GenerationMode.POSITIVE,)
        )
        for mode in modes:
            key = f"{operation.method.upper()} {operation.path} {mode.value}"
            try:
                _fuzz_operation(operation, mode, key, url, headers, report)
            except Unsatisfiable:  # every generated case was filtered out: nothing was sent
                del report.requests[key]
            except Exception as exc:  # a failed check: keep it, fuzz the remaining operations
                report.failures.append(f"{key}: {exc}")
    report.seconds = time.perf_counter() - started
    return report


def _fuzz_operation(
    operation: APIOperation,
    mode: GenerationMode,
    key: str,
    url: str,
    headers: dict[str, str] | None,
    report: FuzzReport,
) -> None:
    report.requests[key] = 0

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=report.examples_per_operation,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: schemathesis.Case) -> None:
        response = case.call_and_validate(
            base_url=url, headers=headers, excluded_checks=[positive_data_acceptance], timeout=60
        )
        report.requests[key] += 1
        report.statuses[response.status_code] = report.statuses.get(response.status_code, 0) + 1

    run()
