"""``kvgate bench records``: per-request records summed up and compared (bench.records)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from bench.records import RecordsError, compare, load, outcome, summarize
from engine.scheduler.base import REFUSAL_CAUSES, refusal_cause
from kvgate.cli import main


def _rec(i: int, **kw: object) -> dict:
    base: dict = {
        "request_id": f"r{i}", "kind": "chat", "arrival": float(i), "input_tokens": 100 * (i + 1),
        "output_tokens": 10, "slo_ttft_ms": 500.0, "slo_tpot_ms": 100.0, "status": 200,
        "engine": f"e{i % 2}", "ttft_s": 0.1, "tpot_s": 0.05, "prompt_tokens": 100 * (i + 1),
        "cached_tokens": 0, "reason": "explore", "error": None,
    }  # fmt: skip
    base.update(kw)
    return base


ENGINE_REFUSALS = {
    "arrival_ttft": "TTFT SLO of 250 ms cannot be met: prefilling 4000 uncached prompt tokens "
    "alone takes about 300 ms on this engine",
    "arrival_tpot": "TPOT SLO of 50 ms cannot be met: one decode step of this request alone "
    "takes about 60.0 ms (x1.3 safety) on this engine",
    "queued": "TTFT SLO of 250 ms can no longer be met: queued 240 ms behind higher-priority "
    "requests, prefill needs about 30 ms",
    "decode_capacity": "TTFT SLO of 250 ms can no longer be met: queued 240 ms while waiting "
    "for decode capacity (TPOT guard), prefill needs about 30 ms",
    "kv_memory": "TTFT SLO of 250 ms can no longer be met: queued 240 ms while waiting for KV "
    "memory, prefill needs about 30 ms",
    "paused": "TTFT SLO of 250 ms can no longer be met: its prefill was paused for requests "
    "due sooner",
    "too_big": "request needs 900 KV blocks (14000 prompt + 400 output tokens) but this engine "
    "has 800 in all",
}


def test_every_engine_refusal_reads_back_as_its_cause() -> None:
    assert set(ENGINE_REFUSALS) == set(REFUSAL_CAUSES)
    for cause, message in ENGINE_REFUSALS.items():
        assert refusal_cause(message) == cause
    assert refusal_cause("upstream connection reset") == "other"


def test_outcome_of_each_way_a_request_ends() -> None:
    assert outcome(_rec(0)) == "met"
    assert outcome(_rec(0, ttft_s=0.6)) == "late_ttft"
    assert outcome(_rec(0, tpot_s=0.2)) == "late_tpot"
    assert outcome(_rec(0, status=429, reason="shed", error="no engine can meet the SLO")) == (
        "shed"
    )
    paused = _rec(0, status=429, ttft_s=None, error=ENGINE_REFUSALS["paused"])
    assert outcome(paused) == "refused:paused"
    assert outcome(_rec(0, status=0, ttft_s=None, error="connect")) == "failed"
    assert outcome(_rec(0, error="stream cut")) == "failed"


def test_summary_counts_outcomes_by_size_engine_and_time() -> None:
    recs = [
        _rec(0),
        _rec(1, ttft_s=0.9),
        _rec(2, status=429, ttft_s=None, error=ENGINE_REFUSALS["queued"]),
        _rec(3, cached_tokens=200),
    ]
    s = summarize(recs)
    assert s["requests"] == 4 and s["attainment"] == 0.5
    assert s["outcomes"] == {"met": 2, "late_ttft": 1, "refused:queued": 1}
    assert sum(g["requests"] for g in s["by_size"].values()) == 4
    assert sum(g["met"] for g in s["by_time"].values()) == 2
    # e1 served r1 (200 prompt tokens) and r3 (400, 200 of them cached); r2 was refused on e0
    assert s["by_engine"]["e1"]["hit_rate"] == pytest.approx(200 / 600, abs=1e-4)
    assert s["by_engine"]["e0"]["outcomes"] == {"met": 1, "refused:queued": 1}
    assert "by_kind" not in s  # (one kind)


def test_compare_names_what_each_run_met_alone() -> None:
    base = [_rec(0), _rec(1), _rec(2, ttft_s=0.9)]
    other = [
        _rec(0),
        _rec(1, status=429, ttft_s=None, error=ENGINE_REFUSALS["paused"]),
        _rec(2, cached_tokens=250),
    ]
    c = compare(base, other)
    assert c["common"] == 3
    assert c["met_only_by_base"]["requests"] == 1
    assert c["met_only_by_base"]["lost_as"] == {"refused:paused": 1}
    assert c["met_only_by_other"]["requests"] == 1
    assert c["met_only_by_other"]["lost_as"] == {"late_ttft": 1}
    assert c["met_only_by_other"]["cached_tokens_winner"] == 250
    with pytest.raises(RecordsError, match="no request_id"):
        compare(base, [_rec(9, request_id="x")])


def test_a_bad_line_is_named(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(orjson.dumps(_rec(0)).decode() + "\n{not json\n")
    with pytest.raises(RecordsError, match=r"bad.jsonl:2: not JSON"):
        load(f)
    f.write_text("[1, 2]\n")
    with pytest.raises(RecordsError, match="not a request record"):
        load(f)


def test_records_of_two_simulated_runs_from_the_command_line(tmp_path: Path, capsys) -> None:
    """A real overloaded run: every request's outcome is one the engine's messages name (an
    'other' would mean a refusal message the vocabulary no longer reads), the outcomes add up
    to the run's requests and attainment, and the second policy is compared with the first."""
    args = ["bench", "sim", "--trace", "tool_use", "--rate", "10", "--duration", "10",
            "--slo", "scaled:3:100", "--engines", "2", "--policies", "e2,round_robin",
            "--rate-scale", "4",
            "--records", str(tmp_path / "recs"), "--out", str(tmp_path / "sim.json")]  # fmt: skip
    assert main(args) == 0
    runs = orjson.loads((tmp_path / "sim.json").read_bytes())["runs"]
    files = [str(tmp_path / "recs" / f"{p}-slo-x4.jsonl") for p in ("e2", "round_robin")]
    capsys.readouterr()
    assert main(["bench", "records", *files, "--json", str(tmp_path / "why.json")]) == 0
    text = capsys.readouterr().out
    assert "round_robin-slo-x4.jsonl against e2-slo-x4.jsonl" in text
    doc = orjson.loads((tmp_path / "why.json").read_bytes())
    for run, path in zip(runs, files, strict=True):
        s = doc["runs"][path]
        assert s["requests"] == run["summary"]["requests"]
        assert s["attainment"] == pytest.approx(run["summary"]["slo_attainment"], abs=1e-4)
        assert sum(s["outcomes"].values()) == s["requests"]
        assert s["outcomes"].get("refused:other", 0) == 0
        assert any(k.startswith("refused:") for k in s["outcomes"])  # (overloaded: refusals)
    c = doc["comparisons"][files[1]]
    assert c["common"] == runs[0]["summary"]["requests"]


def test_unreadable_records_exit_with_a_message(tmp_path: Path, capsys) -> None:
    f = tmp_path / "x.jsonl"
    f.write_text("")
    assert main(["bench", "records", str(f)]) == 2
    assert "no records" in capsys.readouterr().err


def test_two_files_of_one_name_are_told_apart_by_their_folder(tmp_path: Path, capsys) -> None:
    for folder, ttft in (("before", 0.1), ("after", 0.9)):
        (tmp_path / folder).mkdir()
        line = orjson.dumps(_rec(0, ttft_s=ttft)).decode()
        (tmp_path / folder / "cell.jsonl").write_text(line + "\n")
    files = [str(tmp_path / d / "cell.jsonl") for d in ("before", "after")]
    assert main(["bench", "records", *files]) == 0
    out = capsys.readouterr().out
    assert "after/cell.jsonl against before/cell.jsonl" in out
    assert "met by before/cell.jsonl only: 1" in out
