"""The pure Router driven with events and virtual time: bookkeeping around the policies."""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import replace

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    Envelope,
    Event,
    FirstToken,
    LoadHeartbeat,
    RequestEnqueued,
    RequestFinished,
    RequestRejected,
    RequestStarted,
)
from engine_reporter.hashing import chain_hashes, split_blocks
from kvgate.slo import Slo
from router.api import RouteRequest
from router.cluster_state import ClusterConfig, _LoadOrder
from router.core import Router, RouterConfig
from router.policies.base import Move, RequestContext, prefill_cost_ms
from router.policies.feasibility import decode_step_ms, estimate
from router.speculative import _ExpiryQueue
from router.view import View

BLOCK = 64


class Fleet:
    """Engines publishing into one Router by hand, with per-engine sequence numbers."""

    def __init__(
        self, n: int = 3, policy: str = "e2", options: dict | None = None, **cluster
    ) -> None:
        config = RouterConfig(policy, options or {}, ClusterConfig(**cluster))
        self.router = Router(config, random.Random(0))
        self.seq: dict[str, int] = {}
        self.epoch: dict[str, str] = {}
        for i in range(n):
            self.send(f"e{i}", AllCleared(), 0.0)  # a reporting engine starts empty
            self.heartbeat(f"e{i}", 0.0)

    def send(self, engine: str, event: Event, now: float) -> None:
        seq = self.seq.get(engine, 0)
        self.seq[engine] = seq + 1
        env = Envelope(engine, self.epoch.setdefault(engine, "ep1"), seq, now, event)
        self.router.apply(env, now)

    def heartbeat(self, engine: str, now: float, **kw) -> None:
        fields = dict(
            waiting=0, running=0, queued_prefill_tokens=0, kv_blocks_used=0,
            kv_blocks_total=14_000, vbs=0.0, profile="mistral-7b-a6000",
            url=f"http://{engine}", models=("m",),
        )  # fmt: skip
        fields.update(kw)
        self.send(engine, LoadHeartbeat(**fields), now)

    def cache(self, engine: str, key: bytes, now: float) -> list[int]:
        blocks = list(split_blocks(key, BLOCK))
        hashes = chain_hashes(None, blocks)
        self.send(engine, BlockStored(None, tuple(hashes), tuple(blocks)), now)
        return hashes

    def route(self, rid: str, key: bytes, now: float, **kw):
        req = RouteRequest(
            rid, kw.pop("model", "m"), key, len(key) // 4, kw.pop("max_tokens", 50), **kw
        )
        return self.router.route(req, now)


PROMPT = bytes(range(256)) * 64  # 16 KiB


def test_decisions_follow_published_cache_contents() -> None:
    f = Fleet()
    hashes = f.cache("e1", PROMPT, 0.1)
    d = f.route("r1", PROMPT + b"question one", 1.0)
    assert (d.engine_id, d.reason, d.matched_bytes) == ("e1", "exploit", len(PROMPT))
    # the engine evicts the second half: a key sharing only the first quarter is no exploit
    f.send("e1", BlockRemoved(tuple(hashes[len(hashes) // 4 :])), 2.0)
    f.router.cluster.spec.clear_engine("e1")  # drop the router's own guess from r1
    m = f.router.cluster.match(PROMPT)[1]
    assert m == {"e1": len(PROMPT) // 4}


def test_burst_of_one_new_prefix_is_explored_once() -> None:
    """Ten requests of one new prefix within 10 ms: by default the burst stays with the engine
    prefilling the prefix (recomputing it elsewhere is work taken from others); with
    ``idle_free`` each idle engine takes one (an idle GPU's time delays nobody) and the rest
    join the holders: no engine prefills it twice either way."""
    key = b"new shared prefix " * 500
    for idle_free in (False, True):
        f = Fleet(n=4, options={"idle_free": idle_free}, speculative_ttl_s=5.0)
        decisions = [f.route(f"r{i}", key + str(i).encode(), 1.0 + i * 0.001) for i in range(10)]
        engines = [d.engine_id for d in decisions]
        assert decisions[0].reason in ("explore", "pd_balance")
        if idle_free:
            assert len(set(engines[:4])) == 4
            assert all(d.reason == "exploit" for d in decisions[4:])
        else:
            assert set(engines) == {engines[0]}
            assert all(d.reason == "exploit" for d in decisions[1:])
    # nobody confirms: the speculative entries expire
    f.router.cluster.expire(100.0)
    assert f.router.cluster.match(key)[1] == {}


def test_speculative_entry_settles_when_its_request_ends_on_a_reporting_engine() -> None:
    f = Fleet(n=2, speculative_ttl_s=10.0, speculative_grace_s=0.5)
    cl = f.router.cluster
    keys = {rid: rid.encode() * 2000 for rid in ("done", "open", "told")}
    engines = {rid: f.route(rid, key, 1.0).engine_id for rid, key in keys.items()}
    assert len(cl.spec) == 3
    f.send(engines["done"], RequestFinished("done", 10, 50.0, 20.0), 2.0)  # the engine's word
    f.router.report("told", engines["told"], "ok", 2.0)  # the gateway's word
    cl.expire(2.4)  # within the grace: the engine's KV events may still be on their way
    assert len(cl.spec) == 3
    cl.expire(2.6)
    assert len(cl.spec) == 1  # the open request keeps its entry for the whole TTL
    assert cl.match(keys["open"])[1] == {engines["open"]: len(keys["open"])}
    assert cl.match(keys["done"])[1] == {}
    cl.expire(11.5)
    assert len(cl.spec) == 0 and cl.spec.tree.total_bytes == 0 and cl.spec.tree.nodes == 1


def test_speculative_entry_of_an_engine_without_kv_events_outlives_its_request() -> None:
    # approximate mode for that engine: the entry is the only cache map there is
    f = Fleet(n=0, approximate_ttl_s=600.0, speculative_grace_s=0.5)
    f.heartbeat("plain", 0.0)  # heartbeats only, no KV events
    d = f.route("r", b"k" * 4000, 1.0)
    f.router.report("r", d.engine_id, "ok", 2.0)
    f.router.cluster.expire(100.0)
    assert f.router.cluster.match(b"k" * 4000)[1] == {"plain": 4000 - 4000 % BLOCK}


def test_slo_filter_lets_an_earlier_deadline_overtake_queued_prefill() -> None:
    """The engine's S-EDF serves earlier deadlines first: a queued long prefill due later is
    not in the way of an urgent request, but it is in the way of one due after it."""
    f = Fleet(n=1, options={"shed_factor": 1.0})  # shed as soon as the SLO cannot be met
    prof = f.router.cluster.engines["e0"].profile
    big = b"B" * 120_000
    big_ms = prof.prefill_ms(prof.tokens_for_bytes(len(big)))
    small = b"s" * 2_000
    small_ms = prof.prefill_ms(prof.tokens_for_bytes(len(small)))
    assert big_ms > 4 * small_ms and big_ms > 1000.0
    # the big request, due 100 ms after its own prefill: routed, queued, no first token yet
    first = f.route("big", big, 1.0, slo=Slo(big_ms + 100.0, 1000.0))
    assert first.engine_id == "e0"
    # urgent: due before the big one, needs only its own prefill -> feasible (the whole-queue
    # rule charged it big_ms and shed it)
    urgent = f.route("urgent", small, 1.0, slo=Slo(small_ms + 50.0, 1000.0))
    assert (urgent.engine_id, urgent.reason) == ("e0", "explore")
    # due 10 ms after the big one: both queued prefills are ahead of it -> shed
    late_ttft_ms = big_ms + 110.0
    assert 2 * small_ms > 110.0
    late = f.route("late", b"t" * 2_000, 1.0, slo=Slo(late_ttft_ms, 1000.0))
    assert late.reason == "shed"
    # once their prefills are done (first tokens), they are no longer ahead of anyone
    f.send("e0", FirstToken("big", big_ms), 1.5)
    f.send("e0", FirstToken("urgent", small_ms), 1.5)
    again = f.route("late2", b"u" * 2_000, 1.5, slo=Slo(late_ttft_ms, 1000.0))
    assert again.engine_id == "e0"


def test_slo_filter_charges_queued_work_it_cannot_attribute() -> None:
    """Work in the engine's reported queue that this router did not send (another gateway's
    requests) has no known deadline: it is all ahead."""
    f = Fleet(n=1)
    prof = f.router.cluster.engines["e0"].profile
    f.heartbeat("e0", 1.0, queued_prefill_tokens=30_000)
    foreign_ms = prof.prefill_ms(30_000)
    small = b"s" * 2_000
    small_ms = prof.prefill_ms(prof.tokens_for_bytes(len(small)))
    d = f.route("r", small, 1.0, slo=Slo(small_ms + foreign_ms / 2, 1000.0))
    assert d.reason == "shed"
    d = f.route("r2", small, 1.0, slo=Slo(small_ms + foreign_ms + 100.0, 1000.0))
    assert d.engine_id == "e0"


def test_inflight_released_by_finish_reject_report_and_timeout() -> None:
    f = Fleet(n=1, inflight_timeout_s=60.0)
    for rid in ("a", "b", "c", "d"):
        f.route(rid, b"x" * 100, 1.0)
    cl = f.router.cluster
    assert cl.engines["e0"].inflight == 4
    f.send("e0", FirstToken("a", 50.0), 1.5)
    f.send("e0", RequestFinished("a", 10, 50.0, 20.0), 2.0)
    f.send("e0", RequestRejected("b", "slo"), 2.0)
    assert f.router.report("c", "e0", "failed", 2.0)
    assert not f.router.report("c", "e0", "failed", 2.0)  # already released
    assert cl.engines["e0"].inflight == 1
    f.heartbeat("e0", 100.0)
    cl.expire(100.0)
    assert cl.engines["e0"].inflight == 0
    assert cl.released_by == {"event": 2, "report": 1, "timeout": 1}


def test_a_retried_requests_first_engine_cannot_release_it_on_the_next() -> None:
    """The gateway retries a request elsewhere under the same id, and its report of the
    engine that failed it is queued: when that report, or that engine's own late event, came
    after the retry was routed, it released the record on the new engine by id."""
    f = Fleet(n=2)
    cl = f.router.cluster
    first = f.route("r", b"k" * 100, 1.0).engine_id
    assert first is not None
    second = f.route("r", b"k" * 100, 1.1, exclude=frozenset({first})).engine_id
    assert second is not None and second != first
    assert (cl.engines[first].inflight, cl.engines[second].inflight) == (0, 1)
    assert not f.router.report("r", first, "failed", 1.2)  # the first engine's, late
    f.send(first, RequestRejected("r", "slo"), 1.2)
    f.send(first, FirstToken("r", 50.0), 1.2)
    f.send(first, RequestFinished("r", 10, 50.0, 20.0), 1.2)
    assert cl.engines[second].inflight == 1 and cl.inflight_engine("r") == second
    assert cl.stale_outcomes == 4
    assert f.router.state(1.3)["stale_outcomes"] == 4
    f.send(second, RequestFinished("r", 10, 50.0, 20.0), 1.4)  # its own engine's word counts
    assert cl.engines[second].inflight == 0 and cl.released_by["event"] == 1


def test_an_engine_announcing_a_profile_no_engine_has_cannot_fail_routing() -> None:
    """Finite but absurd figures in an inline profile (a block of 1e308 tokens, a decode step
    of 1e308 ms) passed as a profile and then overflowed every decision of the fleet."""
    from kvgate.cost_model import default_profile

    f = Fleet(n=2)
    for change in (
        {"decode": {"a": 0.0, "b": 0.08, "c": 0.0, "d": 1.7e308}},
        {"block_tokens": 1.7e308},
        {"decode": {"a": 0.0, "b": 5e-324, "c": 0.0, "d": 0.0}},  # (a plausible one)
    ):
        inline = orjson.dumps({**default_profile().to_dict(), **change, "name": "x"}).decode()
        f.heartbeat("e1", 1.0, profile=inline, kv_blocks_total=2**64 - 1)
        f.send("e1", FirstToken("z", 1.0, prefill_ms=5e-324, prefill_tokens=10**6), 1.0)
        for i in range(3):
            d = f.route(f"p{i}", bytes([i]) * 300, 1.0)
            assert d.engine_id in ("e0", "e1")
        f.router.state(1.0)
    assert f.router.cluster.unknown_profiles == 2


def test_tpot_median_feeds_the_load_term() -> None:
    f = Fleet(n=1)
    cl = f.router.cluster
    assert cl.engines["e0"].tpot_ms == 150.0  # seeded
    for i, tpot in enumerate((10.0, 30.0, 20.0)):
        f.route(f"r{i}", b"y" * 64, 1.0)
        f.send("e0", RequestFinished(f"r{i}", 5, 10.0, tpot), 1.0)
    assert cl.engines["e0"].tpot_ms == 20.0
    f.route("r9", b"z" * 64, 2.0)
    view = cl.engine_view(cl.engines["e0"])
    eng = cl.engines["e0"]
    assert view.window_ms == pytest.approx(eng.load_prefill_ms + eng.load_out_tokens * 20.0)
    # E2's default L: only r9 is open (its prefill, 50 output tokens x the measured 20 ms)
    assert view.load_ms == pytest.approx(eng.open_prefill_ms + 50 * 20.0)
    assert eng.open_prefill_ms > 0


def test_a_bridged_engine_s_tpot_is_its_heartbeats_over_a_window_in_time() -> None:
    """Behind the bridge (no request events) each heartbeat carries the mean inter-token latency
    of its interval. The engine's TPOT is their median over the last ``tpot_window_s``, not over
    a count of samples: at a 1-s poll 200 samples held 200 s, and a batch that had since grown
    was read at the TPOT of the smaller one."""
    f = Fleet(n=1, tpot_window_s=40.0)
    eng = f.router.cluster.engines["e0"]
    t = 1.0
    for _ in range(100):  # 100 s of a small batch, 50 ms a token
        f.heartbeat("e0", t, running=10, decode_step_ms=50.0)
        t += 1.0
    assert eng.tpot_ms == 50.0
    for _ in range(30):  # the batch grows: 100 ms a token, for 30 s (30 of 130 samples)
        f.heartbeat("e0", t, running=40, decode_step_ms=100.0)
        t += 1.0
    assert eng.tpot_ms == 100.0  # (the last 40 s: 30 of 41 samples at 100 ms)
    # at a faster poll the window is the same 40 s (200 samples of 0.2 s would be 40 s too)
    for _ in range(300):
        f.heartbeat("e0", t, running=10, decode_step_ms=50.0)
        t += 0.2
    assert eng.tpot_ms == 50.0 and len(eng.tpots) == 201


def test_outstanding_load_leaves_with_first_token_and_finish() -> None:
    f = Fleet(n=1)
    cl = f.router.cluster
    f.route("a", b"q" * 40_000, 1.0, max_tokens=100)
    eng = cl.engines["e0"]
    full = cl.engine_view(eng).load_ms
    assert full == pytest.approx(eng.open_prefill_ms + 100 * 150.0)
    f.send("e0", FirstToken("a", 900.0), 2.0)
    assert cl.engine_view(eng).load_ms == pytest.approx(100 * 150.0)  # prefill done
    f.send("e0", RequestFinished("a", 100, 900.0, 20.0), 5.0)
    view = cl.engine_view(eng)
    assert view.load_ms == 0.0  # nothing outstanding
    assert view.window_ms > 0.0  # the window still remembers it (rebalancing's L)


def test_an_engine_s_prefill_work_is_weighted_by_its_requests_slos() -> None:
    """What a decode there delays (``Estimate.decode_delay_ms``) is the engine's prefill work,
    each request's by its 1 / TTFT SLO: over the prefill rate, the work-weighted mean."""
    f = Fleet(n=1, policy="round_robin")
    cl = f.router.cluster
    f.route("short", b"s" * 4_000, 1.0, slo=Slo(ttft_ms=250.0, tpot_ms=100.0))
    f.route("long", b"l" * 40_000, 1.0, slo=Slo(ttft_ms=8_000.0, tpot_ms=100.0))
    view = cl.engine_view(cl.engines["e0"])
    p = cl.engines["e0"].profile
    short_ms, long_ms = p.prefill_ms(1_000), p.prefill_ms(10_000)
    assert view.prefill_rate == pytest.approx((short_ms + long_ms) / 10.0, rel=1e-6)
    mean_inv_slo = (short_ms / 250.0 + long_ms / 8_000.0) / (short_ms + long_ms)
    assert view.prefill_slo_rate / view.prefill_rate == pytest.approx(mean_inv_slo, rel=1e-6)


def test_the_window_counts_its_requests_through_moves_and_expiry() -> None:
    """Rebalancing asks whether an imbalance is more than chance by how many requests each
    engine's windowed load holds: a route adds one, a moved group takes its requests along,
    and they leave with the window."""
    f = Fleet(n=2, policy="round_robin")
    cl = f.router.cluster
    f.router.set_draining("e1", True)
    for i in range(3):
        f.route(f"a{i}", b"A" * 4096 + bytes([i]), 1.0 + i)
    f.route("b", b"B" * 4096, 5.0)
    f.router.set_draining("e1", False)
    e0, e1 = cl.engines["e0"], cl.engines["e1"]
    assert (cl.engine_view(e0).window_requests, cl.engine_view(e1).window_requests) == (4, 0)
    cl.apply_moves([Move(cl.group_of(b"A" * 4096 + b"\0"), "e0", "e1")], 6.0)
    assert (cl.engine_view(e0).window_requests, cl.engine_view(e1).window_requests) == (1, 3)
    cl.expire(2.5 + cl.config.window_s)  # a0 and a1 (routed at 1 and 2 s) leave the window
    assert (cl.engine_view(e0).window_requests, cl.engine_view(e1).window_requests) == (1, 1)


def test_the_fleet_s_windowed_load_is_its_engines_summed_through_moves_and_expiry() -> None:
    """E2's rebalancing compares the busiest engine with the fleet's mean windowed load, every
    output token priced at one TPOT: the sum of the engines' prefill work and output tokens in
    the window, which a move leaves as it is and the window's end takes away."""
    f = Fleet(n=2, policy="round_robin")
    cl = f.router.cluster

    def summed(clock_ms: float) -> float:
        return sum(
            e.window_ms + e.window_out_tokens * (clock_ms - e.tpot_ms)
            for e in (cl.engine_view(x) for x in cl.engines.values())
        )

    for i in range(4):
        f.route(f"a{i}", b"A" * 4096 + bytes([i]), 1.0 + i, max_tokens=10 + i)
    assert cl.window_load_ms(20.0) == pytest.approx(summed(20.0))
    assert cl.window_load_ms(20.0) - cl.window_load_ms(10.0) == pytest.approx(10 * 46)
    e0 = cl.engines["e0"]
    group = next(iter(e0.groups))
    before = cl.window_load_ms(20.0)
    cl.apply_moves([Move(group, "e0", "e1")], 6.0)
    assert cl.window_load_ms(20.0) == pytest.approx(before)
    cl.expire(2.5 + cl.config.window_s)  # a0 and a1 leave the window
    assert cl.window_load_ms(20.0) == pytest.approx(summed(20.0))
    assert cl.window_load_ms(20.0) - cl.window_load_ms(10.0) == pytest.approx(10 * 25)
    cl.expire(10.0 + cl.config.window_s)
    assert cl.window_load_ms(20.0) == pytest.approx(0.0, abs=1e-6)


def test_the_view_s_window_means_are_over_its_candidates_only() -> None:
    """E2's trigger compares the busiest candidate with the candidates' mean: with every engine
    a candidate, the cluster's running sums; with one draining (or another model's, or a
    decode-only one), a pass over the candidates, not the whole fleet's sums over fewer
    engines."""
    f = Fleet(n=3, policy="round_robin")
    cl = f.router.cluster
    for i in range(6):
        f.route(f"a{i}", b"A" * 4096 + bytes([i]), 1.0 + i, max_tokens=10)

    def view() -> View:
        req = RouteRequest("x", "m", b"x", 1, 1)
        return View(cl, cl.candidates(req, 8.0), {}, f.router.rng, model="m", now=8.0)

    every = view()
    assert len(every.engines) == 3
    load, requests = every.window_means(20.0)
    assert load == pytest.approx(cl.window_load_ms(20.0) / 3) and requests == 2.0
    f.router.set_draining("e2", True)
    two = view()
    assert [e.engine_id for e in two.engines] == ["e0", "e1"]
    load, requests = two.window_means(20.0)
    want = sum(e.window_ms + e.window_out_tokens * (20.0 - e.tpot_ms) for e in two.engines) / 2
    assert load == pytest.approx(want) and requests == 2.0  # not 6 requests over 2 engines


def test_prefills_routed_and_not_done_count_as_kv_about_to_be_written() -> None:
    """Until its prefill is done (first token) a routed request's uncached tokens are KV the
    engine will write but has not announced: the view says so (E2's tie-break counts it
    against the engine's room)."""
    f = Fleet(n=1)
    cl = f.router.cluster
    eng = cl.engines["e0"]
    prof = eng.profile
    assert cl.engine_view(eng).unannounced_bytes == 0
    f.route("a", b"q" * 40_000, 1.0)
    want = prof.prompt_tokens(10_000, 40_000) * prof.bytes_per_token
    assert cl.engine_view(eng).unannounced_bytes == want
    f.send("e0", FirstToken("a", 900.0), 2.0)
    assert cl.engine_view(eng).unannounced_bytes == 0


def test_a_profile_announced_inline_is_the_engine_s_and_an_unknown_one_is_counted(
    caplog,
) -> None:
    """An engine whose profile a router cannot load by name announces it inline: the router
    predicts with exactly that profile. A name it cannot load is counted and logged, and the
    default profile stands in."""
    from dataclasses import replace

    from kvgate.cost_model import announced_profile, load_profile

    custom = replace(load_profile("vllm-cpu-tiny"), name="fitted-here", kv_blocks=96)
    f = Fleet(n=2)
    cl = f.router.cluster
    f.heartbeat("e0", 0.0, profile=announced_profile(custom), kv_blocks_total=96)
    assert cl.engines["e0"].profile == custom
    assert cl.engine_view(cl.engines["e0"]).profile.block_tokens == 32
    with caplog.at_level("WARNING", logger="kvgate.router"):
        f.heartbeat("e1", 0.0, profile="fitted-elsewhere")
    assert cl.unknown_profiles == 1 and "fitted-elsewhere" in caplog.text
    assert cl.engines["e1"].profile.name == "mistral-7b-a6000"
    assert f.router.state(0.5)["unknown_profiles"] == 1


def test_capacity_is_read_in_the_key_bytes_the_engine_s_blocks_hold() -> None:
    """A profile's bytes a token guess the tokenizer; the blocks an engine announces say how
    many of the key's bytes one of its KV blocks holds (behind the vLLM bridge, text of 2.17
    bytes a token against the tiny profile's 2), and its capacity, free KV and the KV its
    routed prefills will write are read in those bytes. A new epoch starts over."""
    f = Fleet(n=1)
    cl = f.router.cluster
    eng = cl.engines["e0"]
    prof = eng.profile
    f.heartbeat("e0", 0.0, kv_blocks_total=1_000)
    assert cl.engine_view(eng).free_bytes == 1_000 * prof.block_bytes  # nothing announced yet
    wide = prof.block_bytes + prof.block_bytes // 4  # 1.25x the profile's bytes a block
    blocks = list(split_blocks(PROMPT, wide))
    f.send("e0", BlockStored(None, tuple(chain_hashes(None, blocks)), tuple(blocks)), 0.1)
    assert cl.engine_view(eng).free_bytes == 1_000 * wide - len(blocks) * wide
    f.route("a", b"q" * 4_000, 1.0)  # its prefill's tokens, in the engine's bytes a token
    want = prof.prompt_tokens(1_000, 4_000) * wide / prof.block_tokens
    assert cl.engine_view(eng).unannounced_bytes == int(want)
    # KV sized in tokens elsewhere (a decode engine's room for a request) uses that unit too
    assert cl.engine_view(eng).kv_key_bytes(100) == 100 * wide / prof.block_tokens
    f.epoch["e0"] = "ep2"  # restarted, maybe with another model: the profile's guess again
    f.heartbeat("e0", 2.0, kv_blocks_total=1_000)
    assert cl.engine_view(eng).free_bytes == 1_000 * prof.block_bytes


def test_cache_room_is_the_capacity_beside_the_prefixes_reused_there() -> None:
    """The room a prefix group can take on an engine without evicting a prefix reused there:
    the capacity less the longest key of each group with enough requests there in the window
    (a one-off key is not reused, so it does not count)."""
    f = Fleet(n=1)
    cl = f.router.cluster
    f.heartbeat("e0", 0.0, kv_blocks_total=1_000)
    doc = bytes(range(256)) * 16  # 4 KiB, 64 blocks
    f.cache("e0", doc, 0.1)
    for i in range(4):  # four requests of the document, each with a unique 640-byte tail
        f.route(f"d{i}", doc + bytes([i]) * 640, 1.0 + i)
    f.route("one-off", b"z" * 3000, 5.0)  # its own group, used once
    view = View(cl, cl.candidates(RouteRequest("x", "m", b"x", 1, 1), 5.0), {}, f.router.rng,
                model="m", now=5.0)  # fmt: skip
    capacity = 1_000 * cl.engines["e0"].profile.block_bytes
    key = len(doc) + 640
    assert view.cache_room("e0", 2) == capacity - key  # the reused document's longest key
    assert view.cache_room("e0", 1) == capacity - key - 3000  # ... and the one-off's
    assert view.cache_room("e0", 5) == capacity  # nothing reused five times


def test_e2_explore_follows_the_queue_not_window_history() -> None:
    """e0 served a lot in the last 3 minutes, all finished; e1 has one long request still
    queued. E2's cost (the request's predicted TTFT) sends new work to the idle e0, where
    Preble's windowed L would have chosen the busy e1."""
    picks = {}
    for mode in ("outstanding",):
        f = Fleet(n=2)
        cl = f.router.cluster
        f.router.set_draining("e1", True)
        for i in range(6):  # history on e0, finished at once
            f.router.route(
                RouteRequest(f"h{i}", "m", bytes([i]) * 8_000, 2_000, 200), 1.0 + i * 0.01
            )
            rid = f"h{i}"
            engine = cl._inflight[rid].engine_id
            f.send(engine, RequestFinished(rid, 200, 100.0, 20.0), 1.0 + i * 0.01)
        f.router.set_draining("e1", False)
        f.router.set_draining("e0", True)  # the long one must land on e1
        f.route("long", b"L" * 40_000, 2.0, max_tokens=100)
        f.router.set_draining("e0", False)
        picks[mode] = f.route("new", b"n" * 40_000, 3.0).engine_id
        assert cl.engines["e0"].window_ms() > cl.engines["e1"].window_ms()
    assert picks == {"outstanding": "e0"}


def test_full_prefix_cache_does_not_make_an_engine_tpot_infeasible() -> None:
    """KV blocks in use include idle cached prefixes: a full cache with one running request is
    no 224k-token decode context (which made e2 shed requests on idle engines)."""
    f = Fleet(n=1)
    f.heartbeat("e0", 1.0, running=1, vbs=1.0, kv_blocks_used=14_000)
    slo = Slo(ttft_ms=5_000.0, tpot_ms=100.0)
    f.route("a", b"a" * 40_000, 1.5, max_tokens=300, slo=slo)
    d = f.route("b", b"b" * 4_000, 2.0, max_tokens=60, slo=slo)
    assert (d.engine_id, d.reason) != (None, "shed")
    assert d.engine_id == "e0"


def test_new_epoch_and_all_cleared_forget_the_engine_cache() -> None:
    f = Fleet()
    f.cache("e1", PROMPT, 0.1)
    assert f.router.cluster.tree.match(PROMPT).per_engine == {"e1": len(PROMPT)}
    f.send("e1", AllCleared(), 0.2)
    assert f.router.cluster.tree.match(PROMPT).per_engine == {}
    f.cache("e1", PROMPT, 0.3)
    f.epoch["e1"] = "ep2"  # the engine restarted
    f.heartbeat("e1", 0.4)
    assert f.router.cluster.tree.match(PROMPT).per_engine == {}


def test_candidates_exclude_dead_draining_excluded_and_other_models() -> None:
    f = Fleet(n=3, heartbeat_ttl_s=10.0)
    f.heartbeat("e0", 5.0)
    f.heartbeat("e1", 5.0, models=("other",))
    f.heartbeat("e2", 0.0)
    f.router.add_static_engine("s0", "http://s0", ["m"])
    assert f.route("r1", b"k" * 10, 12.0).engine_id in {"e0", "s0"}  # e2 is dead, e1 wrong model
    f.router.set_draining("s0", True)
    assert {f.route(f"r{i}", b"k" * 10, 12.0).engine_id for i in range(5)} == {"e0"}
    d = f.route("r9", b"k" * 10, 12.0, exclude=frozenset({"e0"}))
    assert d.shed and "no live engine" in d.detail
    infos = {e.engine_id: e for e in f.router.engines(12.0)}
    assert not infos["e2"].alive and infos["s0"].static and infos["s0"].draining


def test_approximate_mode_learns_from_decisions_alone() -> None:
    r = Router(RouterConfig("e2", {}, ClusterConfig(approximate=True)), random.Random(1))
    for i in range(4):
        r.add_static_engine(f"s{i}", f"http://s{i}", ["m"])
    key = b"system prompt " * 300
    first = r.route(RouteRequest("a", "m", key + b"1", 1000, 10), 1.0)
    # long after a reporting engine's speculative TTL, the approximate entry still holds
    second = r.route(RouteRequest("b", "m", key + b"2", 1000, 10), 300.0)
    assert second.engine_id == first.engine_id and second.reason == "exploit"
    assert r.route(RouteRequest("c", "m", key + b"3", 1000, 10), 2000.0).reason != "exploit"


@pytest.mark.parametrize("follow_spare", [False, True])
def test_rebalance_moves_a_prefix_group_end_to_end(follow_spare: bool) -> None:
    f = Fleet(n=2, policy="e2")
    f.router.policy = type(f.router.policy)(
        type(f.router.policy.config)(
            rebalance=True, slo_filter=False, warmup_requests=5, follow_spare=follow_spare
        )
    )
    hot = [bytes([65 + g]) * 2048 for g in range(4)]
    for g, key in enumerate(hot):
        f.cache("e0", key, 0.1 + g)  # e0 caches every group
    f.router.set_draining("e1", True)  # every hot request lands on e0
    reasons = [f.route(f"r{i}", hot[i % 4] + b"?", 1.0 + i).reason for i in range(12)]
    f.router.set_draining("e1", False)
    for e in ("e0", "e1"):
        f.heartbeat(e, 19.0)
    # rebalancing needs e1 to have taken some of the window's work: route unrelated prompts
    f.router.set_draining("e0", True)
    for i in range(6):
        f.route(f"w{i}", bytes([i]) * 4000 + b"!", 20.0 + i)
    f.router.set_draining("e0", False)
    assert f.router.cluster.engines["e1"].routed_total == 6
    assert "rebalance" not in reasons
    decisions = [f.route(f"s{i}", hot[i % 4] + b"?", 30.0 + i) for i in range(8)]
    reasons = [d.reason for d in decisions]
    cluster = f.router.cluster
    assert cluster.moves >= 1
    if follow_spare:
        # e1 has nothing queued and room to spare: a moved group's requests go there, its one
        # prefill there an investment the group's later requests repay
        followed = [d for d in decisions if d.reason == "rebalance"]
        assert followed and all(d.engine_id == "e1" for d in followed)
        return
    # e1 holds none of the hot prefixes, so the cost keeps their requests on e0 (a move is
    # honoured only where the cost finds its target as good as the best)...
    assert "rebalance" not in reasons
    moved = [key for key in hot if cluster.group_of(key + b"?") in cluster._overrides]
    assert moved
    # ...until e1 is as good a place (here: it caches them too): the moved group goes there
    for g, key in enumerate(hot):
        f.cache("e1", key, 38.0 + g / 10)
    for e in ("e0", "e1"):
        f.heartbeat(e, 38.5)
    d = f.route("t", moved[0] + b"?", 39.0)
    assert (d.engine_id, d.reason) == ("e1", "rebalance")


def test_a_short_key_s_prefix_group_is_its_first_half() -> None:
    # a document and a unique question, shorter than group_bytes: the requests on one document
    # are one group (the whole key made each request its own, and rebalancing moved nothing)
    cl = Fleet().router.cluster
    doc = b"Document 3: " + b"market town road " * 30
    assert len(doc) < cl.config.group_bytes
    assert cl.group_of(doc + b"\nQuestion 1?") == cl.group_of(doc + b"\nQuestion 22: why?")
    assert cl.group_of(doc + b"?") != cl.group_of(b"Document 4: " + doc[12:] + b"?")
    # a long key: its first group_bytes, whatever follows
    long = b"s" * 4096
    assert cl.group_of(long + b"a") == cl.group_of(long + b"b" * 3000)


def test_state_is_json_ready_and_counts_decisions() -> None:
    import orjson

    f = Fleet()
    f.cache("e1", PROMPT, 0.1)
    f.route("r1", PROMPT, 1.0)
    st = f.router.state(2.0)
    orjson.dumps(st)
    assert st["tree"]["bytes"] >= len(PROMPT)
    assert st["hits"]["routed_matched_bytes"] == len(PROMPT)
    assert {"policy": "e2", "reason": "exploit", "count": 1} in st["decisions"]
    f.heartbeat("e2", 2.0, queue_order="arrival")
    orders = {e["engine_id"]: e["heartbeat"]["queue_order"] for e in f.router.state(2.0)["engines"]}
    assert orders == {"e0": "deadline", "e1": "deadline", "e2": "arrival"}


def test_replicating_a_moved_group_ends_its_override() -> None:
    # a group moved to e1 and later replicated (e1 -> e2): the override used to outlive the
    # replication and keep sending every request of the hot group to e1 alone
    fleet = Fleet(3, options={"rebalance": True})
    router = fleet.router
    key = b"p" * 4096
    group = router.cluster.group_of(key)
    router.cluster.apply_moves([Move(group, "e0", "e1")], 1.0)
    req = RouteRequest("r1", "m", key, 1024, 8)
    assert router.route(req, 1.0).reason == "rebalance"
    router.cluster.apply_moves([Move(group, "e1", "e2", "replicate")], 2.0)
    d = router.route(RouteRequest("r2", "m", key, 1024, 8), 2.0)
    # a replica (the cheaper: e1, where r1's prefill will have cached the key), not the override
    assert d.reason == "replicate" and d.engine_id in ("e1", "e2")
    assert group not in router.cluster._overrides


# ---------------------------------------------------------------- the cluster's ordered tables


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 7),  # engine (its seq)
            st.sampled_from([0.0, 1.0, 2.5, 2.5, 7.0, float("nan")]),  # equal loads are common
        ),
        max_size=60,
    )
)
def test_load_order_is_sorted_by_load_then_registration(updates: list[tuple[int, float]]) -> None:
    """Re-filing engines under new loads keeps the order of sorting every (load, seq) pair; a
    NaN load (which would order nowhere) is filed last, as infinity."""
    order = _LoadOrder()
    filed: dict[int, float] = {}
    for seq, load in updates:
        if seq in filed:
            order.remove(filed[seq], seq, f"e{seq}")
        order.insert(load, seq, f"e{seq}")
        filed[seq] = load
    expected = sorted((x if x == x else math.inf, s) for s, x in filed.items())
    assert list(zip(order.loads, order.seqs, strict=True)) == expected
    assert order.ids == [f"e{s}" for _, s in expected]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("push"), st.sampled_from([1.0, 10.0, 300.0]), st.floats(0, 3)),
            st.tuples(st.just("back"), st.sampled_from([1.0, 10.0]), st.floats(0, 5)),
            st.tuples(st.just("pop"), st.just(0.0), st.just(0.0)),
            st.tuples(st.just("due"), st.just(0.0), st.floats(0, 400)),
        ),
        max_size=80,
    )
)
def test_expiry_queue_pops_in_expiry_order(ops: list[tuple[str, float, float]]) -> None:
    """Against a heap: pushes with a few durations on a clock that mostly moves forward (and
    sometimes back), pops interleaved; every pop is the earliest record held (equal expiries:
    the lower handle), and ``pop_due(t)`` pops it only if it expires by ``t``."""
    queue = _ExpiryQueue()
    model: list[tuple[float, int]] = []
    now = 0.0
    for handle, (op, duration, dt) in enumerate(ops):
        if op == "pop":
            if model:
                assert queue.pop() == heapq.heappop(model)
            continue
        if op == "due":
            due = model[0] if model and model[0][0] <= dt else None
            assert queue.pop_due(dt) == due
            if due is not None:
                heapq.heappop(model)
            continue
        now = now + dt if op == "push" else now - dt  # "back": the clock went back
        queue.push(now + duration, handle, duration)
        heapq.heappush(model, (now + duration, handle))
        assert queue.first_expiry() == model[0][0]
    queue.keep(lambda expires, handle: handle % 2 == 0)
    assert len(queue) == sum(1 for _, h in model if h % 2 == 0)
    popped = [queue.pop()[0] for _ in range(len(queue))]
    assert popped == sorted(e for e, h in model if h % 2 == 0)
    assert queue.first_expiry() == math.inf


def test_groups_on_lists_movable_groups_heaviest_first() -> None:
    """A group moved away leaves history on every engine that served it: the view lists it
    only where it now goes, and never a group with fewer requests than asked for."""
    f = Fleet(n=3)
    cl = f.router.cluster
    keys = {g: bytes([70 + g]) * 3000 for g in range(3)}
    group = {g: cl.group_of(k) for g, k in keys.items()}
    n = 0
    for engine, gs in (("e0", (0, 0, 0, 1, 1, 2)), ("e1", (0, 0, 1))):
        for g in gs:
            req = RouteRequest(f"q{n}", "m", keys[g] + bytes([n]), 750, 50 * (g + 1))
            match, matched = cl.match(req.key)
            cl.record_route(req, engine, match, matched, group[g], 1.0)
            n += 1
    view = View(cl, cl.candidates(RouteRequest("x", "m", b"x", 1, 1), 1.0), {}, f.router.rng,
                model="m", now=1.0)  # fmt: skip
    listed = [(gl.group, gl.requests) for gl in view.groups_on("e0")]
    assert listed == [(group[1], 2), (group[0], 3), (group[2], 1)]  # by load: 2 x 100 tokens
    assert [gl.group for gl in view.groups_on("e0", 2)] == [group[1], group[0]]
    cl.apply_moves([Move(group[0], "e1", "e2")], 1.0)  # e1's share of group 0 goes to e2
    assert [gl.group for gl in view.groups_on("e0", 2)] == [group[1]]  # history: not listed
    assert [gl.group for gl in view.groups_on("e2")] == [group[0]]
    assert [gl.group for gl in view.groups_on("e1")] == [group[1]]
    # each group's longest key is the cache it takes; an engine's room is its capacity
    # (heartbeat blocks x block bytes) less the keys of the groups reused there (2 requests or
    # more), leaving out group 0, which now goes to e2
    assert {gl.group: gl.key_bytes for gl in view.groups_on("e0")}[group[1]] == 3001
    capacity = 14_000 * cl.engines["e0"].profile.block_bytes
    assert view.cache_room("e0", 2) == capacity - 3001  # group 1
    assert view.cache_room("e0", 1) == capacity - 2 * 3001  # groups 1 and 2
    assert view.cache_room("e2", 2) == capacity - 3001  # group 0, moved there
    assert view.cache_room("e1", 2) == capacity  # group 1 has one request there


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from([0, 1, 2]), min_size=1, max_size=8),  # requests routed per engine
    st.frozensets(st.sampled_from([f"e{i}" for i in range(8)]), max_size=3),
    st.booleans(),
)
def test_most_loaded_equals_a_sort_of_the_candidates(
    routed: list[int], exclude: frozenset[str], window: bool
) -> None:
    """The most loaded candidates, read from the end of the cluster's load order, are the
    first of the candidates sorted by load descending (equal loads: the last in engine order
    first), excluded engines left out."""
    f = Fleet(n=len(routed))
    cl = f.router.cluster
    n = 0
    for i, count in enumerate(routed):
        for _ in range(count):  # equal requests: many engines tie on load
            req = RouteRequest(f"q{n}", "m", b"k%d" % n, 100, 10)
            match, matched = cl.match(req.key)
            cl.record_route(req, f"e{i}", match, matched, cl.group_of(req.key), 1.0)
            n += 1
    req = RouteRequest("x", "m", b"x", 1, 1, exclude=exclude)
    engines = cl.candidates(req, 1.0)
    view = View(cl, engines, {}, f.router.rng, model="m", exclude=exclude, now=1.0)
    got = [e.engine_id for e in view.most_loaded(3, window=window)]
    load = (lambda e: e.window_ms) if window else (lambda e: e.load_ms)
    want = sorted(engines, key=lambda e: (-load(e), -e.position))[:3]
    assert got == [e.engine_id for e in want]


def test_a_decisions_candidates_read_late_equal_those_read_at_once() -> None:
    """Candidates are built when first read, from decision-time snapshots: reading them after
    many later decisions (which change every engine's load, the speculative entries and the
    policy's memo) gives exactly what reading them at once gives, for every reason."""

    def run(read_at_once: bool) -> tuple[list, list[str]]:
        f = Fleet(n=6)
        for i in range(6):
            f.cache(f"e{i}", PROMPT[: 1024 * (i + 1)], 0.1)
        decisions, early = [], []
        for n in range(120):
            tail = 64 * (n % 5 + 1) if n % 2 else 4096 + 512 * (n % 9)  # mostly cached or not
            key = PROMPT[: 512 * (n % 32 + 1)] + bytes([n % 7, n % 251]) * (tail // 2)
            d = f.route(f"r{n}", key, 1.0 + n * 0.01, max_tokens=20 + n % 40)
            decisions.append(d)
            if read_at_once:
                early.append(d.candidates)
        listed = early or [d.candidates for d in decisions]
        return listed, [d.reason for d in decisions]

    at_once, reasons = run(True)
    late, reasons_late = run(False)
    assert reasons == reasons_late
    assert {"exploit", "explore"} <= set(reasons)
    assert at_once == late
    assert all(at_once) and any(len(c) > 2 for c in at_once)
    assert any(c.load_ms > 0 and c.prefill_ms > 0 for cands in at_once for c in cands)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.sampled_from([10, 20])), max_size=30),
    st.integers(1, 3),
)
def test_groups_on_equals_a_sort_by_load_then_group(routed: list, min_requests: int) -> None:
    """Heaviest first, equal loads by group id (ties are common: equal requests), groups under
    ``min_requests`` left out; the first group (found by its own pass) and the rest agree."""
    f = Fleet(n=2)
    cl = f.router.cluster
    for n, (g, out_tokens) in enumerate(routed):
        req = RouteRequest(f"q{n}", "m", bytes([65 + g]) * 40, 10, out_tokens)
        match, matched = cl.match(req.key)
        cl.record_route(req, "e0", match, matched, g, 1.0)
    view = View(cl, cl.candidates(RouteRequest("x", "m", b"x", 1, 1), 1.0), {}, f.router.rng,
                model="m", now=1.0)  # fmt: skip
    listed = [(gl.group, gl.load_ms, gl.requests) for gl in view.groups_on("e0", min_requests)]
    eng = cl.engines["e0"]
    expected = sorted(
        (
            (g, w.prefill_ms + w.out_tokens * eng.tpot_ms, w.requests)
            for g, w in eng.groups.items()
            if w.requests >= min_requests
        ),
        key=lambda t: (-t[1], t[0]),
    )
    assert listed == expected


group_op = st.one_of(
    st.tuples(
        st.just("route"), st.integers(0, 5), st.sampled_from([10, 20, 30]), st.integers(0, 1)
    ),
    st.tuples(st.just("move"), st.integers(0, 6), st.integers(0, 1), st.integers(0, 1)),
    st.tuples(st.just("tpot"), st.sampled_from([5.0, 150.0, 400.0]), st.integers(0, 1), st.just(0)),
    st.tuples(st.just("wait"), st.sampled_from([0.5, 2.0]), st.just(0), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(group_op, max_size=40), st.integers(1, 3))
def test_heaviest_group_kept_through_routes_moves_tpot_and_expiry(ops: list, min_req: int) -> None:
    """The heaviest group the cluster keeps as work comes and goes (routes add to a group,
    moves take it away or merge it, a new TPOT reorders, the window drops old work) is the
    one a full sort finds, ``groups_on`` lists what the sort lists, and the window's request
    count is what its groups hold."""
    f = Fleet(n=2, window_s=3.0)
    cl = f.router.cluster
    now = 1.0
    for n, (op, a, b, c) in enumerate(ops):
        if op == "route":
            size = 40 if b == 30 else 20_000  # P ~24 or ~650 ms: a new TPOT can reorder
            req = RouteRequest(f"q{n}", "m", bytes([65 + a, n % 256]) * (size // 2), 10, b)
            match, matched = cl.match(req.key)
            cl.record_route(req, f"e{c}", match, matched, a, now)
        elif op == "move" and b != c:
            src = cl.engines[f"e{b}"]
            if a == 6 and src.groups:  # its heaviest
                a = max(
                    src.groups,
                    key=lambda g, e=src: (
                        e.groups[g].prefill_ms + e.groups[g].out_tokens * e.tpot_ms
                    ),
                )
            cl.apply_moves([Move(a, f"e{b}", f"e{c}")], now)
        elif op == "tpot":
            cl._record_tpot(cl.engines[f"e{b}"], a, now)
        elif op == "wait":
            now += a
            cl.expire(now)
        view = View(cl, cl.candidates(RouteRequest("x", "m", b"x", 1, 1), now), {},
                    f.router.rng, model="m", now=now)  # fmt: skip
        for engine_id in ("e0", "e1"):
            eng = cl.engines[engine_id]

            def load(w, eng=eng):
                return w.prefill_ms + w.out_tokens * eng.tpot_ms

            ranked = sorted(eng.groups.items(), key=lambda gw, load=load: (-load(gw[1]), gw[0]))
            top = cl.heaviest_group(eng)
            assert (top[0] if top else None) == (ranked[0][0] if ranked else None)
            expected = [
                g
                for g, w in ranked
                if w.requests >= min_req
                and (cl._overrides.get(g) is None or cl._overrides[g][0] == engine_id)
            ]
            assert [gl.group for gl in view.groups_on(engine_id, min_req)] == expected
            # the window's request count (rebalancing's significance test) is its groups'
            assert cl.engine_view(eng).window_requests == sum(
                w.requests for w in eng.groups.values()
            )


def test_heaviest_group_follows_a_new_tpot() -> None:
    """Load = prefill + output tokens x TPOT: a long prompt with a short answer outweighs a
    short prompt with a long answer only while TPOT is small, so a new TPOT can reorder."""
    f = Fleet(n=2)
    cl = f.router.cluster
    for n, (group, out, size) in enumerate([(0, 10, 20_000), (1, 30, 40)]):
        req = RouteRequest(f"q{n}", "m", bytes([65 + group, n]) * (size // 2), 10, out)
        match, matched = cl.match(req.key)
        cl.record_route(req, "e0", match, matched, group, 1.0)
    eng = cl.engines["e0"]
    assert cl.heaviest_group(eng)[0] == 1  # at the seeded 150 ms TPOT
    cl._record_tpot(eng, 5.0, 1.0)
    assert cl.heaviest_group(eng)[0] == 0


def test_candidates_show_every_engines_current_view_and_stay_a_snapshot() -> None:
    """The candidate list is patched from a kept one: each call shows every engine's state as
    it is now, and a list handed out earlier (a decision's snapshot) never changes."""
    f = Fleet(n=3)
    cl = f.router.cluster
    req = RouteRequest("x", "m", b"x", 1, 1)
    first = cl.candidates(req, 1.0)
    before = [(ev.engine_id, ev.inflight) for ev in first]
    d = f.route("r1", b"k" * 100, 1.0)
    now = cl.candidates(req, 1.0)
    assert {ev.engine_id: ev.inflight for ev in now}[d.engine_id] == 1
    assert [(ev.engine_id, ev.inflight) for ev in first] == before  # untouched
    f.heartbeat("e3", 1.0)  # a new engine joins: the eligible set changes
    assert [ev.engine_id for ev in cl.candidates(req, 1.0)] == ["e0", "e1", "e2", "e3"]
    f.router.report("r1", d.engine_id, "ok", 1.0)
    assert all(ev.inflight == 0 for ev in cl.candidates(req, 1.0))


def test_kv_memory_held_by_readers_of_one_cached_document_counts_it_once() -> None:
    """Requests decoding on an engine hold their contexts' KV memory, but a cached prefix they
    share is one set of blocks (the engine pins a cached block once for all its readers): the
    view counts each reader's own context and the shared prefix once, until its last reader
    there ends. (Counting every reader's whole context priced an engine holding a hot
    document as full: zipf_doc_qa on 16 engines of 3,500 blocks at twice the knee, 92.0 ->
    85.9% SLO attainment.)"""
    f = Fleet(n=1)
    cl = f.router.cluster
    eng = cl.engines["e0"]
    prof = eng.profile
    doc = bytes(range(256)) * 40  # 10 KiB: 160 whole blocks of 64 bytes
    f.cache("e0", doc, 0.5)
    readers = [f"r{i}" for i in range(3)]
    for i, rid in enumerate(readers):
        f.route(rid, doc + b"question %d" % i * 8, 1.0, max_tokens=100)
        f.send("e0", FirstToken(rid, 100.0), 1.5)
    view = cl.engine_view(eng)
    shared = prof.cached_tokens_for_bytes(len(doc))
    assert shared > 0
    recs = [cl._inflight[rid] for rid in readers]
    assert all(rec.cached_tokens == shared for rec in recs)
    assert view.decode_ctx_tokens == pytest.approx(sum(rec.ctx_tokens for rec in recs))
    own = sum(rec.ctx_tokens - shared for rec in recs)
    assert view.held_kv_tokens == pytest.approx(own + shared)
    f.send("e0", RequestFinished("r0", 100, 100.0, 20.0), 2.0)
    f.send("e0", RequestFinished("r1", 100, 100.0, 20.0), 2.0)
    assert cl.engine_view(eng).held_kv_tokens == pytest.approx(recs[2].ctx_tokens - shared + shared)
    f.send("e0", RequestFinished("r2", 100, 100.0, 20.0), 2.5)
    assert cl.engine_view(eng).held_kv_tokens == 0.0
    assert not eng.held_prefixes


def test_a_prefix_group_is_pinned_on_an_engine_while_a_request_of_it_is_in_flight_there() -> None:
    """The view says whether a request of a prefix group is in flight on an engine, queued or
    holding memory there (a queued one computes the prefix again before the requests queued
    after it start; one holding memory pins it), and stops saying so once the last one ends:
    the cost model credits a cached prefix on an engine short of memory only then."""
    f = Fleet(n=2)
    cl = f.router.cluster
    doc = bytes(range(256)) * 40
    f.cache("e0", doc, 0.5)
    f.route("r0", doc + b"question", 1.0, max_tokens=10)
    group = cl._inflight["r0"].group
    view, _ = _view(f, 1.0)
    e0, e1 = (cl.engine_view(cl.engines[e]) for e in ("e0", "e1"))
    assert cl._inflight["r0"].engine_id == "e0"
    assert view.pins(e0, group)  # queued there
    assert not view.pins(e1, group)
    assert not view.pins(e0, group + 1)
    f.send("e0", FirstToken("r0", 100.0), 1.5)
    view, _ = _view(f, 1.5)
    assert view.pins(e0, group)  # decoding: it holds the prefix
    f.send("e0", RequestFinished("r0", 10, 100.0, 20.0), 2.0)
    view, _ = _view(f, 2.0)
    assert not view.pins(e0, group)


def test_kv_memory_frees_as_its_holders_finish_and_the_requests_ahead_take_theirs_first() -> None:
    """What a request waits for KV memory behind: each reader of a cached document frees its
    own context when its output ends, the document's blocks only with its last reader (freed
    pro rata with each, a small engine looked to have room after one answer); a request queued
    due sooner starts first and takes its whole context, one due later does not (left out, a
    tool prompt's readers were sent behind a queue that took the memory, and refused: the
    `vllm-cpu-tiny` tool_use cells, docs/router.md)."""
    f = Fleet(n=1)
    cl = f.router.cluster
    eng = cl.engines["e0"]
    doc = bytes(range(256)) * 40
    f.cache("e0", doc, 0.5)
    f.send("e0", RequestFinished("warm", 11, 10.0, 40.0), 0.5)  # TPOT samples: 40 ms
    for i, out in enumerate((10, 100)):
        f.route(f"r{i}", doc + b"question %d" % i * 8, 1.0, max_tokens=out)
        f.send("e0", FirstToken(f"r{i}", 100.0), 1.0)
    f.route("later", b"l" * 4_000, 1.0, max_tokens=400, slo=Slo(60_000.0, 100.0))
    f.route("soon", b"s" * 4_000, 1.0, max_tokens=40, slo=Slo(2_000.0, 100.0))
    view, ev = _view(f, 1.0)
    releases = view.kv_releases(ev, 1.0, deadline=1.0 + 10.0)
    held = [(at, tokens) for at, tokens, now in releases if now]
    assert sum(t for _, t in held) == pytest.approx(ev.held_kv_tokens)
    tpot = eng.tpot_ms
    shared = cl._inflight["r0"].cached_tokens
    # the document frees with the reader whose output ends last, not the first
    assert (pytest.approx(100 * tpot), pytest.approx(shared)) in [
        (pytest.approx(at), pytest.approx(t)) for at, t in held
    ]
    assert min(at for at, _ in held) == pytest.approx(10 * tpot)
    ahead = [(at, tokens) for at, tokens, now in releases if not now]
    soon = cl._inflight["soon"]
    assert len(ahead) == 1  # the request due later starts after it
    assert ahead[0][1] == pytest.approx(soon.ctx_tokens + soon.out_tokens / 2 - soon.cached_tokens)
    assert ahead[0][0] > 40 * tpot  # its prefill, then its output
    assert releases == sorted(releases)
    # an engine serving in arrival order starts every request queued first, the first routed
    # first
    f.heartbeat("e0", 1.0, queue_order="arrival")
    view, ev = _view(f, 1.0)
    fifo = [(at, t) for at, t, now in view.kv_releases(ev, 1.0, deadline=1.0) if not now]
    assert len(fifo) == 2
    later = cl._inflight["later"]
    whole = later.ctx_tokens + later.out_tokens / 2 - later.cached_tokens
    first_prefill_ms = eng.open_prefill["later"][2] * 1000.0
    assert (pytest.approx(first_prefill_ms + 400 * tpot), pytest.approx(whole)) in fifo
    # an engine that sends no request events (plain vLLM behind the bridge) cannot tell a
    # started prefill from a queued one, and the held memory it reports has the started ones:
    # no reading (the wait reads its held memory alone)
    g = Fleet(n=1)
    g.route("queued", b"q" * 4_000, 1.0, max_tokens=40)
    view, ev = _view(g, 1.0)
    assert not g.router.cluster.engines["e0"].reports_requests
    assert view.kv_releases(ev, 1.0, deadline=100.0) is None


def test_kv_memory_is_held_from_a_prefills_start_and_read_against_the_engines_count() -> None:
    """The engine reserves a request's memory when its prefill starts (RequestStarted), so
    the router counts it from then, not from its first token (a long prompt, paused for
    requests due sooner, holds a small engine's memory for seconds), and once only; a request
    refused in its prefill gives it back. Each heartbeat's ``kv_blocks_held`` (what the
    engine's requests hold) corrects the router's count until the next one: outputs reserved
    whole, blocks shared across groups and other routers' requests are in the engine's."""
    f = Fleet(n=1)
    cl = f.router.cluster
    eng = cl.engines["e0"]
    block_tokens = eng.profile.block_tokens
    f.route("r0", PROMPT, 1.0, max_tokens=100)
    rec = cl._inflight["r0"]

    def held() -> float:
        return cl.engine_view(eng).held_kv_tokens

    assert held() == 0.0  # queued: nothing reserved yet
    f.send("e0", RequestStarted("r0"), 1.1)
    assert held() == pytest.approx(rec.ctx_tokens) and eng.kv_holders == 1
    f.send("e0", FirstToken("r0", 200.0), 1.3)
    assert held() == pytest.approx(rec.ctx_tokens) and eng.kv_holders == 1  # (once)
    f.heartbeat("e0", 1.4, kv_blocks_held=400)  # the engine holds more: its count wins
    assert held() == pytest.approx(400 * block_tokens)
    f.route("r1", b"another prompt " * 100, 1.5, max_tokens=20)
    f.send("e0", RequestStarted("r1"), 1.6)
    extra = cl._inflight["r1"].ctx_tokens
    assert held() == pytest.approx(400 * block_tokens + extra)  # ... plus what started since
    f.send("e0", RequestRejected("r1", "slo"), 1.7)  # refused in its prefill: given back
    assert held() == pytest.approx(400 * block_tokens) and eng.kv_holders == 1
    f.send("e0", RequestFinished("r0", 100, 200.0, 20.0), 2.0)
    assert eng.kv_holders == 0
    f.heartbeat("e0", 2.1, kv_blocks_held=0)
    assert held() == 0.0
    # an engine that does not report it (older, or a bridge that cannot tell): the router's own
    f.route("r2", PROMPT, 3.0, max_tokens=100)
    f.send("e0", RequestStarted("r2"), 3.1)
    f.heartbeat("e0", 3.2)
    assert held() == pytest.approx(cl._inflight["r2"].ctx_tokens)


def _view(f: Fleet, now: float, engine: str = "e0"):
    cl = f.router.cluster
    req = RouteRequest("probe", "m", b"x", 1, 1)
    engines = cl.candidates(req, now)
    view = View(cl, engines, {}, f.router.rng, model="m", now=now)
    return view, view.engine(engine)


def test_evicting_a_prefix_costs_at_most_what_recomputing_it_adds_once() -> None:
    """Preble's M prices each prefix the engine's LRU would evict by its hits in the window
    (over the engines holding it); the next request that wants it prefills it once, with its
    own part, and caches it again, so what its tokens add to that prefill, once, is the most
    losing it can cost. Priced per hit, a full engine's old copy of a popular document made it
    dearer than any other engine for minutes: on three vLLM engines one of them got 20 of 300
    requests (docs/router.md). Priced as a prefill of its own, every eviction carried a
    prefill's fixed cost that the next request pays anyway."""
    f = Fleet(n=2)
    doc = b"popular document " * 512  # 8.5 KiB
    f.cache("e0", doc, 0.5)
    for i in range(40):  # forty requests want it (wherever they are served)
        f.route(f"r{i}", doc + b"question %d" % i, 1.0 + i * 0.01)
    view, ev = _view(f, 2.0)
    prof = ev.profile
    tree = f.router.cluster.tree
    assert max(n.hit_count(2.0, tree.hit_tau_s) for n in tree.lru_nodes("e0")) > 10
    tokens = prof.cached_tokens_for_bytes(len(doc))
    recompute = prof.extra_prefill_ms(tokens, 0)
    evict = view.eviction_ms("e0", 1_024, 2.0)
    assert evict == pytest.approx(recompute, rel=1e-3)
    assert evict < prof.prefill_ms(tokens, 0) - 4.0  # not with the fixed cost of a prefill
    # held by both engines, each copy counts for half the hits: still once at most
    f.cache("e1", doc, 2.5)
    view, _ = _view(f, 3.0)
    assert view.eviction_ms("e0", 1_024, 3.0) == pytest.approx(recompute, rel=1e-3)


def test_router_fits_each_engines_speed_from_its_reports() -> None:
    f = Fleet(n=2)
    prof = f.router.cluster.engines["e0"].profile
    # e0's prefill batches take twice what the profile says; its decode steps half
    for i in range(5):
        f.send("e0", FirstToken(f"x{i}", 500.0, prof.prefill_ms(3000, 500) * 2, 3000, 500), 1.0)
    f.heartbeat("e0", 1.5, decode_step_ms=prof.decode_step_ms(8, 2000) / 2,
                decode_batch=8.0, decode_context=2000.0)  # fmt: skip
    _, ev = _view(f, 2.0)
    assert ev.prefill_scale == pytest.approx(2.0)
    assert ev.decode_scale == pytest.approx(0.5)
    # so a request costs twice its profile prefill there, and e1 (as announced) wins it
    key = b"q" * 8_000
    d = f.route("r", key, 2.0)
    assert d.engine_id == "e1"
    # switched off: the profile is trusted
    g = Fleet(n=1, fit_speed=False)
    g.send("e0", FirstToken("x", 500.0, 10_000.0, 3000, 0), 1.0)
    assert _view(g, 2.0)[1].prefill_scale == 1.0


def test_an_engine_that_refuses_for_its_speed_is_fitted_from_its_refusals() -> None:
    """An engine slower than it announced, too slow for a TPOT SLO, refuses each such request
    at once: it never serves one, so no first token or decode step shows its speed. Its
    refusal names the cause and its own time for one decode step of the request alone: the
    router fits the engine's decode speed from that, and sends such requests elsewhere (it
    kept sending them there, the engine looking idle)."""
    f = Fleet(n=2)
    cl = f.router.cluster
    prof = cl.engines["e0"].profile
    doc = b"document " * 1_000
    f.cache("e0", doc, 0.5)  # e0 holds the prefix: the requests' first choice
    step = prof.decode_step_ms(1, len(doc) // 4 + 25)
    slo = Slo(100_000.0, 1.5 * step * 1.3)  # met by one step as announced, not at twice it
    first = f.route("r0", doc + b"q0", 1.0, slo=slo)
    assert first.engine_id == "e0"
    context = 2_300
    # a refusal that says nothing of the engine's figures changes nothing
    f.send("e0", RequestRejected("r0", "busy"), 1.0)
    assert _view(f, 1.0)[1].decode_scale == 1.0
    assert f.route("r1", doc + b"q1", 1.1, slo=slo).engine_id == "e0"
    # the gateway's report of the 429 comes first (the router forgets the request then): the
    # event carries the tokens its figure is for
    assert f.router.report("r1", "e0", "failed", 1.1)
    refused_step = 2 * prof.decode_step_ms(1, context)
    f.send("e0", RequestRejected("r1", "too slow", "tpot", refused_step, context), 1.1)
    assert _view(f, 1.2)[1].decode_scale == pytest.approx(2.0)
    for i in range(2, 6):  # the holder is now known to be too slow for this SLO
        assert f.route(f"r{i}", doc + b"q%d" % i, 1.2, slo=slo).engine_id == "e1"
    # a prefill too slow for the TTFT SLO says the same of the prefill speed
    slow_prefill = 2 * prof.prefill_ms(3_000)
    f.send("e1", RequestRejected("r5", "too slow", "ttft", slow_prefill, 3_000), 1.3)
    assert _view(f, 1.4, "e1")[1].prefill_scale == pytest.approx(2.0)
    assert _view(f, 1.4, "e1")[1].decode_scale == 1.0
    # switched off: the profile is trusted
    g = Fleet(n=1, fit_speed=False)
    g.route("x", doc, 1.0, slo=slo)
    g.send("e0", RequestRejected("x", "slow", "tpot", 10 * step, 2_300), 1.0)
    assert _view(g, 1.1)[1].decode_scale == 1.0


def test_heartbeats_timing_prefill_work_fit_the_speed_before_any_first_token() -> None:
    """An engine that times its prefill work in heartbeats is fitted from them at once (a slow
    engine's first token can take seconds), and only from them: a first token's figures
    approximate a batch's cost, the heartbeat times the same work exactly."""
    f = Fleet(n=2)
    prof = f.router.cluster.engines["e0"].profile
    f.heartbeat("e0", 1.0, prefill_ms=400.0, prefill_plan_ms=200.0)
    _, ev = _view(f, 1.1)
    assert ev.prefill_scale == pytest.approx(2.0)
    assert f.route("r", b"q" * 8_000, 1.1).engine_id == "e1"  # e0 is twice as slow
    f.send("e0", FirstToken("x", 500.0, prof.prefill_ms(3000, 500) * 5, 3000, 500), 1.2)
    assert _view(f, 1.3)[1].prefill_scale == pytest.approx(2.0)
    # a few ms of work weighs little against what is known (timing noise on a real engine)
    f.heartbeat("e0", 2.0, prefill_ms=10.0, prefill_plan_ms=10.0)
    assert 1.8 < _view(f, 2.1)[1].prefill_scale < 2.0
    # an engine named after a profile this router does not know is costed on a default one:
    # its plan is on another profile, so it says nothing of the speed here
    f.heartbeat("e1", 2.0, profile="no-such-profile", prefill_ms=900.0, prefill_plan_ms=100.0)
    assert _view(f, 2.1, "e1")[1].prefill_scale == 1.0


def test_an_engine_without_prefill_reports_is_fitted_from_idle_ttfts() -> None:
    f = Fleet(n=1)
    prof = f.router.cluster.engines["e0"].profile
    key = b"i" * 40_000  # 10k tokens on an idle engine: its TTFT is its prefill time
    f.route("r", key, 1.0)
    f.send("e0", FirstToken("r", 3 * prof.prefill_ms(10_000)), 2.0)
    assert _view(f, 2.0)[1].prefill_scale == pytest.approx(3.0)


def test_queued_work_of_another_router_is_counted_in_the_engines_own_tokens() -> None:
    """The heartbeat's queue minus this router's requests enqueued there, as the engine
    counted them (its RequestEnqueued), is someone else's work; not the router's own count,
    which credits a prefix the engine has not cached yet."""
    f = Fleet(n=1)
    f.route("r", b"s" * 8_000, 1.0)  # 2000 tokens, none cached
    f.send("e0", RequestEnqueued("r", 8_000, 0, 2_000, 50), 1.01)
    f.heartbeat("e0", 1.02, queued_prefill_tokens=2_000 + 5_000)
    assert f.router.cluster.engines["e0"].foreign_prefill_tokens == 5_000
    view, ev = _view(f, 1.03)
    prof = ev.profile
    # a request due before r: only the foreign work is ahead of it
    assert view.prefill_ahead_ms(ev, 1.0) == pytest.approx(prof.prefill_ms(5_000))
    # once r's prefill is done, a heartbeat older than that still shows it: not foreign
    f.send("e0", FirstToken("r", 80.0), 1.1)
    f.heartbeat("e0", 1.2, queued_prefill_tokens=0)
    assert f.router.cluster.engines["e0"].foreign_prefill_tokens == 0


def test_queue_ahead_leaves_out_requests_that_can_no_longer_make_their_deadline() -> None:
    f = Fleet(n=1)
    prof = f.router.cluster.engines["e0"].profile
    big_ms = prof.prefill_ms(20_000)
    f.route("hopeless", b"h" * 80_000, 1.0, slo=Slo(big_ms / 2, 1000.0))  # cannot make it
    f.route("fine", b"f" * 8_000, 1.0, slo=Slo(5_000.0, 1000.0))
    view, ev = _view(f, 1.0)
    ahead, behind, _ = view.prefill_queue(ev, 1.0 + 10.0)
    assert ahead == pytest.approx(prof.prefill_ms(2_000))  # S-EDF runs "hopeless" last
    ahead, behind, _ = view.prefill_queue(ev, 1.0 + 1.0)  # due before "fine", after "hopeless"
    assert (ahead, behind) == (0.0, 1)


def test_work_ahead_that_cannot_start_in_time_behind_earlier_work_does_not_run() -> None:
    """Two queued requests that could each make their deadline alone, but not one after the
    other: the engine rejects the later-due one while it waits, so the soonest a third request
    can start counts only the first (the routing queue keeps both)."""
    f = Fleet(n=1)
    prof = f.router.cluster.engines["e0"].profile
    one_ms = prof.prefill_ms(5_000)
    slo = Slo(1.5 * one_ms, 1000.0)  # time for one 5,000-token prefill, not for two
    f.route("first", b"a" * 20_000, 1.0, slo=slo)
    f.route("second", b"b" * 20_000, 1.0001, slo=slo)
    view, ev = _view(f, 1.0002)
    ahead, behind, runs = view.prefill_queue(ev, 1.0 + 100.0)
    assert behind == 0
    assert ahead == pytest.approx(prof.prefill_ms(10_000))
    assert runs == pytest.approx(prof.prefill_ms(5_000))
    # at half the GPU (a decode batch running) not even the first can make it after nothing
    assert view.prefill_queue(ev, 1.0 + 100.0, share=0.5)[2] == pytest.approx(0.0)


def test_a_routed_prefix_counts_as_cached_behind_the_request_computing_it() -> None:
    """A conversation's next turn arrives while the last one still queues on its engine, with
    unrelated work due later queued there too. The next turn, due after the last one, starts
    after it (S-EDF) and finds its prompt cached: the routed prefix is credited. Due before it,
    the next turn overtakes it and prefills the prefix itself. A queued request that cannot
    make its deadline is rejected and computes nothing."""
    f = Fleet(n=1)
    prof = f.router.cluster.engines["e0"].profile
    history = bytes(range(256)) * 32  # 8 KiB: the last turn's prompt
    f.route("turn1", history + b"first question", 1.0, slo=Slo(60_000.0, 1000.0))
    f.route("bulk", b"z" * 40_000, 1.0, slo=Slo(120_000.0, 1000.0))  # unrelated, due later
    f.route("doomed", b"y" * 8_000 + b"?", 1.0, slo=Slo(1.0, 1000.0))  # cannot make it
    # routed on turn1's prompt as if cached, due before turn1: it waits for turn1 to compute
    # that prompt (the engine prefills a shared prefix once), so it computes none of it
    f.route("follower", history + b"first question, again", 1.0, slo=Slo(50_000.0, 1000.0))
    view, ev = _view(f, 1.001)
    turn2 = history + b"first question" + b" and its answer; a second question"
    whole = (len(history) + len(b"first question")) // prof.block_bytes * prof.block_bytes
    assert view.routed_ahead(ev, turn2, 1.0 + 90.0, 0) == whole  # due after turn1
    assert view.routed_ahead(ev, turn2, 1.0 + 55.0, 0) == 0  # before it, after the follower
    assert view.routed_ahead(ev, turn2, 1.0 + 30.0, 0) == 0  # due before both
    assert view.routed_ahead(ev, b"y" * 8_000 + b"!", 1.0 + 90.0, 0) == 0
    # the estimate: "bulk" is behind the next turn, yet the prefix is computed before it
    matched = f.router.cluster.match(turn2)[1]["e0"]
    assert matched == whole
    ctx = RequestContext(RouteRequest("turn2", "m", turn2, len(turn2) // 4, 50,
                                      slo=Slo(89_000.0, 1000.0)), len(turn2), 0)  # fmt: skip
    est = estimate(ev, ctx, matched, view, 1.001, {}, 0)
    assert est.behind == 1  # "bulk"
    assert est.credited == whole
    assert est.own_ms == pytest.approx(prefill_cost_ms(ev, len(turn2), whole, {}))
    urgent = RequestContext(replace(ctx.request, slo=Slo(29_000.0, 1000.0)), len(turn2), 0)
    est = estimate(ev, urgent, matched, view, 1.001, {}, 0)
    assert est.credited == 0  # it prefills the prefix itself (its work does not count it twice)
    assert est.own_work_ms == pytest.approx(prefill_cost_ms(ev, len(turn2), whole, {}))
    # past its prefill, a request's blocks are written, whoever computed its prefix: the
    # follower's, for a request due before every other
    follower = history + b"first question, again"
    f.send("e0", FirstToken("follower", 100.0), 1.1)
    view, ev = _view(f, 1.1)
    block = prof.block_bytes
    assert view.routed_ahead(ev, follower + b"?", 1.0 + 30.0, 0) == len(follower) // block * block


def test_an_arrival_order_engine_queues_every_open_request_ahead_and_drops_none() -> None:
    """vLLM's own scheduler (``queue_order="arrival"``) serves its queue first come first
    served and rejects nothing for its SLO: the requests S-EDF would drop or run later are all
    ahead of a new one, none is behind it, and an urgent request cannot overtake them."""
    f = Fleet(n=1)
    prof = f.router.cluster.engines["e0"].profile
    big_ms = prof.prefill_ms(20_000)
    # routed (within the shed margin) but past saving: S-EDF rejects it while it waits
    f.route("late", b"h" * 80_000, 1.0, slo=Slo(0.9 * big_ms, 1000.0))
    f.route("fine", b"f" * 8_000, 1.0, slo=Slo(60_000.0, 1000.0))
    view, ev = _view(f, 1.0)
    assert not ev.arrival_order
    assert view.prefill_queue(ev, 1.0 + 100.0)[0] == pytest.approx(prof.prefill_ms(2_000))
    assert view.prefill_queue(ev, 1.0 + 1.0)[:2] == (0.0, 2)  # due first, it overtakes both
    f.heartbeat("e0", 1.0, queue_order="arrival")
    view, ev = _view(f, 1.0)
    assert ev.arrival_order
    every = prof.prefill_ms(22_000)
    for due in (1.0 + 100.0, 1.0 + 1.0, 1.0 + 0.001):
        assert view.prefill_queue(ev, due) == pytest.approx((every, 0, every))


def test_an_urgent_request_is_shed_behind_an_arrival_order_queue_it_would_overtake() -> None:
    """The SLO filter on an arrival-order engine: the long prefill queued first runs first,
    so a request due before it ends cannot make its SLO there (on S-EDF it overtakes)."""
    f = Fleet(n=1, options={"shed_factor": 1.0})
    prof = f.router.cluster.engines["e0"].profile
    big, small = b"B" * 120_000, b"s" * 2_000
    big_ms = prof.prefill_ms(prof.tokens_for_bytes(len(big)))
    small_ms = prof.prefill_ms(prof.tokens_for_bytes(len(small)))
    f.heartbeat("e0", 0.5, queue_order="arrival")
    assert f.route("big", big, 1.0, slo=Slo(big_ms + 100.0, 1000.0)).engine_id == "e0"
    urgent = f.route("urgent", small, 1.0, slo=Slo(small_ms + 50.0, 1000.0))
    assert urgent.reason == "shed"
    f.heartbeat("e0", 1.0)  # the same engine, S-EDF
    urgent = f.route("urgent2", small, 1.0, slo=Slo(small_ms + 50.0, 1000.0))
    assert (urgent.engine_id, urgent.reason) == ("e0", "explore")


def test_e2_sends_a_request_past_a_long_arrival_order_queue_of_work_due_later() -> None:
    """On S-EDF engines an urgent request overtakes a queue of work due later, so that queue
    costs it nothing; on arrival-order engines it waits behind all of it and e2 sends it to
    the engine with less queued work."""
    for order, expect in (("deadline", "e0"), ("arrival", "e1")):
        f = Fleet(n=2)
        for e in ("e0", "e1"):
            f.heartbeat(e, 0.5, queue_order=order)
        prof = f.router.cluster.engines["e0"].profile
        key = b"k" * 4_000
        f.cache("e0", key, 0.5)  # e0 holds the request's prefix
        for i in range(4):  # e0: a long queue of relaxed work
            f.route(f"bulk{i}", bytes([65 + i]) * 60_000, 1.0, slo=Slo(60_000.0, 1000.0),
                    exclude=frozenset({"e1"}))  # fmt: skip
        own_ms = prof.prefill_ms(prof.tokens_for_bytes(len(key) + 400))
        d = f.route("urgent", key + b"q" * 400, 1.0, slo=Slo(own_ms + 500.0, 1000.0))
        assert d.engine_id == expect, order


def test_an_arrival_order_engine_meets_a_tpot_slo_only_if_its_whole_batch_does() -> None:
    """S-EDF engines hold a request back until the batch decodes within its TPOT SLO (SCORPIO's
    admission); an arrival-order engine decodes every request it holds in every step, so a
    request whose decode alone fits its TPOT SLO still misses it behind a big batch there. The
    batch is a forecast (a burst may drain before the request ends): it refuses only while the
    TPOT the engine measured agrees."""
    from router.policies.feasibility import arrival_order_tpot_ms, rate_decay

    for order, measured in (("deadline", 1.0), ("arrival", 1.0), ("arrival", 0.0)):
        f = Fleet(n=1)
        f.heartbeat("e0", 0.5, queue_order=order)
        for i in range(48):  # a big batch of long contexts, relaxed TPOT SLOs
            f.route(f"d{i}", bytes([i]) * 40_000, 1.0, max_tokens=400, slo=Slo(60_000.0, 1000.0))
            f.send("e0", FirstToken(f"d{i}", 200.0), 1.5)
        _, ev = _view(f, 2.0)
        prof = ev.profile
        mine = prof.tokens_for_bytes(400) + 50 / 2
        alone = prof.decode_step_ms(1, mine) * 1.3  # (TPOT_SAFETY)
        batch = arrival_order_tpot_ms(ev, mine, rate_decay(ev, 2.0))
        assert batch > 2 * alone
        tpot_slo = (alone + batch) / 2  # the request alone fits it; the whole batch does not
        # the TPOTs the engine reported: the batch's (it decodes that slowly), or the request's
        # own alone (what was there decoded fast)
        for i in range(5):
            tpot = batch if measured else alone / 1.3
            f.send("e0", RequestFinished(f"w{i}", 11, 10.0, tpot), 1.9)
        d = f.route("x", b"x" * 400, 2.0, max_tokens=50, slo=Slo(60_000.0, tpot_slo))
        if order == "deadline" or not measured:
            assert (d.engine_id, d.reason) == ("e0", "explore"), (order, measured)
        else:
            assert d.reason == "shed" and d.fallback == "e0"
            assert "TPOT SLO" in d.detail
            assert d.retry_after_s == pytest.approx(1.0)  # transient: the batch drains


def test_scorpios_margin_on_a_lone_decode_applies_only_where_the_engine_admits_by_it() -> None:
    """An S-EDF engine refuses a request whose decode step alone, times SCORPIO's 1.3 margin,
    is past its TPOT SLO (its VBS admission), so the router sheds it there; an arrival-order
    engine has no such admission and decodes it within the SLO: the router sends it there."""
    for order in ("deadline", "arrival"):
        f = Fleet(n=1)
        f.heartbeat("e0", 0.5, queue_order=order)
        ev = f.router.cluster.engines["e0"]
        key = b"p" * 40_000
        mine = ev.profile.prompt_tokens(len(key) // 4, len(key)) + 50 / 2
        alone = ev.profile.decode_step_ms(1, mine)
        tpot_slo = alone * 1.15 / 0.99  # (TPOT_HEADROOM): alone fits, x1.3 does not
        d = f.route("x", key, 1.0, slo=Slo(60_000.0, tpot_slo))
        if order == "deadline":
            assert d.reason == "shed" and "TPOT SLO" in d.detail
        else:
            assert (d.engine_id, d.reason) == ("e0", "explore")


def test_a_long_context_is_judged_on_the_measured_tpot_plus_what_its_context_adds() -> None:
    """An arrival-order engine measured a TPOT within the SLO on the requests it decoded (short
    contexts); a prompt of 100,000 tokens joining that batch lengthens every step by its extra
    context, past the SLO: the router does not send it there, while a short request goes."""
    from router.policies.feasibility import arrival_order_tpot_ms, measured_tpot_ms, rate_decay

    f = Fleet(n=1)
    f.heartbeat("e0", 0.5, queue_order="arrival")
    for i in range(16):  # a batch of short contexts decoding
        f.route(f"d{i}", bytes([i]) * 4_000, 1.0, max_tokens=400, slo=Slo(60_000.0, 1000.0))
        f.send("e0", FirstToken(f"d{i}", 100.0), 1.2)
    _, ev = _view(f, 1.4)
    step = ev.profile.decode_step_ms(ev.inflight, ev.open_ctx_tokens / ev.inflight)
    for i in range(5):  # what the engine measured: that batch's step
        f.send("e0", RequestFinished(f"w{i}", 11, 10.0, step * ev.decode_scale), 1.4)
    _, ev = _view(f, 1.5)
    decay = rate_decay(ev, 1.5)
    long_key = b"L" * 400_000
    long_mine = ev.profile.prompt_tokens(len(long_key) // 4, len(long_key)) + 50 / 2
    short_mine = ev.profile.prompt_tokens(100, 400) + 50 / 2
    assert measured_tpot_ms(ev, short_mine, decay) == ev.tpot_ms  # shorter than the batch's
    adjusted = measured_tpot_ms(ev, long_mine, decay)
    forecast = arrival_order_tpot_ms(ev, long_mine, decay)
    alone = ev.profile.decode_step_ms(1, long_mine) * ev.decode_scale
    fits = max(ev.tpot_ms, alone)  # the measured TPOT and its decode alone both fit the SLO
    assert min(adjusted, forecast) > 1.1 * fits
    tpot_slo = (fits + min(adjusted, forecast)) / 2 / 0.99
    d = f.route("long", long_key, 1.5, slo=Slo(600_000.0, tpot_slo))
    assert d.reason == "shed" and d.fallback == "e0"
    d = f.route("short", b"s" * 400, 1.5, slo=Slo(600_000.0, tpot_slo))
    assert (d.engine_id, d.reason) == ("e0", "explore")


def test_a_prefill_that_would_push_decoding_requests_past_their_tpot_slo_goes_elsewhere() -> None:
    """On an arrival-order engine a request's prefill chunks run inside the decode steps of
    every request decoding there: a prefill longer than their slack pushes them past their
    TPOT SLO (they count only while they could still meet it), so e2 sends such a prefill to an
    engine where nothing decodes, and a short one may stay."""
    f = Fleet(n=2)
    for e in ("e0", "e1"):
        f.heartbeat(e, 0.5, queue_order="arrival")
    for i in range(4):
        f.route(f"d{i}", bytes([i]) * 4_000, 1.0, max_tokens=100, slo=Slo(60_000.0, 40.0),
                exclude=frozenset({"e1"}))  # fmt: skip
        f.send("e0", FirstToken(f"d{i}", 100.0), 1.0)
    view, ev = _view(f, 1.0)
    # at 25 ms a token each has 99 x 40 - 100 x 25 = 1,460 ms of slack
    assert view.tpot_pushed(ev, 1.0, 0.0, 1_400.0, 25.0) == 0
    assert view.tpot_pushed(ev, 1.0, 0.0, 1_500.0, 25.0) == 4
    # a prefill that starts when they have 100 ms of decode left stalls them 100 ms at most
    assert view.tpot_pushed(ev, 1.0, 2_400.0, 1_500.0, 25.0) == 0
    # at 45 ms a token they miss anyway: nobody is pushed
    assert view.tpot_pushed(ev, 1.0, 0.0, 10_000.0, 45.0) == 0
    prof = ev.profile
    for i in range(4):  # e1: a queue of relaxed prefill work, nothing decoding
        f.route(f"bulk{i}", bytes([70 + i]) * 40_000, 1.0, slo=Slo(60_000.0, 1000.0),
                exclude=frozenset({"e0"}))  # fmt: skip
    long = b"L" * 100_000  # seconds of prefill: past their slack even at e0's fitted speed
    assert prof.prefill_ms(prof.tokens_for_bytes(len(long))) * ev.prefill_scale > 2_000.0
    key = b"k" * 8_000
    f.cache("e0", key, 1.0)
    for order, expect in (("deadline", "e0"), ("arrival", "e1")):
        for e in ("e0", "e1"):
            f.heartbeat(e, 1.0, queue_order=order)
        # e1's queue makes it the slower choice; on e0 the prefill would push the four
        # decoding requests past their TPOT SLO, on an arrival-order engine only
        prompt = order.encode() + long  # (each its own: the first one's routed prefix would match)
        assert f.route(f"long-{order}", prompt, 1.0, slo=Slo(60_000.0, 1000.0)).engine_id == expect
        f.router.report(f"long-{order}", expect, "ok", 1.0)
    short = f.route("short", key + b"s" * 400, 1.0, slo=Slo(60_000.0, 1000.0))
    assert short.engine_id == "e0"  # its prefix cached there: its prefill is short


def test_decoding_requests_set_the_prefill_share_and_the_next_release() -> None:
    from router.policies.feasibility import prefill_share

    f = Fleet(n=1)
    f.send("e0", RequestFinished("warm", 11, 10.0, 40.0), 0.5)  # TPOT samples: 40 ms
    for i in range(3):
        f.route(f"d{i}", bytes([i]) * 8_000, 1.0, max_tokens=100, slo=Slo(60_000.0, 100.0))
        f.send("e0", FirstToken(f"d{i}", 200.0), 1.2)
    view, ev = _view(f, 2.2)
    assert ev.decoding == 3 and ev.decode_tpot_min_ms == 100.0
    assert 0.0 < prefill_share(ev) < 1.0
    # 100 tokens at the measured TPOT, one second into decoding: ~3 s left for each
    tpot = f.router.cluster.engines["e0"].tpot_ms
    assert view.decode_release_ms(ev, 2.2) == pytest.approx(100 * tpot - 1000.0)
    f.send("e0", RequestFinished("d0", 100, 200.0, tpot), 2.3)
    _, ev = _view(f, 2.3)
    assert ev.decoding == 2


def test_in_flight_tpot_slos_make_the_virtual_batch() -> None:
    """SCORPIO decodes a request with a relaxed TPOT SLO in a share of the steps (tightest /
    its own): the router's virtual batch counts it so, and forgets it when it ends."""
    from router.policies.feasibility import virtual_batch

    f = Fleet(n=1)
    f.route("chat", b"c" * 4_000, 1.0, max_tokens=50, slo=Slo(250.0, 100.0))
    for i in range(4):
        f.route(f"file{i}", bytes([i]) * 8_000, 1.0, max_tokens=100, slo=Slo(6_000.0, 200.0))
    _, ev = _view(f, 1.1)
    assert ev.inflight == 5 and ev.open_tpot_min_ms == 100.0
    assert virtual_batch(ev, ev.open_tpot_min_ms) == pytest.approx(1 + 4 * 0.5)
    f.send("e0", RequestFinished("chat", 50, 100.0, 40.0), 1.5)
    _, ev = _view(f, 1.6)
    assert ev.open_tpot_min_ms == 200.0
    assert virtual_batch(ev, ev.open_tpot_min_ms) == pytest.approx(4.0)
    for i in range(4):
        f.send("e0", RequestFinished(f"file{i}", 100, 100.0, 40.0), 1.7)
    _, ev = _view(f, 1.8)
    assert ev.open_inv_tpot == 0.0 and ev.open_tpot_min_ms == math.inf


def test_an_engine_without_request_events_has_its_prefills_aged_out() -> None:
    """A plain vLLM behind the bridge sends KV events and heartbeats but no request events:
    its routed prefills count as queued only until the work queued there would be done."""
    f = Fleet(n=0)
    f.heartbeat("v", 0.0)  # no AllCleared, no request events: heartbeats only
    d = f.route("r", b"v" * 40_000, 1.0)  # 10k tokens: ~1.2 s of prefill
    assert d.engine_id == "v"
    view, ev = _view(f, 1.1, "v")
    assert view.prefill_ahead_ms(ev, 1e9) > 1000.0
    view, ev = _view(f, 3.0, "v")
    assert view.prefill_ahead_ms(ev, 1e9) == 0.0
    # its own waiting request is not someone else's work in its next heartbeat
    f.route("r2", b"w" * 40_000, 3.0)
    f.heartbeat("v", 3.1, queued_prefill_tokens=10_000)
    assert f.router.cluster.engines["v"].foreign_prefill_tokens == 0


def test_a_prefill_routed_before_the_engine_s_first_request_event_stays_open() -> None:
    """The first request routed to an engine is booked before it has said it reports request
    events, so it gets the aged-out end guess above. Once the engine reports them it says when
    the prefill ends: the request stays queued there past the guess (a long first prefill of a
    cold fleet, slowed by requests due sooner, looked done, and the router sent it more of
    them) and counts as delayed by a request due sooner, until its first token."""
    f = Fleet(n=0)
    f.heartbeat("v", 0.0)
    slo = Slo(60_000.0, 100.0)
    assert f.route("r", b"v" * 40_000, 1.0, slo=slo).engine_id == "v"  # ~1.2 s of prefill
    f.send("v", RequestStarted("r"), 1.01)
    view, ev = _view(f, 3.0, "v")
    assert view.prefill_ahead_ms(ev, 1e9) > 1000.0
    assert view.prefill_queue(ev, 3.0 + 10.0)[1] == 1  # due at 61 s: behind one due at 13 s
    f.send("v", FirstToken("r", 2_500.0), 3.5)
    view, ev = _view(f, 3.6, "v")
    assert view.prefill_ahead_ms(ev, 1e9) == 0.0
    assert view.prefill_queue(ev, 3.6 + 10.0)[1] == 0


def test_e2_scores_the_top_holders_and_the_least_loaded_in_a_big_fleet() -> None:
    """In a fleet bigger than ``contenders`` E2 scores the engines holding the most of the
    key and the least loaded; an idle one anywhere wins a request nobody holds."""
    f = Fleet(n=40)
    cl = f.router.cluster
    key = b"c" * 20_000
    f.cache("e37", key, 0.5)
    # load every engine but e5 and e37 with a long request each
    f.router.set_draining("e5", True)
    f.router.set_draining("e37", True)
    for i in range(38):
        f.route(f"bg{i}", bytes([i]) * 60_000, 1.0, max_tokens=500)
    f.router.set_draining("e5", False)
    f.router.set_draining("e37", False)
    req = RouteRequest("probe", "m", key + b"?", 5_000, 10)
    match, matched = cl.match(req.key)
    view = View(cl, cl.candidates(req, 2.0), matched, f.router.rng, model="m", now=2.0,
                confirmed=match.per_engine)  # fmt: skip
    contenders = {ev.engine_id for ev in f.router.policy._contenders(view)}
    assert len(contenders) == 16 and {"e37", "e5"} <= contenders
    d = f.route("hit", key + b"?", 2.0)
    assert d.engine_id == "e37"
    d = f.route("cold", b"z" * 20_000, 2.0)
    assert d.engine_id == "e5"  # the idle one, found among the least loaded
    assert cl.engines["e5"].routed_total == 1


def test_routed_prefill_feeds_the_fleet_slo_mix() -> None:
    """Each routed request adds its own prefill to the fleet's mix under its TTFT SLO: the
    share of recent work that would overtake a request with a longer SLO (S-EDF)."""
    f = Fleet(n=2)
    mix = f.router.cluster.slo_mix
    assert mix.share_sooner(5_000.0) == 0.0
    assert f.route("urgent", b"u" * 4000, 1.0, slo=Slo(1_000.0, 100.0)).engine_id is not None
    assert f.route("relaxed", b"r" * 4000, 1.0, slo=Slo(20_000.0, 100.0)).engine_id is not None
    assert mix.share_sooner(500.0) == 0.0
    assert mix.share_sooner(5_000.0) == pytest.approx(0.5, rel=0.05)
    assert mix.share_sooner(60_000.0) == pytest.approx(1.0)


route_op = st.tuples(
    st.sampled_from(["route", "route", "route", "first", "finish", "cache", "hb"]),
    st.integers(0, 5),  # prefix family (a key), or which open request / engine
    st.integers(0, 40_000),  # bytes after the family's prefix
    st.sampled_from([300.0, 2_000.0, 30_000.0]),  # TTFT SLO
    st.floats(0.0, 0.5),  # seconds since the last op
)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 10),
    st.sampled_from([{}, {"contenders": 3}, {"idle_free": True}, {"work_weight": 0.0}]),
    st.lists(route_op, min_size=1, max_size=40),
)
def test_e2_skipping_contenders_by_their_cost_bound_changes_no_decision(
    n: int, options: dict, ops: list
) -> None:
    """E2 estimates only the contenders whose lower bound on the cost is within the tie band
    of the cheapest found; the decisions (engine, reason, matched bytes) and the rng draws
    equal those of estimating every contender, over random sequences of routes, first tokens,
    finishes, cached blocks and heartbeats with queued work and small caches (the eviction
    term priced)."""
    fleets = [Fleet(n=n, options=options), Fleet(n=n, options={**options, "bound_skip": False})]
    families = [bytes([65 + f]) * (1_000 * (f + 1)) for f in range(6)]
    now = 1.0
    open_ids: list[tuple[str, str]] = []
    for i, (kind, which, tail, ttft, dt) in enumerate(ops):
        now += dt
        key = families[which] + bytes([i % 251]) * tail
        engine = f"e{which % n}"
        picks = []
        for f in fleets:
            if kind == "route":
                d = f.route(f"r{i}", key, now, slo=Slo(ttft, 1000.0))
                picks.append((d.engine_id, d.reason, d.matched_bytes, d.fallback))
            elif kind == "cache":
                f.cache(engine, key, now)
            elif kind == "hb":  # queued work, and a cache from 3 to 260 KB, half of it used
                blocks = tail // 10 + 50
                f.heartbeat(
                    engine,
                    now,
                    queued_prefill_tokens=tail,
                    kv_blocks_total=blocks,
                    kv_blocks_used=blocks // 2,
                )
            elif open_ids:
                rid, eng = open_ids[which % len(open_ids)]
                if kind == "first":
                    f.send(eng, FirstToken(rid, 100.0), now)
                else:
                    f.send(eng, RequestFinished(rid, 10, 100.0, 20.0), now)
        if picks:
            assert picks[0] == picks[1], (i, picks)
            if picks[0][0] is not None:
                open_ids.append((f"r{i}", picks[0][0]))
        assert fleets[0].router.rng.random() == fleets[1].router.rng.random()


def test_the_gateways_first_token_stands_in_for_an_engine_without_request_events() -> None:
    """A plain vLLM behind the bridge sends no request events: the gateway's TTFT of a streamed
    answer ends the request's prefill in the router's books (instead of a guess), starts its
    decode, and (``fit_gateway_ttft``) an idle engine's TTFT fits its speed; an engine's own
    events take precedence."""
    f = Fleet(n=2, fit_gateway_ttft=True)
    prof = f.router.cluster.engines["e0"].profile
    cl = f.router.cluster
    key = b"i" * 40_000  # 10k tokens on an idle engine: its TTFT is its prefill time
    d = f.route("r", key, 1.0)
    eng = cl.engines[d.engine_id]
    assert "r" in eng.open_prefill and not eng.decoding
    assert not f.router.first_token("r", "elsewhere", 10.0, 1.5)  # not where it went
    assert not f.router.first_token("r", d.engine_id, math.nan, 1.5)  # no such TTFT
    assert f.router.first_token("r", d.engine_id, 3 * prof.prefill_ms(10_000), 2.0)
    assert "r" not in eng.open_prefill and "r" in eng.decoding
    assert _view(f, 2.0, d.engine_id)[1].prefill_scale == pytest.approx(3.0)
    assert not f.router.first_token("r", d.engine_id, 1.0, 2.1)  # once
    # an engine that sends its own request events: the gateway's word changes nothing
    other = "e1" if d.engine_id == "e0" else "e0"
    f.send(other, RequestStarted("x"), 2.2)
    d2 = f.route("r2", b"j" * 40_000, 2.3, exclude=frozenset({d.engine_id}))
    assert d2.engine_id == other
    assert not f.router.first_token("r2", other, 3 * prof.prefill_ms(10_000), 3.0)
    assert "r2" in cl.engines[other].open_prefill
    assert _view(f, 3.0, other)[1].prefill_scale == 1.0
    # by default the gateway's TTFT ends the prefill and fits an engine's speed only against
    # the fleet's other engines (it holds the host's and the HTTP path's delays too): alone,
    # an engine 3x its prediction is as fast as the fleet
    g = Fleet(n=1)
    g.route("r", key, 1.0)
    assert g.router.first_token("r", "e0", 3 * prof.prefill_ms(10_000), 2.0)
    assert "r" in g.router.cluster.engines["e0"].decoding
    assert _view(g, 2.0)[1].prefill_scale == 1.0


def _bridged_fleet_answers(
    f: Fleet, truth: dict[str, float], n: int, delay: float, noise: float = 0.0
) -> None:
    """``n`` requests, each answered (the gateway's TTFT) at ``delay`` x its engine's ``truth``
    x the router's prediction on the engine's profile (x a log-normal factor of sigma
    ``noise``, seeded)."""
    cl = f.router.cluster
    rng = random.Random(7)
    for i in range(n):
        now = 1.0 + i
        for e in truth:
            f.heartbeat(e, now)
        d = f.route(f"q{i}", bytes([i % 251]) * 8_000 + b"%d" % i, now)
        rec = cl._inflight[f"q{i}"]
        assert rec.ttft_pred_ms > 0 and 0 < rec.ttft_weight <= 1
        on_profile = rec.ttft_pred_ms / math.exp(rec.ttft_factor_log)
        jitter = (1.0 + 0.05 * ((i % 3) - 1)) * math.exp(rng.gauss(0.0, noise))
        ttft = on_profile * truth[d.engine_id] * delay * jitter
        assert f.router.first_token(f"q{i}", d.engine_id, ttft, now + ttft / 1e3)
        f.router.report(f"q{i}", d.engine_id, "ok", now + 0.5)


def test_behind_the_bridge_an_engine_slower_than_the_fleet_is_read_from_the_gateways_ttfts() -> (
    None
):
    """Engines that report no prefill timings: each one's prefill factor is how much slower its
    TTFTs run against the router's predictions than the fastest engine's. A delay every answer
    holds (the HTTP path, a loaded host) cancels; identical engines read as identical."""
    f = Fleet(n=3)
    _bridged_fleet_answers(f, {"e0": 1.0, "e1": 2.0, "e2": 1.0}, 60, delay=3.0)
    scale = {e: _view(f, 70.0, e)[1].prefill_scale for e in ("e0", "e1", "e2")}
    assert scale["e0"] == scale["e2"] == 1.0
    assert 1.6 < scale["e1"] <= 2.0
    # the slow engine, now priced as slow, took fewer of the requests
    counts = f.router.cluster.engines
    assert counts["e1"].routed_total < min(counts["e0"].routed_total, counts["e2"].routed_total)
    # off: every engine is as fast as its profile
    g = Fleet(n=3, fit_relative_ttft=False)
    cl = g.router.cluster
    d = g.route("q", b"z" * 8_000, 1.0)
    assert cl._inflight["q"].ttft_pred_ms == 0.0
    # an engine that sends its own request events is fitted from them, never from this
    h = Fleet(n=2)
    h.send("e0", RequestStarted("x"), 0.5)
    d = h.route("q", b"z" * 8_000, 1.0, exclude=frozenset({"e1"}))
    assert d.engine_id == "e0" and h.router.cluster._inflight["q"].ttft_pred_ms == 0.0


def test_behind_the_bridge_many_identical_engines_read_as_identical() -> None:
    """Of many identical engines one reads fastest by chance: against it alone, each with its
    own few samples' variance, the rest read slower by their noise (30 of these 32, up to
    1.58x, did). The reference is every engine within noise of the fastest, a sample's
    variance is the fleet's, and a big fleet's margin is wider: none of 32 identical engines
    with noisy TTFTs (a few samples each) is read as slower."""
    n = 32
    f = Fleet(n=n)
    _bridged_fleet_answers(f, {f"e{i}": 1.0 for i in range(n)}, 200, delay=2.0, noise=0.3)
    cl = f.router.cluster
    fitted = [e for e in cl.engines.values() if e.ttft_fit.evidence >= 2.0]
    assert len(fitted) > n // 2
    assert max(e.speed.prefill for e in cl.engines.values()) == 1.0


def test_an_engine_without_request_events_takes_its_tpot_from_its_heartbeats() -> None:
    """A plain vLLM behind the bridge never sends RequestFinished: its TPOT (the windowed load's
    price of an output token) is its heartbeats' mean inter-token latency. An engine that sends
    request events keeps their exact TPOTs."""
    f = Fleet(n=3)
    cl = f.router.cluster
    prof = cl.engines["e0"].profile
    assert cl.engines["e0"].tpot_ms == 150.0  # the seed
    step = prof.decode_step_ms(4.0, 500.0) * 2
    f.heartbeat("e0", 1.0, decode_step_ms=step, decode_batch=4.0, decode_context=500.0)
    assert cl.engines["e0"].tpot_ms == pytest.approx(step)
    f.send("e1", RequestFinished("x", 10, 100.0, 40.0), 1.7)  # e1 reports its requests
    f.heartbeat("e1", 1.8, decode_step_ms=step, decode_batch=4.0, decode_context=500.0)
    assert cl.engines["e1"].tpot_ms == pytest.approx(40.0)
    assert cl.engines["e1"].speed.decode == pytest.approx(2.0)  # (its own fit: absolute)


def test_a_bridged_engines_decode_speed_is_read_against_the_fastest_from_every_busy_interval() -> (
    None
):
    """Behind the bridge a step is timed only by vLLM's inter-token latency, which holds what
    the host adds (a slowdown every engine shares cancels when read against the fleet's
    fastest) and, in an interval whose steps also prefilled, that prefill: priced on the
    profile and spread over the interval's steps (its tokens over its batch), such an interval
    says how fast the engine runs too. An engine is read slower than the fastest only once each
    has two readings, and only by what its readings show past their noise."""
    f = Fleet(n=3)
    cl = f.router.cluster
    prof = cl.engines["e0"].profile
    lone = prof.decode_step_ms(4.0, 500.0)
    host = 3.0  # every engine on this host runs 3x slower than its profile
    # e0 decodes alone, 2x slower than its peers; e1 and e2 prefill in every interval: 400 ms
    # of prefill over 40 tokens at a batch of 4 (10 steps) adds 40 ms to each step
    mixed = dict(decode_batch=4.0, decode_context=500.0, decode_tokens=40, prefill_plan_ms=400.0)
    f.heartbeat("e0", 1.0, decode_step_ms=2 * host * lone, decode_batch=4.0, decode_context=500.0)
    f.heartbeat("e1", 1.0, decode_step_ms=host * (lone + 40.0), **mixed)
    assert _view(f, 1.05, "e0")[1].decode_scale == 1.0  # one reading each: nothing read yet
    for t in range(1, 6):
        f.heartbeat("e0", 1.0 + t / 10, decode_step_ms=2 * host * lone, decode_batch=4.0,
                    decode_context=500.0)  # fmt: skip
        f.heartbeat("e1", 1.0 + t / 10, decode_step_ms=host * (lone + 40.0), **mixed)
        f.heartbeat("e2", 1.0 + t / 10, decode_step_ms=host * (lone + 40.0) * (1 + t % 2 / 10),
                    **mixed)  # fmt: skip
    assert _view(f, 2.0, "e0")[1].decode_scale == pytest.approx(2.0, rel=0.05)
    assert _view(f, 2.0, "e1")[1].decode_scale == pytest.approx(1.0)
    assert _view(f, 2.0, "e2")[1].decode_scale == pytest.approx(1.0)  # (its spread: noise)
    assert cl.engines["e1"].speed.decode == 1.0  # (the absolute fit stays for event engines)
    # the same intervals without their prefill priced (an old bridge) read e1 slower than e0
    g = Fleet(n=2)
    for t in range(6):
        g.heartbeat("e0", 1.0 + t / 10, decode_step_ms=lone, decode_batch=4.0,
                    decode_context=500.0)  # fmt: skip
        g.heartbeat("e1", 1.0 + t / 10, decode_step_ms=lone + 40.0, decode_batch=4.0,
                    decode_context=500.0)  # fmt: skip
    assert _view(g, 2.0, "e1")[1].decode_scale == pytest.approx((lone + 40.0) / lone, rel=0.05)


def test_a_bridged_engines_predicted_ttft_gives_prefill_its_share_of_the_profiles_step() -> None:
    """The TTFT fit of an engine behind the bridge reads its gateway TTFTs against a prediction
    with the prefill factor divided out. That prediction's share of the GPU for prefill is taken
    on the profile's decode step, not the fitted one: an engine slower at both is slower at its
    steps' prefill share too, and taken at the fitted step a slow decode, read first, made the
    fit read the engine's prefill as fast as the fastest's (a double count). Only the one
    decode step the prediction adds grows with the decode factor, on an engine that serves in
    arrival order (vLLM); on an S-EDF engine, which cuts each step to its TPOT budget, a slower
    decode does leave prefill less."""
    f = Fleet(n=2)
    cl = f.router.cluster
    prof = cl.engines["e0"].profile
    lone = prof.decode_step_ms(4.0, 500.0)
    for t in range(6):  # e0 decodes 2x slower than e1
        for eid, slow in (("e0", 2.0), ("e1", 1.0)):
            f.heartbeat(eid, 1.0 + t / 10, decode_step_ms=slow * lone, decode_batch=4.0,
                        decode_context=500.0, queue_order="arrival")  # fmt: skip
    for i in range(12):  # requests in flight on both: prefill shares the GPU with their decode
        f.route(f"r{i}", bytes([i]) * 4000, 2.0 + i / 1000, max_tokens=400)
    eng = cl.engines["e0"]
    assert eng.inflight > 0 and cl.decode_scale(eng) == pytest.approx(2.0, rel=0.05)
    rec = next(r for r in cl._inflight.values() if r.engine_id == "e0")

    def predicted() -> tuple[float, float]:
        eng.view = None
        cl._predict_ttft(eng, rec, 10.0)
        return rec.ttft_pred_ms, decode_step_ms(cl.engine_view(eng))

    slow_pred, slow_step = predicted()
    ref = cl._step_ref.ref
    cl._step_ref.ref = None  # (no reference: its decode read as its profile's)
    plain_pred, plain_step = predicted()
    assert slow_step == pytest.approx(2 * plain_step, rel=0.05) and slow_step > plain_step
    assert slow_pred - slow_step == pytest.approx(plain_pred - plain_step)
    # an S-EDF engine cuts its steps to the TPOT budget: there a slower decode leaves prefill
    # less of each step, and the prediction grows by more than the step it adds
    hb = eng.heartbeat
    assert hb is not None
    eng.heartbeat = replace(hb, queue_order="deadline")
    cl._step_ref.ref = ref
    edf_pred, edf_step = predicted()
    assert edf_step == pytest.approx(slow_step)
    assert edf_pred - edf_step > slow_pred - slow_step


def test_answers_are_planned_at_what_answers_under_their_cap_took() -> None:
    """Clients state max_tokens 4096 and the answers end near 200 tokens: once the engines'
    RequestFinished events say so (each with the cap it was given), the router plans a new
    request of that cap at about 200 (its in-flight record, its decode context), whichever
    engine told it; a request stating 64 is planned at 64 (no answer under such a cap has
    ended); with ``fit_output`` off every answer is planned at its cap."""
    for fit in (True, False):
        f = Fleet(n=2, fit_output=fit)
        cl = f.router.cluster
        for i in range(6):
            d = f.route(f"a{i}", b"question %d " % i * 100, 1.0 + i, max_tokens=4096)
            if i == 0:
                assert cl._inflight["a0"].out_tokens == 4096  # nothing ended yet: the cap
            f.send(d.engine_id, RequestFinished(f"a{i}", 150 + 20 * i, 50.0, 20.0, 4096), 1.5 + i)
        f.route("b", b"another question " * 100, 10.0, max_tokens=4096)
        f.route("c", b"a short one " * 100, 10.0, max_tokens=64)
        want = 200 if fit else 4096
        assert cl._inflight["b"].out_tokens == want
        assert cl._inflight["b"].ctx_tokens == pytest.approx(
            cl.engines[cl._inflight["b"].engine_id].profile.prompt_tokens(
                len(b"another question " * 100) // 4, len(b"another question " * 100)
            )
            + want / 2
        )
        assert cl._inflight["c"].out_tokens == 64


def test_the_gateways_word_on_answers_lengths_counts_only_for_engines_that_do_not_say() -> None:
    """Behind the bridge a plain vLLM sends no RequestFinished: the gateway's report of an
    answer's length against the cap the router was told is then all there is, and is learned.
    An engine that sends its own events is learned from those alone (no answer twice)."""
    f = Fleet(n=2)
    cl = f.router.cluster
    f.route("a", b"question " * 100, 1.0, max_tokens=4096)
    engine = cl._inflight["a"].engine_id
    assert f.router.report("a", engine, "ok", 2.0, 300, 4096)
    assert cl.output_fit.expected(4096) == 300
    f.send("e1", RequestStarted("other"), 2.0)  # e1 sends request events: it says for itself
    assert not cl.gateway_answer("e1", 4096, 10)
    f.router.report("x", "e0", "failed", 2.0, 10, 4096)  # a failed answer teaches nothing
    assert cl.output_fit.expected(4096) == 300
    assert not cl.gateway_answer("nobody", 4096, 10) and not cl.gateway_answer("e0", 0, 10)


def test_a_long_prompt_is_priced_in_the_pieces_its_engine_announces() -> None:
    """An engine that prefills a prompt in chunks (its heartbeat's ``prefill_chunk_tokens``)
    runs each chunk with the earlier ones as context: a 24k-token prompt costs it the pieces'
    sum, a third more than its one-piece time in 2,048-token chunks. The router prices P_i so (on an
    engine that announces nothing, in one piece), and of two idle engines the one that
    prefills it in one piece is the cheaper."""
    f = Fleet(n=2)
    f.heartbeat("e0", 0.5, prefill_chunk_tokens=2048)
    view, chunked = _view(f, 1.0, "e0")
    whole = view.engine("e1")
    assert (chunked.prefill_chunk_tokens, whole.prefill_chunk_tokens) == (2048, 0)
    key = bytes(range(256)) * 375  # 96,000 bytes: 24,000 tokens
    prof = chunked.profile
    tokens = prof.tokens_for_bytes(len(key))
    assert prefill_cost_ms(chunked, len(key), 0, {}) == pytest.approx(
        prof.prompt_prefill_ms(tokens, 0, 2048)
    )
    assert prefill_cost_ms(whole, len(key), 0, {}) == pytest.approx(prof.prefill_ms(tokens))
    assert prof.prompt_prefill_ms(tokens, 0, 2048) > 1.3 * prof.prefill_ms(tokens)
    ctx = RequestContext(RouteRequest("long", "m", key, tokens, 50), len(key), 0)
    assert estimate(chunked, ctx, 0, view, 1.0, {}, 0).own_ms == pytest.approx(
        prof.prompt_prefill_ms(tokens, 0, 2048)
    )
    d = f.route("long", key, 1.0, slo=Slo(60_000.0, 1000.0))
    assert (d.engine_id, d.reason) == ("e1", "explore")
