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
