"""The simulated world on tiny clusters with known answers, and as a router+engine harness."""

from __future__ import annotations

import random

import pytest

from bench.sim.policies import ALIASES, make_router, parse_policy
from bench.sim.runner import SimConfig, SweepSpec, build_world, engine_ids, run_one, sweep
from bench.sim.world import LinkConfig, Outage
from bench.workloads import WorkloadOptions
from bench.workloads.request import Request, Segment, Turn
from broker.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    Envelope,
    LoadHeartbeat,
    RequestEnqueued,
)
from kvgate.cost_model import default_profile
from kvgate.slo import Slo
from router.cluster_state import ClusterConfig

PROFILE = default_profile()
RELAXED = Slo(600_000.0, 10_000.0)


def _req(rid: str, arrival: float, n_bytes: int, out: int, seed: int = 1) -> Request:
    return Request(
        rid,
        arrival,
        (Turn("", (Segment(seed, n_bytes),)),),
        input_tokens=n_bytes // 4,
        output_tokens=out,
        slo=RELAXED,
    )


def _world(policy: str = "round_robin", engines: int = 1, **link: float):
    return build_world(policy, "slo", SimConfig(engines=engines, link=LinkConfig(**link)))


def test_one_engine_one_request_ttft_is_the_cost_models_prefill_time() -> None:
    world = _world(network_delay_s=0.0, link_delay_s=0.0)
    world.run([_req("a", 1.0, 4000, 1)])
    (rec,) = world.records
    assert rec.ok and rec.engine == engine_ids(1)[0]
    assert rec.ttft_s == pytest.approx(PROFILE.prefill_ms(1000, 0) / 1000, rel=1e-9)
    assert rec.tpot_s is None and rec.completion_tokens == 1 and rec.cached_tokens == 0


def test_network_delay_adds_to_ttft_and_decode_follows_the_cost_model() -> None:
    world = _world(network_delay_s=0.005)
    world.run([_req("a", 0.0, 4000, 5)])
    (rec,) = world.records
    prefill = PROFILE.prefill_ms(1000, 0) / 1000
    assert rec.ttft_s == pytest.approx(0.005 + prefill, rel=1e-9)
    # four decode steps of a batch of one, context growing from 1001 to 1004 tokens
    steps = [PROFILE.decode_step_ms(1, 1000 + g) / 1000 for g in range(1, 5)]
    assert rec.tpot_s == pytest.approx(sum(steps) / 4, rel=1e-9)
    assert rec.e2e_s == pytest.approx(rec.ttft_s + sum(steps), rel=1e-9)


def test_repeated_prompt_hits_the_cache_and_the_router_follows_it() -> None:
    """Two engines: the repeat goes where the prompt is cached (the router learnt it from the
    engine's BlockStored events over the link) and its prefill is the uncached tail only."""
    world = _world("e2", engines=2)
    world.run([_req("a", 0.0, 4000, 2), _req("b", 10.0, 4000, 2)])
    a, b = world.records
    assert a.ok and b.ok and a.engine == b.engine
    assert b.reason == "exploit" and b.matched_bytes >= 3968
    assert a.cached_tokens == 0 and b.cached_tokens == 992  # 62 full 64-byte blocks of 4000
    assert b.ttft_s < a.ttft_s
    assert b.ttft_s == pytest.approx(0.0005 + PROFILE.prefill_ms(8, 992) / 1000, rel=1e-9)


def _turns(gap: float) -> list[Request]:
    """A two-turn conversation: the second resends the first's answer (``reply``) and is due
    ``gap`` seconds after the first, long before that answer (200 tokens) can end."""
    system = Turn("system", (Segment(7, 2000),))
    first = Turn("user", (Segment(8, 400),))
    reply = Segment(9, 800)
    prompts = [
        (system, first),
        (system, first, Turn("assistant", (reply,)), Turn("user", (Segment(10, 200),))),
    ]
    reqs = [
        Request(f"t{k}", 1.0 + k * gap, turns, 1, 200, slo=RELAXED, endpoint="chat", session="s")
        for k, turns in enumerate(prompts)
    ]
    reqs = [r.with_(input_tokens=-(-r.key_len // 4)) for r in reqs]
    return [reqs[0].with_(reply=reply), reqs[1].with_(after="t0")]


def test_a_conversation_s_next_turn_waits_for_the_answer_it_resends() -> None:
    world = _world("e2", engines=2)
    world.run(_turns(gap=0.5))
    a, b = sorted(world.records, key=lambda r: r.request_id)
    assert a.ok and b.ok and a.engine == b.engine  # its history is cached there
    end = a.arrival + a.e2e_s
    assert a.e2e_s > 1.0  # 200 tokens: the answer takes seconds
    assert b.arrival == pytest.approx(end + 0.5)  # sent the workload's gap after the answer
    # its history is cached, the answer included (whole 64-byte blocks): only the tail is new
    t0 = _turns(0.5)[0]
    history = len(t0.key()) + len(t0.answer_key())
    assert b.cached_tokens == history // 64 * 16 > len(t0.key()) // 64 * 16
    # a long gap counts from the answer's end too (the user read it first)
    world = _world("e2", engines=2)
    world.run(_turns(gap=100.0))
    a, b = sorted(world.records, key=lambda r: r.request_id)
    assert a.ok and b.ok and b.arrival == pytest.approx(a.arrival + a.e2e_s + 100.0)
    assert b.cached_tokens == history // 64 * 16
    # a turn whose predecessor is not in the run is sent at its own arrival
    world = _world("e2", engines=2)
    world.run(_turns(gap=0.5)[1:])
    (only,) = world.records
    assert only.ok and only.arrival == 1.5
    # stopped before the first answer ends (drain bound): the second turn is recorded, unsent
    world = _world("e2", engines=2)
    world.run(_turns(gap=0.5), drain_s=0.1)
    a, b = sorted(world.records, key=lambda r: r.request_id)
    assert a.status == b.status == 504 and b.engine is None and "waiting" in (b.error or "")


class _Spy:
    """Records what reaches the real router (delegates everything to it)."""

    def __init__(self, router) -> None:
        self.router = router
        self.seen: list[tuple[float, Envelope]] = []

    def __getattr__(self, name: str):
        return getattr(self.router, name)

    def apply(self, env: Envelope, now: float) -> None:
        self.seen.append((now, env))
        self.router.apply(env, now)


def test_link_delivers_envelopes_in_order_per_engine_after_the_delay() -> None:
    world = _world("round_robin", engines=3, link_delay_s=0.01, link_jitter_s=0.02)
    spy = _Spy(world.router)
    world.router = spy
    reqs = [_req(f"r{i}", 0.05 * i, 2000 + 64 * i, 3, seed=i) for i in range(12)]
    world.run(reqs)
    assert all(r.ok for r in world.records)
    by_engine: dict[str, list[tuple[float, Envelope]]] = {}
    for now, env in spy.seen:
        by_engine.setdefault(env.engine_id, []).append((now, env))
        assert now >= env.ts + 0.01 - 1e-12
    assert len(by_engine) == 3
    for items in by_engine.values():
        assert [e.seq for _, e in items] == list(range(len(items)))
        assert len({e.epoch for _, e in items}) == 1
        assert [now for now, _ in items] == sorted(now for now, _ in items)
    kinds = {type(e.event) for _, e in spy.seen}
    assert {LoadHeartbeat, RequestEnqueued, BlockStored} <= kinds
    # round robin spreads 12 requests evenly
    assert sorted(world.per_engine().values()) == [4, 4, 4]


def test_runs_are_deterministic() -> None:
    reqs = [_req(f"r{i}", 0.01 * i, 4000, 20, seed=i % 3) for i in range(40)]
    a = run_one(reqs, "e2", "slo", SimConfig(engines=4))
    b = run_one(reqs, "e2", "slo", SimConfig(engines=4))
    assert a["summary"] == b["summary"]
    assert a["summary"]["requests"] == 40 and a["summary"]["ok"] == 40


def test_policy_specs_and_aliases() -> None:
    assert parse_policy("e2") == ("e2", {})
    assert parse_policy("e2[rebalance=false,rebalance_ratio=2.5]") == (
        "e2",
        {"rebalance": False, "rebalance_ratio": 2.5},
    )
    assert parse_policy("e2-no-m") == ("e2", {"eviction_term": False})
    for alias in ALIASES:
        make_router(alias, random.Random(0))  # every alias names real E2 config flags
    with pytest.raises(ValueError):
        make_router("nope", random.Random(0))
    with pytest.raises(ValueError):
        make_router("e2[not_a_flag=1]", random.Random(0))
    with pytest.raises(ValueError):
        parse_policy("e2[rebalance")


def test_sweep_runs_every_cell_on_a_small_workload() -> None:
    spec = SweepSpec(
        workload="programming",
        options=WorkloadOptions(rate=4, duration=15, seed=1),
        policies=("round_robin", "e2"),
        schedulers=("slo", "fcfs"),
        rate_scales=(1.0, 2.0),
        sim=SimConfig(engines=2),
    )
    doc = sweep(spec)
    assert doc["kind"] == "kvgate-sim" and len(doc["runs"]) == 8
    cells = {(r["policy"], r["scheduler"], r["rate_scale"]) for r in doc["runs"]}
    assert len(cells) == 8
    for r in doc["runs"]:
        assert r["summary"]["requests"] == doc["workload"]["shape"]["requests"]
        assert r["sim"]["route_calls"] == r["summary"]["requests"]
    rr = next(r for r in doc["runs"] if r["policy"] == "round_robin")
    assert rr["summary"]["load_spread_requests"]["max_over_mean"] <= 1.05


def test_ingress_delays_routing_by_body_size() -> None:
    """Two requests at the same instant: with an ingress cost per MB, the small one is routed
    first (as over HTTP), and both latencies still count from the arrival."""
    big, small = _req("big", 1.0, 400_000, 2, seed=1), _req("small", 1.0, 4_000, 2, seed=2)
    world = build_world(
        "round_robin",
        "slo",
        SimConfig(engines=2, link=LinkConfig(ingress_s=0.003, ingress_s_per_mb=0.027)),
    )
    world.run([big, small])
    by_id = {r.request_id: r for r in world.records}
    assert by_id["small"].engine == "e00" and by_id["big"].engine == "e01"
    assert by_id["small"].ttft_s == pytest.approx(
        0.003 + 0.004 * 0.027 + 0.0005 + PROFILE.prefill_ms(1000) / 1000, rel=1e-9
    )
    plain = _world("round_robin", engines=2)
    plain.run([big, small])
    assert [r.engine for r in plain.records] == ["e00", "e01"]  # trace order without ingress


@pytest.mark.parametrize("gateway_ttft", [True, False])
def test_engines_behind_the_bridge_are_fitted_from_the_gateways_ttfts(gateway_ttft: bool) -> None:
    """``request_events`` off, the engines report as a plain vLLM behind the bridge: KV events
    and heartbeats without prefill timings. The router then learns how fast an engine prefills
    only from the TTFTs the gateway sees (with ``fit_gateway_ttft``): the one twice as slow as
    its profile is found so."""
    link = LinkConfig(request_events=False, gateway_ttft=gateway_ttft)
    cluster_cfg = ClusterConfig(fit_gateway_ttft=True)
    world = build_world(
        "round_robin",
        "slo",
        SimConfig(engines=2, link=link, speeds=(1.0, 2.0), cluster=cluster_cfg),
    )
    spy = _Spy(world.router)
    world.router = spy
    # spaced out: each request finds its engine idle
    world.run([_req(f"r{i}", 2.0 * i, 8000, 4, seed=i) for i in range(8)])
    assert all(r.ok for r in world.records)
    kinds = {type(e.event) for _, e in spy.seen}
    assert kinds <= {LoadHeartbeat, BlockStored, BlockRemoved, AllCleared}
    assert BlockStored in kinds
    beats = [e.event for _, e in spy.seen if isinstance(e.event, LoadHeartbeat)]
    # no step timed; the profile's price of the prefill only in an interval of decode tokens
    assert all(b.prefill_ms is None for b in beats)
    assert all(b.prefill_plan_ms is None or b.decode_tokens for b in beats)
    cluster = spy.router.router.cluster  # (the spy, around the timing wrapper)
    # the decode step is the requests' mean inter-token latency (vLLM's metric), the TPOT the
    # router keeps: the slow engine's twice the other's
    tpots = [cluster.engines[e].tpot_ms for e in ("e00", "e01")]
    assert tpots[0] != 150.0 and tpots[1] / tpots[0] == pytest.approx(2.0, rel=0.2)
    fitted = cluster.engines["e01"].speed.prefill
    if gateway_ttft:
        assert fitted == pytest.approx(2.0, rel=0.1)
        assert cluster.engines["e00"].speed.prefill == pytest.approx(1.0, rel=0.1)
    else:
        assert fitted == 1.0  # nothing to learn from


def test_a_bridged_heartbeat_reads_the_tokens_decoded_in_its_interval() -> None:
    """Behind the bridge a heartbeat's decode step is the mean inter-token latency of the tokens
    decoded since the previous one, as vLLM's histogram counts them: a long answer decoding
    while short requests keep the engine prefilling shows in every heartbeat of its decode, not
    only in the one after it ends (counted at the request's end, a heartbeat read its batch a
    request's lifetime late, and this one's mixed intervals said nothing)."""
    link = LinkConfig(request_events=False, heartbeat_s=1.0)
    world = build_world("round_robin", "fcfs", SimConfig(engines=1, link=link))
    spy = _Spy(world.router)
    world.router = spy
    world.run(
        [_req("long", 0.0, 400, 1500)]  # ~1,500 tokens of decode: over ten seconds
        + [_req(f"s{i}", 0.05 + 0.25 * i, 4000, 1, seed=i + 2) for i in range(40)]
    )
    (long,) = [r for r in world.records if r.request_id == "long"]
    assert long.ok and long.e2e_s > 10.0
    beats = [
        (now, e.event)
        for now, e in spy.seen
        if isinstance(e.event, LoadHeartbeat) and 1.0 <= now < 10.0
    ]
    # prefill in every interval: none is pure decode, each still times the long answer's tokens,
    # with the tokens and the profile's time for the prefill that their steps held
    assert len(beats) >= 8 and all(b.decode_tokens and b.decode_batch for _, b in beats)
    assert all(b.prefill_plan_ms for _, b in beats)
    steps = [b.decode_step_ms for _, b in beats]
    assert all(s is not None for s in steps)
    assert min(steps) > PROFILE.decode_step_ms(1, 100)  # (prefill chunks stretch its steps)
    assert max(steps) < long.tpot_s * 1000 * 3


def test_a_flash_crowd_of_one_system_prompt_spreads_over_idle_engines() -> None:
    """Every request shares one 2,000-token system prompt (programming), 8 engines at light
    load: priced for its first request alone, a copy of the prompt on an idle engine came only
    once the holders' queues cost as much, so the first 48 requests met 3 engines and the tail
    waited behind their decode batches. With a hot prefix's request sent to a spare engine
    that copies it (``replicate_to_spare``), more engines serve from the start and the median
    TTFT drops (5 engines against 3, 93 ms against 101; against 108 before the fifty-eighth
    session chose among equal holders by what a decode does to their prefills, which spreads
    the holders' load without copies too). The p99 dropped too (0.41 s against 0.46; 0.37
    against 0.54 before the thirty-first session's credit for a routed prefix), until the
    forty-fourth session priced the KV memory a request holds, which spreads the tail without
    it as well (0.41 against 0.41; docs/router.md)."""
    from bench.workloads import build_workload

    opts = WorkloadOptions(rate=6.0, duration=40.0, seed=0, slo="scaled:5:100")
    reqs = build_workload("programming", opts)

    def run(policy: str) -> tuple[int, float, float]:
        records: list = []
        run_one(reqs, policy, "slo", SimConfig(engines=8, seed=0), records=records)
        records.sort(key=lambda r: r.arrival)
        ttfts = sorted(r.ttft_s for r in records if r.ttft_s is not None)
        p50, p99 = ttfts[len(ttfts) // 2], ttfts[int(0.99 * len(ttfts))]
        return len({r.engine for r in records[:48]}), p50, p99

    spread_on, p50_on, p99_on = run("e2")
    spread_off, p50_off, p99_off = run("e2[replicate_to_spare=false]")
    assert spread_on > spread_off
    assert p50_on < 0.95 * p50_off and p99_on <= p99_off


def test_late_engines_join_at_their_heartbeat_and_then_take_traffic() -> None:
    """A fleet scaled out while traffic runs (``SimConfig.joins``): the router does not know a
    late engine before its first heartbeat, so none of its requests go there, and after it
    joins the router uses it."""
    cfg = SimConfig(engines=4, joins=(0.0, 0.0, 5.0, 5.0))
    world = build_world("round_robin", "slo", cfg)
    # one distinct prompt every 0.1 s for 10 s
    world.run([_req(f"r{i}", 0.1 * i, 2000, 4, seed=i) for i in range(100)])
    late = {"e02", "e03"}
    before = [r for r in world.records if r.arrival < 4.9]
    after = [r for r in world.records if r.arrival >= 5.1]
    assert all(r.ok for r in world.records)
    assert before and not any(r.engine in late for r in before)
    assert sum(r.engine in late for r in after) >= len(after) // 2 - 1


def test_joins_are_validated() -> None:
    # not one per engine; nobody there at the start; a negative or non-finite time
    for joins in ((0.0, 1.0, 2.0), (1.0, 1.0), (0.0, -1.0), (0.0, float("nan"))):
        with pytest.raises(ValueError, match="joins"):
            SimConfig(engines=2, joins=joins)


def _outage_run(policy: str, outage: Outage, n: int = 240, engines: int = 4):
    """Distinct 2,000-byte prompts every 0.1 s, 40 output tokens, on ``engines`` engines."""
    cfg = SimConfig(engines=engines, outages=(outage,))
    world = build_world(policy, "slo", cfg)
    world.run([_req(f"r{i}", 0.1 * i, 2000, 40, seed=i) for i in range(n)])
    return world


def test_an_engine_that_goes_down_fails_what_it_serves_and_is_routed_around() -> None:
    """Its requests in flight fail (502: their streams break); what is sent to it while it is
    down is refused and retried elsewhere by the gateway, whose breaker then excludes it; its
    heartbeats stop. Every other request is served."""
    world = _outage_run("round_robin", Outage(1, 6.0))
    failed = [r for r in world.records if r.status == 502]
    assert failed and all(r.engine == "e01" and r.arrival < 6.0 for r in failed)
    assert all("went down" in (r.error or "") for r in failed)
    assert all(r.ok for r in world.records if r.status != 502)
    # broken streams and a failed health probe opened its breaker: nothing is sent there
    assert not any(r.engine == "e01" for r in world.records if r.arrival > 6.0)
    assert world.pool.engines["e01"].breaker.state == "open"
    assert world.slots[1].down and world.slots[1].core.busy_s > 0


def test_requests_sent_to_a_down_engine_are_retried_elsewhere() -> None:
    """Down with nothing in flight, an engine is found out by the requests sent to it: each is
    refused and retried on another engine (none is lost) until the breaker opens."""
    cfg = SimConfig(engines=4, outages=(Outage(1, 3.0),))
    world = build_world("round_robin", "slo", cfg)
    world.run([_req(f"r{i}", 1.0 * i, 400, 1, seed=i) for i in range(30)])
    assert all(r.ok for r in world.records)
    assert world.stats.extra["retried"] >= 1  # (with the health probes' failures, 3 open it)
    assert not any(r.engine == "e01" for r in world.records if r.arrival > 3.0)


def test_a_restarted_engine_comes_back_cold_and_takes_traffic_again() -> None:
    """Back after a long outage (its breaker's cooldown doubled by every probe it failed), a
    passed health probe readmits it within a probe interval and a trial (the gateway used to
    wait out the cooldown: here 14 s more); it runs a new process (a new epoch, an empty cache)
    and the router's tree forgot what the old one cached."""
    world = _outage_run("round_robin", Outage(1, 2.0, 20.0), n=300)
    slot = world.slots[1]
    assert slot.restarts == 1 and not slot.down and slot.epoch != world.slots[0].epoch
    back = sorted(r.arrival for r in world.records if r.engine == "e01" and r.arrival > 20.0)
    assert back and back[0] < 20.0 + world.health_interval_s + 0.5
    assert all(r.ok for r in world.records if r.arrival > 20.0)
    # its GPU time counts both processes; the router follows its new epoch
    assert slot.busy_s > slot.core.busy_s > 0
    assert world.router.router.cluster.engines["e01"].epoch == slot.epoch


def test_e2_routes_around_a_down_engine_without_losing_a_request_it_accepted() -> None:
    world = _outage_run("e2", Outage(2, 5.0, 15.0))
    assert all(r.ok for r in world.records if r.status != 502)
    assert all(r.arrival < 5.0 and r.engine == "e02" for r in world.records if r.status == 502)
    assert any(r.engine == "e02" for r in world.records if r.arrival > 15.0)


def test_outages_are_validated() -> None:
    with pytest.raises(ValueError, match="come back after"):
        Outage(0, 5.0, 5.0)
    with pytest.raises(ValueError, match="down time"):
        Outage(-1, 5.0)
    with pytest.raises(ValueError, match="outages"):
        SimConfig(engines=2, outages=(Outage(2, 1.0),))


def test_the_router_and_the_engines_learn_how_long_answers_under_a_cap_are() -> None:
    """Requests stating max_tokens 4096 whose answers end after 40 tokens: the router (from the
    engines' RequestFinished events) and every engine that finished one plan that cap at
    about 40 tokens by the end of the run; every answer keeps its length."""
    world = build_world("e2", "slo", SimConfig(engines=2))
    reqs = [_req(f"r{i}", 0.2 * i, 2000, 40, seed=i).with_(max_tokens=4096) for i in range(50)]
    world.run(reqs)
    assert all(r.ok and r.completion_tokens == 40 for r in world.records)
    assert world.router.router.cluster.output_fit.expected(4096) == 40
    assert all(s.core.output_fit.expected(4096) == 40 for s in world.slots)
    # behind the bridge (no request events) the router learns it from the gateway's reports
    bridged = build_world("e2", "fcfs", SimConfig(engines=2, link=LinkConfig(request_events=False)))
    bridged.run(reqs)
    assert bridged.router.router.cluster.output_fit.expected(4096) == 40


def test_bench_sim_reporting_flag_reaches_the_simulators_link() -> None:
    """``kvgate bench sim --reporting bridge``: the engines report as a plain vLLM behind the
    bridge does (no request events); by default as kvgate's engine does."""
    import argparse

    from bench.cli import _sim_config, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    bridged = _sim_config(parser.parse_args(["sim", "--reporting", "bridge"]))
    assert bridged.link.request_events is False
    assert _sim_config(parser.parse_args(["sim"])).link.request_events is True


GEN2 = "results/profiles/mistral-7b-a6000-24gb-b32.json"


def test_a_fleet_of_two_gpu_generations_runs_each_engines_own_profile() -> None:
    """``SimConfig.profiles``: engine 1 runs (and announces) a profile with a quarter of the
    KV memory in 32-token blocks. The router reads each engine's own block size, so a prompt
    served there again is credited in whole 32-token blocks, and the other engine in 16."""
    cfg = SimConfig(engines=2, profiles=("mistral-7b-a6000", GEN2))
    assert [p.block_tokens for p in cfg.engine_profiles()] == [16, 32]
    assert cfg.engine_profiles()[1].kv_blocks == 2037
    world = build_world("round_robin", "slo", cfg)
    # round robin: r0, r2 to e00; r1, r3 to e01; each pair the same 1,020-token prompt
    world.run(
        [
            _req("r0", 0.0, 4080, 2, seed=1),
            _req("r1", 0.1, 4080, 2, seed=2),
            _req("r2", 5.0, 4080, 2, seed=1),
            _req("r3", 5.1, 4080, 2, seed=2),
        ]
    )
    by_id = {r.request_id: r for r in world.records}
    assert [by_id[r].engine for r in ("r2", "r3")] == ["e00", "e01"]
    # the last token of a prompt is never served from cache: the whole blocks of 1,019 tokens
    assert by_id["r2"].cached_tokens == 63 * 16 and by_id["r3"].cached_tokens == 31 * 32
    # ... and the router credits the key bytes of those whole blocks, each engine's own
    assert (by_id["r2"].matched_bytes, by_id["r3"].matched_bytes) == (63 * 16 * 4, 31 * 32 * 4)
    cluster = world.router.router.cluster
    assert [cluster.engines[e].profile.block_tokens for e in ("e00", "e01")] == [16, 32]


def test_a_two_generation_fleet_needs_one_tokenizer_and_a_profile_each() -> None:
    with pytest.raises(ValueError, match="one profile per engine"):
        SimConfig(engines=3, profiles=("mistral-7b-a6000", GEN2))
    with pytest.raises(ValueError, match="bytes_per_token"):
        SimConfig(engines=2, profiles=("mistral-7b-a6000", "vllm-cpu-small"))
