"""bench/bench_outages.py: its figures on a small fleet, and its spec's validation."""

from __future__ import annotations

import pytest

from bench.bench_outages import OutageSpec, run_outage


def test_an_outage_run_reports_phases_failures_and_the_restarted_engines_share() -> None:
    spec = OutageSpec(fleet=4, requests=300, down=1, down_at=0.3, up_at=0.6)
    r = run_outage(spec, "tool_use", "round_robin", 1.0)
    assert r["requests"] == 300 and r["restarted_share_before"] == pytest.approx(0.25, abs=0.01)
    assert set(r["attainment_by_phase"]) == {"before", "during", "after"}
    assert r["failed_with_engine"] > 0  # its requests in flight when it went down
    # round robin gives the engine back its turn once the gateway readmits it
    assert 0.15 < r["restarted_share_after"] <= 0.25
    assert r["down_s"][0] < r["down_s"][1] <= r["window_s"]


@pytest.mark.parametrize(
    "bad",
    [
        {"down": 0},
        {"fleet": 4, "down": 3},
        {"down_at": 0.6, "up_at": 0.3},
        {"requests": 10},
        {"kind": "mixed"},
    ],
)
def test_outage_specs_are_validated(bad: dict) -> None:
    with pytest.raises(ValueError):
        OutageSpec(**bad)
