"""The soak, short: 60 seconds of stage 5 with Redis, judged by the same criteria as `make soak`.

It sends at 50% of capacity rather than 70%: on this shared 2-core machine a neighbour's job
has been seen to take a third of the server's capacity away for minutes, in the middle of a run
(docs/reliability.md). At 70% that overloads the server and the test fails on the neighbours;
at 50% a failure is the server's own.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.reliability import soak
from loadtests import evidence


def test_soak_60_seconds(tmp_path: Path) -> None:
    result = soak.run(60, tmp_path, interval_s=2.0, load_factor=0.5)
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    run = evidence.Run("tests.test_soak", [])
    saved = soak.payload(result, run.stamp())
    soak.write(saved, out)
    soak.plot(saved, png)
    verdict = result.verdict
    # On failure, say what the run looked like: a shared machine can change under a soak.
    context = (
        f"capacity {result.capacity_rps} req/s, target {result.target_rps}, load average "
        f"{result.load_average}, errors {result.error_kinds}, in flight per interval "
        f"{[iv.in_flight for iv in result.intervals]}, "
        f"p99 per interval {[iv.p99_ms for iv in result.intervals]}"
    )
    assert result.sent > 0 and result.answered == result.sent - result.errors
    assert verdict["no_errors"], context
    assert verdict["rate_kept"], f"{verdict} {context}"
    assert verdict["p99_stable"], f"{verdict} {context}"
    assert verdict["rss_growth_under_10pct"], f"{verdict} {context}"
    assert result.passed
    # Enough intervals to judge: warm-up plus three thirds.
    assert len(result.intervals) >= 25
    saved = json.loads(out.read_text())
    assert saved["verdict"]["passed"] and saved["stamp"]["machine"]["logical_cores"]
    assert soak.markdown(saved) == out.with_suffix(".md").read_text()
    assert png.stat().st_size > 10_000 and evidence.read_png_provenance(png) == evidence.provenance(
        saved["stamp"]
    )


def test_the_soak_table_in_the_docs_matches_its_json() -> None:
    results = Path(__file__).resolve().parent.parent / "docs" / "results"
    payload = json.loads((results / "soak.json").read_text())
    assert (results / "soak.md").read_text() == soak.markdown(payload), "rerun `make soak`"
    # The file is whatever `make soak` last recorded, pass or fail (the chapter discusses it);
    # the 60-second test above is the one that must pass.
    assert payload["verdict"]["passed"] == (
        payload["errors"] == 0
        and all(payload["verdict"][k] for k in ("p99_stable", "rss_growth_under_10pct", "rate_kept"))
    )
