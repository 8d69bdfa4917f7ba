"""The scheduler benchmark's plug-in options reach the kvgate engines' command line (and only
theirs)."""

from __future__ import annotations

import json

import pytest

from bench.bench_vllm_sched import engine_args, parse_kvgate_options


def test_kvgate_options_are_parsed_as_json_values_or_text() -> None:
    opts = parse_kvgate_options(["reject=true", "max_step_ms=200", "profile=vllm-cpu-small"])
    assert opts == {"reject": True, "max_step_ms": 200, "profile": "vllm-cpu-small"}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_kvgate_options(["reject"])


def test_kvgate_options_reach_only_the_kvgate_engines() -> None:
    args = engine_args("kvgate", 8000, "e0", "redis://r", "p:", {"reject": True})
    cfg = json.loads(args[args.index("--additional-config") + 1])["kvgate"]
    assert cfg["reject"] is True and cfg["engine_id"] == "e0"
    assert engine_args("fcfs", 8000, "e0", "redis://r", "p:", {"reject": True}) == []


def test_a_null_option_drops_the_benchmarks_own_setting() -> None:
    """``--kvgate-option broker=null`` runs the plug-in without reporting (the benchmark sets
    a broker otherwise): the key is left out, not passed as null, which the plug-in refuses."""
    opts = parse_kvgate_options(["broker=null", "reject=true"])
    args = engine_args("kvgate", 8000, "e0", "redis://r", "p:", opts)
    cfg = json.loads(args[args.index("--additional-config") + 1])["kvgate"]
    assert "broker" not in cfg and cfg["reject"] is True and cfg["engine_id"] == "e0"
    with_broker = engine_args("kvgate", 8000, "e0", "redis://r", "p:", {})
    assert json.loads(with_broker[-1])["kvgate"]["broker"] == "redis://r"


def test_small_llama_grows_with_its_layers() -> None:
    """``--layers``: the 4-layer model keeps its folder and size; another count gets its own
    folder (a model built once is reused by its path) and about 3.15M weights a layer more."""
    from pathlib import Path

    from bench.bench_vllm_sched import model_dir_for, small_llama_params

    assert small_llama_params(4) == 13_636_096  # the figure docs/BENCHMARKS.md gives (13.6M)
    assert small_llama_params(12) - small_llama_params(4) == 8 * 3_146_752
    assert model_dir_for(4) == Path("/tmp/kvgate-small-llama")
    assert model_dir_for(12) == Path("/tmp/kvgate-small-llama-12l")


def test_a_run_keeps_the_requests_that_missed_their_slo_worst_tpot_first() -> None:
    from bench.bench_vllm_sched import missed
    from bench.metrics import STATUS_OK, RequestRecord

    def rec(rid: str, ttft_s: float, tpot_s: float) -> RequestRecord:
        return RequestRecord(rid, "image", 0.0, 400, 50, 2000.0, 400.0, status=STATUS_OK,
                             ttft_s=ttft_s, tpot_s=tpot_s, completion_tokens=50)  # fmt: skip

    records = [rec("fine", 1.0, 0.2), rec("late", 3.0, 0.2), rec("slow", 1.0, 0.9),
               rec("slower", 1.0, 1.5)]  # fmt: skip
    out = missed(records)
    assert [m["id"] for m in out] == ["slower", "slow", "late"]
    assert out[0]["tpot_ms"] == 1500.0 and out[0]["tpot_slo_ms"] == 400.0
