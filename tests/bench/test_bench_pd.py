"""The simulator's prefill/decode disaggregation: roles, the KV's move, the comparison script."""

from __future__ import annotations

import json

import pytest

from bench import bench_pd
from bench.cli import parse_roles
from bench.sim.runner import SimConfig, build_world
from bench.workloads import WorkloadOptions, build_workload


def _reqs(n: int = 60):
    return build_workload("qwen_mix", WorkloadOptions(rate=2.0, duration=30.0, max_requests=n))


def test_disaggregated_world_serves_every_request_through_both_phases() -> None:
    reqs = _reqs()
    cfg = SimConfig(engines=4, roles=parse_roles("prefill:2,decode:2"), kv_link_gbps=10.0)
    world = build_world("e2", "slo", cfg)
    world.run(reqs)
    ok = [r for r in world.records if r.status == 200]
    assert {r.status for r in world.records} <= {200, 429}  # every one ended
    assert len(ok) >= 0.6 * len(reqs)
    assert world.stats.extra["disaggregated"] == world.stats.routed
    cores = {s.core.engine_id: s.core for s in world.slots}
    # prefill engines ran one-token requests, decode engines the generations
    assert cores["e00"].finished + cores["e01"].finished >= len(ok)
    assert cores["e02"].finished + cores["e03"].finished == len(ok)
    assert {r.engine for r in ok} <= {"e00", "e01"}
    # the first token waited for the KV: 128 KiB a token over 10 Gb/s is ~0.1 ms a token
    ms = world.transfers_ms
    assert len(ms) == world.stats.routed and min(ms) > 0
    assert all(r.ttft_s * 1000 > 0.1 * r.prompt_tokens for r in ok)
    assert world.router.router.cluster.kv.factor == pytest.approx(1.0, rel=0.05)
    assert world.router.router.cluster.inflight_count == 0


def test_colocated_world_is_unchanged_by_roles_support() -> None:
    reqs = _reqs(40)
    a = build_world("e2", "slo", SimConfig(engines=2))
    b = build_world("e2", "slo", SimConfig(engines=2, roles=("both", "both")))
    a.run(reqs)
    b.run(reqs)
    assert [(r.engine, r.ttft_s) for r in a.records] == [(r.engine, r.ttft_s) for r in b.records]
    assert "disaggregated" not in a.stats.extra


def test_roles_spec_and_config_are_checked() -> None:
    assert parse_roles("prefill:1,decode:2,both:1") == ("prefill", "decode", "decode", "both")
    with pytest.raises(Exception, match="ROLE:N"):
        parse_roles("prefil:2")
    with pytest.raises(ValueError, match="roles"):
        SimConfig(engines=3, roles=("prefill", "decode"))


def test_bench_pd_quick_writes_its_table(tmp_path) -> None:
    out = tmp_path / "pd.json"
    assert bench_pd.main(["--quick", "--engines", "4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    fleets = {r["fleet"] for r in data["rows"]}
    assert {"colocated", "pd 2:2", "pd 2:2 @10Gb/s"} <= fleets
    assert {r["workload"] for r in data["rows"]} == {"mooncake", "qwen_mix"}
    assert "| mooncake | colocated |" in data["table"]
