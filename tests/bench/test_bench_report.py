"""Metrics summary and the Markdown/PNG report on a small hand-made result."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from bench.metrics import RequestRecord, spread, summarize, ttft_p99_all_ms
from bench.report import build_report, load_runs, runs_table


def _rec(i: int, *, ttft: float, engine: str, status: int = 200, cached: int = 0) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{i}",
        kind="chat" if i % 2 else "file",
        arrival=float(i),
        input_tokens=100,
        output_tokens=10,
        slo_ttft_ms=500.0,
        slo_tpot_ms=50.0,
        status=status,
        engine=engine,
        ttft_s=ttft if status == 200 else None,
        tpot_s=0.02 if status == 200 else None,
        e2e_s=ttft + 0.18 if status == 200 else 0.0,
        prompt_tokens=100,
        completion_tokens=10 if status == 200 else 0,
        cached_tokens=cached,
        reason="explore",
    )


def test_summarize_definitions() -> None:
    recs = [
        _rec(0, ttft=0.1, engine="a", cached=50),
        _rec(1, ttft=0.6, engine="a"),  # misses its TTFT SLO
        _rec(2, ttft=0.2, engine="b", cached=100),
        _rec(3, ttft=0.0, engine="b", status=429),
    ]
    s = summarize(recs, engines=["a", "b", "c"])
    assert s["requests"] == 4 and s["ok"] == 3
    assert s["status"] == {"200": 3, "429": 1}
    assert s["slo_attainment"] == 0.5
    assert s["goodput_rps"] == pytest.approx(2 / 3, abs=1e-4)
    assert s["prefix_hit_rate"] == pytest.approx(150 / 300)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["per_engine_requests"] == {"a": 2, "b": 2, "c": 0}
    assert s["load_spread_requests"]["max_over_mean"] == pytest.approx(2 / (4 / 3), abs=1e-3)
    assert s["by_kind"]["file"]["requests"] == 2
    assert summarize([]) == {"requests": 0}


def test_p99_of_all_requests_counts_a_refused_one_as_never_answered() -> None:
    """Served p99 drops refused requests; the p99 of all requests does not, so a policy cannot
    lower it by refusing its slowest: with 1 of 200 refused it is the slowest served TTFT's
    neighbourhood, with 3 of 200 (over 1%) it does not exist."""
    served = [_rec(i, ttft=0.001 * (i + 1), engine="a") for i in range(199)]
    one_refused = [*served, _rec(199, ttft=0.0, engine="a", status=429)]
    assert summarize(served)["ttft_p99_all_ms"] == pytest.approx(
        summarize(served)["ttft_ms"]["p99"], abs=1e-6
    )  # nothing refused: the same p99
    # 200 requests: position 197.01 of 0..199, between the 198th and 199th TTFT (198, 199 ms)
    assert ttft_p99_all_ms(one_refused) == pytest.approx(198.01, abs=1e-6)
    assert summarize(one_refused)["ttft_ms"]["p99"] < 198.01  # served p99: 197.02 ms
    three_refused = served[:197] + [_rec(i, ttft=0.0, engine="a", status=429) for i in range(3)]
    assert ttft_p99_all_ms(three_refused) is None
    assert summarize(three_refused)["ttft_ms"]["p99"] is not None
    assert ttft_p99_all_ms([]) is None


def test_spread() -> None:
    assert spread([5, 5, 5])["cv"] == 0.0
    assert spread([0, 0, 9])["max_over_mean"] == pytest.approx(3.0)
    assert spread([])["cv"] is None


def _result(path: Path) -> Path:
    runs = []
    for rate in (1.0, 2.0):
        for policy, base in (("e2", 0.1), ("round_robin", 0.3)):
            recs = [
                _rec(i, ttft=base * rate * (1 + i / 10), engine="ab"[i % 2], cached=i)
                for i in range(20)
            ]
            runs.append(
                {
                    "policy": policy,
                    "scheduler": "slo",
                    "rate_scale": rate,
                    "summary": summarize([r for r in recs], engines=["a", "b"]),
                    "sim": {"wall_s": 0.5},
                }
            )
    runs.append({**runs[0], "scheduler": "fcfs"})
    doc = {"kind": "kvgate-sim", "workload": {"name": "tiny"}, "runs": runs}
    path.write_bytes(orjson.dumps(doc))
    return path


def test_report_tables_and_plots(tmp_path: Path) -> None:
    src = _result(tmp_path / "sim.json")
    fid = tmp_path / "fid.json"
    fid.write_bytes(
        orjson.dumps(
            {
                "kind": "kvgate-fidelity",
                "label": "mooncake 10 min x4",
                "live": {"ttft_ms": {"p50": 100.0, "p99": 400.0}},
                "sim": {"ttft_ms": {"p50": 104.0, "p99": 460.0}},
                "error": {"ttft_p50": 0.04, "ttft_p99": 0.15},
                "tolerance": 0.1,
            }
        )
    )
    (tmp_path / "junk.json").write_bytes(b'{"kind": "other"}')
    out, images = build_report([src, fid, tmp_path / "junk.json"], tmp_path / "rep" / "report.md")
    text = out.read_text()
    assert "| e2 | slo | 1 |" in text.replace("tiny | ", "")
    assert "round_robin" in text and "fcfs" in text
    assert "+4.0%" in text and "+15.0%" in text and "NO" in text
    names = sorted(p.name for p in images)
    assert names == [
        "report_tiny_policies_hit_spread.png",
        "report_tiny_policies_slo_ttft.png",
        "report_tiny_schedulers_slo_ttft.png",
    ]
    for p in images:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
        assert f"]({p.name})" in text
    runs, fids = load_runs([src])
    assert len(runs) == 5 and not fids
    table = runs_table(runs)
    assert table.count("\n") == 6  # header, rule, five rows


def test_report_without_plots(tmp_path: Path) -> None:
    src = _result(tmp_path / "sim.json")
    out, images = build_report([src], tmp_path / "r.md", plots=False)
    assert images == [] and "![" not in out.read_text()
