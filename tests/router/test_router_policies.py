"""Each policy on hand-built cluster states where the right answer is known."""

from __future__ import annotations

import ast
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import router.policies as policies_pkg
from broker.events import LoadHeartbeat
from kvgate.cost_model import CostProfile, default_profile
from kvgate.slo import Slo
from router.api import RouteRequest
from router.policies.base import EngineView, GroupLoad, RequestContext, top_matched
from router.policies.feasibility import (
    batch_capacity,
    cached_at_start,
    decode_step_ms,
    estimate,
    kv_harm_ms,
    kv_wait_ms,
    next_decode_step_ms,
    prefill_share,
    queued_prefill_ms,
)
from router.policies.registry import POLICIES, PolicyError, make_policy

PROFILE = default_profile()
KEY_LEN = 40_000  # 10k tokens at 4 bytes per token


def ev(
    engine_id: str,
    *,
    load: float = 0.0,
    inflight: int = 0,
    hit: float = 0.0,
    free: int = 1 << 30,
    routed: int = 100,
    hb: LoadHeartbeat | None = None,
    open_ctx: float = 0.0,
    decoding: int = 0,
    decode_ctx: float = 0.0,
    tpot_min: float = math.inf,
    decode_scale: float = 1.0,
    held_kv: float | None = None,
) -> EngineView:
    return EngineView(
        engine_id=engine_id,
        url=f"http://{engine_id}",
        profile=PROFILE,
        inflight=inflight,
        load_ms=load,
        tpot_ms=150.0,
        hit_ratio=hit,
        free_bytes=free,
        pending_prefill_tokens=0,
        routed_total=routed,
        heartbeat=hb,
        queued_prefill_ms=queued_prefill_ms(PROFILE, hb, 0),
        next_decode_step_ms=next_decode_step_ms(PROFILE, hb, open_ctx, inflight),
        window_ms=load,
        open_ctx_tokens=open_ctx,
        decode_scale=decode_scale,
        decoding=decoding,
        decode_ctx_tokens=decode_ctx,
        held_kv_tokens=decode_ctx if held_kv is None else held_kv,
        kv_holders=decoding,  # (every request decoding holds its memory)
        decode_tpot_min_ms=tpot_min,
    )


@dataclass
class FakeView:
    """A ClusterView with every answer set by the test."""

    engines: list[EngineView]
    matched: dict[str, int] = field(default_factory=dict)
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    evictions: dict[str, float] = field(default_factory=dict)
    overrides: dict[int, str] = field(default_factory=dict)
    reps: dict[int, frozenset[str]] = field(default_factory=dict)
    groups: dict[str, list[GroupLoad]] = field(default_factory=dict)
    halves: dict[int, tuple[float, float]] = field(default_factory=dict)
    releases: dict[str, float] = field(default_factory=dict)
    queued_kv: dict[str, float] = field(default_factory=dict)  # kv_releases' queued ahead
    sooner: float = 0.0  # share_due_sooner's answer, whatever the SLO
    rooms: dict[str, int] = field(default_factory=dict)  # cache_room's answer (default: ample)
    asked: list[float] = field(default_factory=list)  # the SLOs share_due_sooner was asked
    # routed_ahead's answer: key bytes a request in flight there computes first (default none)
    ahead: dict[str, int] = field(default_factory=dict)
    pinned: set[tuple[str, int]] = field(default_factory=set)  # pins' (engine, group) answers
    behind: dict[str, int] = field(default_factory=dict)  # prefill_queue's requests due later

    def engine(self, engine_id: str) -> EngineView | None:
        return next((e for e in self.engines if e.engine_id == engine_id), None)

    def routed_ahead(self, ev: EngineView, key: bytes, deadline: float, since: int) -> int:
        return self.ahead.get(ev.engine_id, 0)

    @property
    def confirmed(self) -> dict[str, int]:
        return self.matched  # hand-built states: no speculative entries

    def __post_init__(self) -> None:  # positions: the order of ``engines``, as the cluster's
        self.engines = [replace(e, position=i) for i, e in enumerate(self.engines)]

    def by_load(self, window: bool = False) -> Iterator[EngineView]:
        def load(e: EngineView) -> float:
            return e.window_ms if window else e.load_ms

        return iter(sorted(self.engines, key=lambda e: (load(e), e.position)))

    def most_loaded(self, count: int, window: bool = False) -> list[EngineView]:
        def load(e: EngineView) -> float:
            return e.window_ms if window else e.load_ms

        return sorted(self.engines, key=lambda e: (-load(e), -e.position))[:count]

    def routed_total(self) -> int:
        return sum(e.routed_total for e in self.engines)

    def window_means(self, clock_ms: float) -> tuple[float, float]:
        n = len(self.engines)
        load = sum(e.window_on_clock(clock_ms) for e in self.engines)
        return load / n, sum(e.window_requests for e in self.engines) / n

    def profiles(self) -> list[CostProfile]:
        return list({ev.profile.name: ev.profile for ev in self.engines}.values())

    def prefill_ahead_ms(self, ev: EngineView, deadline: float) -> float:
        return ev.queued_prefill_ms * ev.prefill_scale  # hand-built: the whole queue is ahead

    def prefill_queue(
        self, ev: EngineView, deadline: float, share: float = 1.0
    ) -> tuple[float, int, float]:
        ahead = self.prefill_ahead_ms(ev, deadline)
        return ahead, self.behind.get(ev.engine_id, 0), ahead

    def share_due_sooner(self, ttft_slo_ms: float) -> float:
        self.asked.append(ttft_slo_ms)
        return self.sooner

    def tpot_pushed(
        self, ev: EngineView, now: float, start_ms: float, stall_ms: float, tpot_ms: float
    ) -> int:
        return 0  # hand-built states: nothing decoding there to push past its TPOT

    def decode_release_ms(self, ev: EngineView, now: float, count: int = 1) -> float:
        return self.releases.get(ev.engine_id, 0.0)

    def kv_releases(
        self, ev: EngineView, now: float, deadline: float
    ) -> list[tuple[float, float, bool]]:
        """The memory held there frees at once, at its ``releases`` time (where it has one);
        ``queued_kv`` is taken before the request and frees later."""
        at = self.releases.get(ev.engine_id)
        if at is None:
            return []
        out = [(at, ev.held_kv_tokens, True)] if ev.held_kv_tokens > 0 else []
        queued = self.queued_kv.get(ev.engine_id)
        if queued:
            out.append((2 * at, queued, False))
        return out

    def eviction_ms(self, engine_id: str, need_bytes: int, now: float) -> float:
        return self.evictions.get(engine_id, 0.0)

    def pins(self, ev: EngineView, group: int) -> bool:
        return (ev.engine_id, group) in self.pinned

    def override(self, group: int) -> str | None:
        return self.overrides.get(group)

    def replicas(self, group: int) -> frozenset[str]:
        return self.reps.get(group, frozenset())

    def groups_on(self, engine_id: str, min_requests: int = 1) -> list[GroupLoad]:
        return self.groups.get(engine_id, [])  # unfiltered: the policy must skip what it must

    def ttft_halves(self, group: int, now: float) -> tuple[float, float]:
        return self.halves.get(group, (0.0, 0.0))

    def cache_room(self, engine_id: str, min_requests: int) -> int:
        return self.rooms.get(engine_id, 1 << 40)


def ctx(
    key_len: int = KEY_LEN, *, session: str | None = None, slo: Slo | None = None, group: int = 1
) -> RequestContext:
    req = RouteRequest(
        "r1",
        "m",
        b"k" * key_len,
        key_len // 4,
        100,
        session=session,
        **({"slo": slo} if slo else {}),
    )
    return RequestContext(req, key_len, group)


def p_ms(matched: int, key_len: int = KEY_LEN) -> float:
    cached = matched // 4
    return PROFILE.prefill_ms(max(key_len // 4 - cached, 1), cached)


# ---------------------------------------------------------------------- e2


def test_registry_is_the_only_list_and_names_match() -> None:
    for key, (cls, config_cls) in POLICIES.items():
        policy = make_policy(key)
        assert policy.name == key == cls.name
        assert cls.__module__ == f"router.policies.{key}"
        assert config_cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        # the formula, in the module's docstring (read from source: a compiled build drops it)
        source = Path(policies_pkg.__file__).with_name(f"{key}.py")
        assert len(ast.get_docstring(ast.parse(source.read_text())) or "") > 100
    with pytest.raises(PolicyError, match="unknown policy"):
        make_policy("nope")
    with pytest.raises(PolicyError, match="unknown option"):
        make_policy("e2", {"rebalanse": False})


def test_e2_exploits_a_holder_whose_queue_is_short() -> None:
    view = FakeView([ev("a"), ev("b"), ev("c")], matched={"a": 39_000, "b": 20_000})
    d = make_policy("e2").choose(ctx(), view, 0.0)
    assert (d.engine_id, d.reason, d.matched_bytes) == ("a", "exploit", 39_000)
    by_id = {c.engine_id: c for c in d.candidates}
    assert by_id["a"].prefill_ms == pytest.approx(p_ms(39_000))
    # c's whole prefill, twice (its TTFT and its work), is past a's cost: never estimated
    assert "c" not in by_id
    d = make_policy("e2", {"bound_skip": False}).choose(ctx(), view, 0.0)
    assert d.engine_id == "a"
    assert {c.engine_id: c for c in d.candidates}["c"].prefill_ms == pytest.approx(p_ms(0))


def test_e2_bound_skip_prices_eviction_early_but_keeps_the_band_s_order() -> None:
    """Scoring lowest bound first prices the eviction term of an engine the band would price
    too; the band still orders its engines by their cost before it, so a tie between two
    engines that both evict resolves through the rng exactly as when every engine is scored.
    a: the cheaper before its eviction; b: 20-odd ms of foreign queue, no eviction cost."""
    queued = next(n for n in range(10, 5_000, 10) if PROFILE.prefill_ms(n) > 20.0)
    engines = [ev("a", free=0), ev("b", free=0, hb=_hb(queued=queued))]
    for seed in range(16):
        picks = []
        for skip in (True, False):
            view = FakeView(engines, evictions={"a": 60.0}, rng=random.Random(seed))
            picks.append(make_policy("e2", {"bound_skip": skip}).choose(ctx(), view, 0.0).engine_id)
        assert picks[0] == picks[1], seed


def test_e2_explores_when_the_holders_queue_costs_more_than_prefilling_elsewhere() -> None:
    queued = _hb(queued=25_000)  # ~3 s of prefill ahead of the request on a
    view = FakeView([ev("a", hb=queued), ev("b")], matched={"a": 39_000})
    d = make_policy("e2").choose(ctx(), view, 0.0)
    assert (d.engine_id, d.reason) == ("b", "explore")
    by_id = {c.engine_id: c for c in d.candidates}
    assert by_id["a"].load_ms == pytest.approx(PROFILE.prefill_ms(25_000))
    assert by_id["b"].total_ms == pytest.approx(p_ms(0))  # TTFT: its own prefill
    # a shorter queue there: the cached prefix is worth the wait again
    view = FakeView([ev("a", hb=_hb(queued=5_000)), ev("b")], matched={"a": 39_000})
    assert make_policy("e2").choose(ctx(), view, 0.0).engine_id == "a"


def test_e2_counts_the_gpu_time_a_decode_batch_takes_from_prefill() -> None:
    # a: nothing queued, but 20 requests of 12k context decoding under a 100 ms TPOT SLO: each
    # step spends ~61 ms of its 90 ms budget decoding, so prefill runs at a third of its speed
    busy = ev("a", inflight=20, open_ctx=20 * 12_000.0, decoding=20, decode_ctx=20 * 12_000.0,
              tpot_min=100.0)  # fmt: skip
    share = prefill_share(busy)
    step = PROFILE.decode_step_ms(20, 12_000)
    assert share == pytest.approx(1 - step / 90.0)
    view = FakeView([busy, ev("b", load=5_000.0)], matched={"a": 8_000})
    d = make_policy("e2").choose(ctx(), view, 0.0)
    assert d.engine_id == "b"
    by_id = {c.engine_id: c for c in d.candidates}
    assert by_id["a"].prefill_ms == pytest.approx(p_ms(8_000) / share)
    # the fitted speed scales the decode step too: a twice-as-fast decoder leaves more
    assert prefill_share(replace(busy, decode_scale=0.5)) > share


def test_relaxed_tpot_decoders_take_less_of_the_gpu_from_prefill() -> None:
    # the same 20 decoders, but with a 200 ms TPOT SLO beside one 100 ms request: SCORPIO
    # decodes each in every other step, so the steps are cut to 90 ms around a batch of 11
    mixed = ev("a", inflight=21, open_ctx=21 * 12_000.0, decoding=21, decode_ctx=21 * 12_000.0,
               tpot_min=100.0)  # fmt: skip
    mixed = replace(mixed, open_tpot_min_ms=100.0, open_inv_tpot=1 / 100.0 + 20 / 200.0)
    step = PROFILE.decode_step_ms(11, 12_000)
    assert prefill_share(mixed) == pytest.approx(1 - step / 90.0)
    # counted as 21 full members (the rule before), prefill would get much less
    uniform = replace(mixed, open_inv_tpot=21 / 100.0)
    assert prefill_share(uniform) < prefill_share(mixed) - 0.1


def test_requests_past_the_vbs_capacity_wait_without_slowing_prefill() -> None:
    # 200 requests in flight at 12K tokens of context, 10 decoding: SCORPIO's admission starts
    # no more than the batch it decodes within 100 ms x 0.99 / 1.3, so the steps never carry
    # more, and prefill keeps what that batch leaves (the rest wait for admission)
    crowded = ev("a", inflight=200, open_ctx=200 * 12_000.0, decoding=10,
                 decode_ctx=10 * 12_000.0, tpot_min=100.0)  # fmt: skip
    crowded = replace(crowded, open_tpot_min_ms=100.0, open_inv_tpot=200 / 100.0)
    cap = batch_capacity(crowded, 12_000.0, 100.0)
    assert 10 < cap < 200
    full = 1 - PROFILE.decode_step_ms(cap, 12_000) / 90.0
    assert prefill_share(crowded) == pytest.approx(full)
    assert prefill_share(crowded) > 0.15  # (uncapped, 200 decoders: the 0.05 floor)
    # below the capacity, every request in flight counts
    fewer = replace(crowded, inflight=cap - 1, open_ctx_tokens=(cap - 1) * 12_000.0,
                    open_inv_tpot=(cap - 1) / 100.0)  # fmt: skip
    assert prefill_share(fewer) == pytest.approx(1 - PROFILE.decode_step_ms(cap - 1, 12_000) / 90.0)


@dataclass
class _RoutedOnly(FakeView):
    """Engines hold ``matched`` only as the router's speculative entries (no block event yet),
    and each has one open request due later than the request asked about."""

    @property
    def confirmed(self) -> dict[str, int]:
        return {}

    def prefill_queue(
        self, ev: EngineView, deadline: float, share: float = 1.0
    ) -> tuple[float, int, float]:
        ahead = self.prefill_ahead_ms(ev, deadline)
        return ahead, 1, ahead


def test_a_request_overtaking_the_prefix_it_was_routed_after_prefills_it_once() -> None:
    # "a" was sent 8 KB of this key a moment ago; this request is due before that one, so it
    # prefills the prefix itself (its TTFT counts all of it), but the one it overtakes then
    # finds it cached: the work it adds to "a" is only what the prefix leaves
    view = _RoutedOnly([ev("a"), ev("b")], matched={"a": 8_000})
    est = estimate(view.engines[0], ctx(), 8_000, view, 0.0, {}, view.confirmed.get("a", 0))
    assert est.own_ms == pytest.approx(p_ms(0))
    assert est.own_work_ms == pytest.approx(p_ms(8_000))
    assert est.credited == 0
    # where nothing was routed, its work is its whole prefill
    other = estimate(view.engines[1], ctx(), 0, view, 0.0, {}, 0)
    assert other.own_work_ms == other.own_ms == pytest.approx(p_ms(0))
    # behind the request computing the prefix (due before it), it finds the prefix cached
    view.ahead = {"a": 8_000}
    est = estimate(view.engines[0], ctx(), 8_000, view, 0.0, {}, 0)
    assert est.credited == 8_000
    assert est.own_ms == est.own_work_ms == pytest.approx(p_ms(8_000))


def test_e2_tie_band_prefers_the_holder_then_the_least_loaded() -> None:
    # a holds 4 KiB of the key but has a little queued: its cost (TTFT + the GPU time of its
    # own prefill) is a few ms above b's
    p_a, p_b = p_ms(4096), p_ms(0)
    queued = 0
    while PROFILE.prefill_ms(queued) + 2 * p_a < 2 * p_b + 20:  # until a is 20-40 ms dearer
        queued += 16
    view = FakeView([ev("a", hb=_hb(queued=queued)), ev("b")], matched={"a": 4096})
    d = make_policy("e2").choose(ctx(), view, 0.0)
    assert d.engine_id == "a"  # within 5% + 5 ms: keep the prefix's requests together
    strict = make_policy("e2", {"tie_rel": 0.0, "tie_ms": 0.0})
    assert strict.choose(ctx(), view, 0.0).engine_id == "b"  # no band: the cheapest
    # equal costs, equal matches: the least outstanding work, not always the first engine
    view = FakeView([ev("a", load=900.0), ev("b", load=100.0), ev("c", load=500.0)])
    assert make_policy("e2").choose(ctx(), view, 0.0).engine_id == "b"


def test_e2_idle_free_leaves_an_idle_engine_s_gpu_time_uncharged() -> None:
    # a holds 4 KiB of the key behind a queue about as long as b's whole prefill; a saves the
    # prefix's prefill, so by default the GPU time it spares wins; with idle_free b's GPU has
    # nothing else to do, so its time delays nobody and b's sooner first token wins
    p_a, p_b = p_ms(4096), p_ms(0)
    queued = 16
    while PROFILE.prefill_ms(queued) + p_a < p_b:
        queued += 16
    view = FakeView([ev("a", hb=_hb(queued=queued)), ev("b")], matched={"a": 4096})
    assert make_policy("e2").choose(ctx(), view, 0.0).engine_id == "a"
    idle_free = make_policy("e2", {"idle_free": True})
    assert idle_free.choose(ctx(), view, 0.0).engine_id == "b"
    # b not idle (a request in flight there), or without room for the request (it would
    # evict): its prefill's GPU time counts again
    busy_b = FakeView([ev("a", hb=_hb(queued=queued)), ev("b", inflight=1)], matched={"a": 4096})
    assert idle_free.choose(ctx(), busy_b, 0.0).engine_id == "a"
    full_b = FakeView([ev("a", hb=_hb(queued=queued)), ev("b", free=0)], matched={"a": 4096})
    assert idle_free.choose(ctx(), full_b, 0.0).engine_id == "a"


def test_e2_ties_go_where_the_least_traffic_goes() -> None:
    # three engines equally cheap now (a short prompt: the recent rates' arrivals cost little);
    # "a" is idle at this instant but has taken most of the recent traffic (a hot prefix lives
    # there), "c" the least: a prefix nobody holds goes to c, as its later requests follow it
    engines = [
        replace(ev("a", load=0.0), rate_per_s=4.0),
        replace(ev("b", load=300.0), rate_per_s=2.0),
        replace(ev("c", load=600.0), rate_per_s=1.0),
    ]
    short = ctx(400)
    assert make_policy("e2").choose(short, FakeView(engines), 0.0).engine_id == "c"
    # the order before (outstanding work first) sends it to the hot engine
    by_load = make_policy("e2", {"spread_by_traffic": False})
    assert by_load.choose(short, FakeView(engines), 0.0).engine_id == "a"
    # holding the most of the key still comes first: a and b hold it, c does not
    view = FakeView(engines, matched={"a": 256, "b": 256})
    assert make_policy("e2").choose(short, view, 0.0).engine_id == "b"
    assert by_load.choose(short, view, 0.0).engine_id == "a"
    # the rate is weighed by this request's prefill there: a twice-slower engine with 0.7x
    # the traffic is busier for its speed (a wide band, so that both are in it)
    slow = replace(engines[2], rate_per_s=1.4, prefill_scale=2.0)
    wide = make_policy("e2", {"tie_rel": 2.0})
    assert wide.choose(short, FakeView([engines[1], slow]), 0.0).engine_id == "b"
    assert wide.choose(short, FakeView([engines[1], engines[2]]), 0.0).engine_id == "c"


def test_e2_ties_go_by_traffic_only_among_engines_with_room_for_the_key() -> None:
    # the quietest engine, c, has no free KV left for the 400 new bytes: a new prefix there
    # evicts (the quietest engine would collect every new prefix and thrash); an engine with
    # room comes first, by its traffic
    engines = [
        replace(ev("a", load=0.0), rate_per_s=4.0),
        replace(ev("b", load=300.0), rate_per_s=2.0),
        replace(ev("c", load=600.0, free=399), rate_per_s=1.0),
    ]
    short = ctx(400)
    assert make_policy("e2").choose(short, FakeView(engines), 0.0).engine_id == "b"
    # exactly room enough: c again
    engines[2] = replace(engines[2], free_bytes=400)
    assert make_policy("e2").choose(short, FakeView(engines), 0.0).engine_id == "c"
    # no engine with room (full caches, as on vLLM, which keeps freed blocks cached): the
    # least outstanding work, whatever the traffic
    full = [replace(e, free_bytes=0) for e in engines]
    assert make_policy("e2").choose(short, FakeView(full), 0.0).engine_id == "a"
    # b's free KV is about to be written by the prefills routed there and not done yet (their
    # blocks are not announced): no room there either, and b's traffic no longer puts it first
    # (counted as free, a burst of new prefixes all went to the engine that looked empty)
    busy_b = [
        engines[0],
        replace(engines[1], unannounced_bytes=1 << 30),
        replace(engines[2], free_bytes=399),
    ]
    assert make_policy("e2").choose(short, FakeView(busy_b), 0.0).engine_id == "a"


def test_e2_eviction_term_prices_what_fitting_the_request_evicts() -> None:
    engines = [ev("b", load=10.0), ev("c", free=0)]
    view = FakeView(engines, evictions={"c": 1000.0})
    d = make_policy("e2").choose(ctx(), view, 0.0)
    assert d.engine_id == "b"
    assert {c.engine_id: c.eviction_ms for c in d.candidates}["c"] == 1000.0
    no_m = make_policy("e2", {"eviction_term": False})
    # a tie on TTFT: the one with room for the key, else the less loaded
    assert no_m.choose(ctx(), view, 0.0).engine_id == "b"
    both_full = FakeView([ev("b", load=10.0, free=0), ev("c", free=0)], evictions={"c": 1000.0})
    assert no_m.choose(ctx(), both_full, 0.0).engine_id == "c"


def test_e2_prices_a_miss_at_one_slo() -> None:
    """An engine where the request cannot meet its TTFT SLO is charged the SLO itself: a
    cheaper engine where it would miss loses to one that can meet it, unless that one costs
    others more than an SLO's worth (here: what fitting the key evicts there)."""
    slo = Slo(ttft_ms=2000.0, tpot_ms=100.0)

    def view(evicts_ms: float) -> FakeView:
        # a: ~2.7 s to its first token (past the SLO); b: ~1.7 s, but it evicts to fit the key
        engines = [ev("a", hb=_hb(queued=12_000)), ev("b", free=0, hb=_hb(queued=4_000))]
        return FakeView(engines, evictions={"b": evicts_ms})

    # (the cost alone: where the tie band holds only engines expected late, the doomed
    # request's rule decides, below)
    by_cost = make_policy("e2", {"doomed_to_holder": False})
    no_miss = make_policy("e2", {"miss_penalty": 0.0, "doomed_to_holder": False})
    assert no_miss.choose(ctx(slo=slo), view(2500.0), 0.0).engine_id == "a"  # the cheaper
    assert by_cost.choose(ctx(slo=slo), view(2500.0), 0.0).engine_id == "b"
    assert make_policy("e2").choose(ctx(slo=slo), view(2500.0), 0.0).engine_id == "b"
    # a miss weighs one SLO, not more: evicting 5 s of others' prefills there costs more
    assert by_cost.choose(ctx(slo=slo), view(5000.0), 0.0).engine_id == "a"
    # ... but the cheapest is then a request lost: on S-EDF engines it goes where its first
    # token could come soonest, its best chance (docs/router.md, *Sixty-fourth session*)
    assert make_policy("e2").choose(ctx(slo=slo), view(5000.0), 0.0).engine_id == "b"
    with pytest.raises(ValueError, match="miss_penalty"):
        make_policy("e2", {"miss_penalty": -1.0})


def test_e2_sends_a_request_no_engine_can_serve_in_time_to_the_holder_of_its_key() -> None:
    """Expected past its TTFT SLO everywhere (but not far enough past to shed) on S-EDF engines,
    which refuse it while it waits, a request goes among the engines holding the most of its
    key, not to the cheapest: it is lost wherever it goes, and at the holder its key stays in
    one place. Where some engine can meet the SLO, the cost decides as ever."""
    slo = Slo(ttft_ms=2000.0, tpot_ms=100.0)

    def view(queued_b: int) -> FakeView:
        # a holds the key behind ~3.6 s of queue; b holds none of it
        engines = [ev("a", hb=_hb(queued=30_000)), ev("b", hb=_hb(queued=queued_b))]
        return FakeView(engines, matched={"a": 39_000})

    by_cost = make_policy("e2", {"doomed_to_holder": False})
    d = by_cost.choose(ctx(slo=slo), view(8_000), 0.0)  # b: ~2.2 s, past the SLO too
    assert d.engine_id == "b"
    assert min(c.total_ms for c in d.candidates) > slo.ttft_ms
    d = make_policy("e2").choose(ctx(slo=slo), view(8_000), 0.0)
    assert (d.engine_id, d.reason, d.shed) == ("a", "exploit", False)
    # b can meet it (~1.8 s): the cheapest, the holder's key notwithstanding
    assert make_policy("e2").choose(ctx(slo=slo), view(5_000), 0.0).engine_id == "b"
    # c could meet it too (nothing queued), but fitting the key there evicts 10 s of others'
    # prefills: out of the tie band, which holds only b, late. Lost where the cost would send
    # it, it goes to the holder (before the fifty-ninth session only a request late everywhere
    # did)
    spare = view(8_000)
    spare.engines.append(ev("c", free=0))
    spare.evictions["c"] = 10_000.0
    d = by_cost.choose(ctx(slo=slo), spare, 0.0)
    assert d.engine_id == "b"
    ttft = {c.engine_id: c.load_ms + c.prefill_ms for c in d.candidates}
    assert ttft["c"] < slo.ttft_ms < ttft["b"]
    assert make_policy("e2").choose(ctx(slo=slo), spare, 0.0).engine_id == "a"
    # engines serving in arrival order run a late request ahead of the ones behind it: there
    # the cost decides (it does not refuse the request, so it is not lost at no one's cost)
    fifo = view(8_000)
    fifo.engines = [replace(e, arrival_order=True) for e in fifo.engines]
    d = make_policy("e2").choose(ctx(slo=slo), fifo, 0.0)
    assert d.engine_id == by_cost.choose(ctx(slo=slo), fifo, 0.0).engine_id == "b"


def test_e2_sends_a_doomed_request_where_its_first_token_could_come_soonest() -> None:
    """Expected past its TTFT SLO everywhere and its key held nowhere, on S-EDF engines (which
    refuse it while it waits, at no one's cost), a request goes where its first token could come
    soonest, its best chance, not to the engine whose cost is lowest: the work term there is
    others' delay had it run, and a late request there does not run."""
    slo = Slo(ttft_ms=2000.0, tpot_ms=100.0)
    # a: ~2.7 s to its first token, quiet; b: ~2.2 s, but taking many requests (its work term is
    # dear)
    a = ev("a", hb=_hb(queued=12_000))
    b = replace(ev("b", hb=_hb(queued=8_000)), rate_per_s=40.0, prefill_rate=500.0)
    view = FakeView([a, b])
    by_cost = make_policy("e2", {"doomed_to_holder": False})
    d = by_cost.choose(ctx(slo=slo), view, 0.0)
    assert d.engine_id == "a"
    ttft = {c.engine_id: c.load_ms + c.prefill_ms for c in d.candidates}
    assert slo.ttft_ms < ttft["b"] < ttft["a"]
    assert make_policy("e2").choose(ctx(slo=slo), view, 0.0).engine_id == "b"
    # where b could meet it, the cost decides as ever
    view = FakeView([a, replace(b, heartbeat=_hb(queued=1_000))])
    assert make_policy("e2").choose(ctx(slo=slo), view, 0.0).engine_id == "b"


def test_e2_slo_filter_sheds_only_far_beyond_the_slo() -> None:
    slo = Slo(ttft_ms=2000.0, tpot_ms=100.0)
    # b meets the SLO but would evict a lot; a is cheaper in TTFT + M but misses the SLO
    engines = [ev("a", hb=_hb(queued=12_000)), ev("b", free=0, hb=_hb(queued=4_000))]
    view = FakeView(engines, evictions={"b": 5000.0})
    by_cost = make_policy("e2", {"doomed_to_holder": False})
    assert by_cost.choose(ctx(slo=slo), view, 0.0).engine_id == "a"  # the cheapest
    # (the tie band holds only a, expected late: the request goes where it could be served
    # soonest)
    assert make_policy("e2").choose(ctx(slo=slo), view, 0.0).engine_id == "b"
    feasible_first = make_policy("e2", {"prefer_feasible": True})
    assert feasible_first.choose(ctx(slo=slo), view, 0.0).engine_id == "b"
    # nobody meets it, but the best is within 1.5x the SLO: routed there, not shed
    engines = [ev("a", hb=_hb(queued=13_000)), ev("b", hb=_hb(queued=30_000))]
    d = make_policy("e2").choose(ctx(slo=slo), FakeView(engines), 0.0)
    assert d.engine_id == "a"
    # beyond 1.5x everywhere: shed, naming where it would have gone
    engines = [ev("a", hb=_hb(queued=40_000)), ev("b", hb=_hb(queued=30_000))]
    d = make_policy("e2").choose(ctx(slo=slo), FakeView(engines), 0.0)
    assert d.shed and d.reason == "shed" and d.engine_id is None and d.fallback == "b"
    assert 0.5 <= d.retry_after_s <= 30.0
    lenient = make_policy("e2", {"shed_factor": 3.0})
    assert lenient.choose(ctx(slo=slo), FakeView(engines), 0.0).engine_id == "b"
    # baselines can opt in to the same filter (without the margin)
    d = make_policy("least_load", {"slo_filter": True}).choose(ctx(slo=slo), FakeView(engines), 0)
    assert d.shed


def test_a_busy_engine_stretches_the_wait_by_the_work_that_will_overtake() -> None:
    """S-EDF: later arrivals due sooner overtake a queued request, so its wait on a busy engine
    is a busy period, ``wait / (1 - busy x sooner)``; on an idle engine nothing stretches."""
    slo = Slo(ttft_ms=60_000.0, tpot_ms=100.0)
    # prefilling half of its time lately (500 ms of prefill a second)
    busy = replace(ev("busy", hb=_hb(queued=4_000)), rate_per_s=1.0, prefill_rate=500.0)
    quiet = ev("quiet", hb=_hb(queued=4_000))
    c = ctx(slo=slo)
    alone = estimate(busy, c, 0, FakeView([busy, quiet]), 0.0, {})
    wait = (alone.queue_ms + alone.own_ms) / alone.share
    assert wait > 0 and alone.ttft_ms == pytest.approx(wait + alone.admit_ms)
    mixed = FakeView([busy, quiet], sooner=0.8)
    overtaken = estimate(busy, c, 0, mixed, 0.0, {})
    assert overtaken.ttft_ms == pytest.approx(wait / (1 - 0.5 * 0.8) + alone.admit_ms)
    assert overtaken.arrivals == pytest.approx(alone.arrivals)  # (already a busy period)
    q = estimate(quiet, c, 0, mixed, 0.0, {})
    assert q.ttft_ms == pytest.approx((q.queue_ms + q.own_ms) / q.share + q.admit_ms)
    # however busy, at most 10x
    packed = replace(busy, prefill_rate=5_000.0)
    capped = estimate(packed, c, 0, FakeView([packed], sooner=1.0), 0.0, {})
    assert capped.ttft_ms == pytest.approx(10 * wait + alone.admit_ms)


def test_only_arrivals_due_sooner_overtake_so_a_long_wait_is_overtaken_by_tighter_slos() -> None:
    """A request arriving t ms later overtakes only with an SLO shorter by t: over a wait W
    the overtakers are the traffic whose SLO is shorter than this one's minus W / 2 (asked of
    the fleet's SLO mix), not minus nothing (the upper bound, measured worse)."""
    slo = Slo(ttft_ms=10_000.0, tpot_ms=100.0)
    short = ev("short", hb=_hb(queued=0))
    long = ev("long", hb=_hb(queued=40_000))
    view = FakeView([short, long])
    for e in (short, long):
        est = estimate(e, ctx(slo=slo), 0, view, 0.0, {})
        wait = (est.queue_ms + est.own_ms) / est.share
        assert view.asked[-1] == pytest.approx(slo.ttft_ms - wait / 2)
    assert view.asked[0] > view.asked[1]  # the longer queue: only tighter SLOs overtake it


def test_a_decode_delays_the_engine_s_prefills_priced_as_their_misses() -> None:
    """Each ms of a request's decode is a ms every prefill on its engine waits, the ones due
    sooner too: ``decode_ms x busy / (1 - busy)``, each delay ``d`` to a prefill of SLO ``s`` a
    miss with a chance of ``d / s``, priced at this request's SLO: ``x SLO x`` the mean ``1 /
    SLO`` of the engine's prefill work. Nothing where no prefill was routed lately."""
    slo = Slo(ttft_ms=8_000.0, tpot_ms=100.0)
    # prefilling half of its time lately, all of it for requests due within 250 ms
    tight = replace(ev("tight"), rate_per_s=2.0, prefill_rate=500.0, prefill_slo_rate=2.0)
    c = ctx(slo=slo)
    est = estimate(tight, c, KEY_LEN, FakeView([tight]), 0.0, {})
    mine = KEY_LEN // 4 + 100 / 2  # its mean context while it decodes (100 tokens out)
    decode_ms = 100 * (PROFILE.decode_a * mine + PROFILE.decode_b)
    busy = 0.5 / est.share
    expected = decode_ms * busy / (1 - busy) * 8_000.0 * (2.0 / 500.0)
    assert est.busy == pytest.approx(busy)
    assert est.decode_delay_ms == pytest.approx(expected)
    # the same work due within 8 s: a thirty-second of it; a quiet engine: none
    loose = replace(tight, prefill_slo_rate=500.0 / 8_000.0)
    assert estimate(loose, c, KEY_LEN, FakeView([loose]), 0.0, {}).decode_delay_ms == (
        pytest.approx(expected / 32)
    )
    quiet = ev("quiet")
    assert estimate(quiet, c, KEY_LEN, FakeView([quiet]), 0.0, {}).decode_delay_ms == 0.0


def test_e2_sends_a_long_decode_to_the_holder_whose_prefills_are_due_late() -> None:
    """Of the engines holding as much of the key, the one whose prefills a long-context decode
    delays least, though the other is cheaper by the cost: an agent prompt held everywhere
    gathers on the engines serving requests due late and leaves the others to those due soon.
    An engine holding less of the key is never taken for it (the holder question is the
    cost's)."""
    slo = Slo(ttft_ms=8_000.0, tpot_ms=100.0)
    common = {"rate_per_s": 2.0, "prefill_rate": 500.0}
    lane = replace(ev("lane"), prefill_slo_rate=2.0, **common)  # (its prefills due in 250 ms)
    late = replace(ev("late", hb=_hb(queued=200)), prefill_slo_rate=500.0 / 8_000.0, **common)
    spare = ev("spare")  # (holds less of the key)
    view = FakeView([lane, late, spare], matched={"lane": KEY_LEN, "late": KEY_LEN})
    off = make_policy("e2", {"decode_delay": False}).choose(ctx(slo=slo), view, 0.0)
    assert off.engine_id == "lane"  # (cheaper: nothing queued)
    d = make_policy("e2").choose(ctx(slo=slo), view, 0.0)
    assert (d.engine_id, d.reason) == ("late", "exploit")
    # with both lanes' prefills due soon, the engine no prefill waits on (spare: its decode
    # delays nobody) is still not taken: it would prefill the whole key
    both = FakeView([lane, replace(late, prefill_slo_rate=2.0), spare], matched=view.matched)
    assert make_policy("e2").choose(ctx(slo=slo), both, 0.0).engine_id in ("lane", "late")
    assert estimate(spare, ctx(slo=slo), 0, both, 0.0, {}).decode_delay_ms == 0.0
    # holders of a short opening only (2k of the prompt's 10k tokens, as every engine holds a
    # trace's common first blocks): no lane, the cost decides (the request prefills most of
    # its prompt wherever it goes; ``busier``'s 1,000 tokens queued put it out of the
    # cheapest's band, where only the lane rule would reach it)
    busier = replace(ev("late", hb=_hb(queued=1_000)), prefill_slo_rate=500.0 / 8_000.0, **common)
    whole = FakeView([lane, busier], matched={"lane": KEY_LEN, "late": KEY_LEN})
    assert make_policy("e2").choose(ctx(slo=slo), whole, 0.0).engine_id == "late"
    short = FakeView([lane, busier], matched={"lane": 8_192, "late": 8_192})
    assert KEY_LEN > 2 * 8_192
    assert make_policy("e2").choose(ctx(slo=slo), short, 0.0).engine_id == "lane"
    # a first token due between the two holders' expected ones: the lane is not bought with
    # the request's own SLO (every engine holding a shared prefix is a holder, and the lane
    # rule had sent requests from an engine expected in time to one expected late)
    # (both prefilling 90% of their time lately)
    busy = {"rate_per_s": 2.0, "prefill_rate": 900.0}
    lane, late = replace(lane, **busy), replace(late, **busy, prefill_slo_rate=900.0 / 8_000.0)
    view = FakeView([lane, late], matched={"lane": KEY_LEN, "late": KEY_LEN})
    ttft = {e.engine_id: estimate(e, ctx(), KEY_LEN, view, 0.0, {}).ttft_ms for e in (lane, late)}
    tight = Slo(ttft_ms=(ttft["lane"] + ttft["late"]) / 2, tpot_ms=100.0)
    est = {e.engine_id: estimate(e, ctx(slo=tight), KEY_LEN, view, 0.0, {}) for e in (lane, late)}
    assert est["lane"].ttft_ms < tight.ttft_ms < est["late"].ttft_ms
    # (the delay there outweighs the lane's lead: only the expected miss keeps it)
    assert est["lane"].decode_delay_ms > 3 * tight.ttft_ms > 3 * est["late"].decode_delay_ms
    assert make_policy("e2").choose(ctx(slo=tight), view, 0.0).engine_id == "lane"


def test_e2_leaves_a_busy_engine_whose_queue_will_be_overtaken() -> None:
    """A shorter queue on an engine that prefills 90% of its time is no shorter wait
    when most of the traffic is due sooner than this request (4,000 against 8,000 tokens queued)."""
    slo = Slo(ttft_ms=60_000.0, tpot_ms=100.0)
    busy = replace(ev("a", hb=_hb(queued=4_000)), rate_per_s=1e-6, prefill_rate=900.0)
    idle = ev("b", hb=_hb(queued=8_000))
    e2 = make_policy("e2")
    assert e2.choose(ctx(slo=slo), FakeView([busy, idle]), 0.0).engine_id == "a"
    assert e2.choose(ctx(slo=slo), FakeView([busy, idle], sooner=0.9), 0.0).engine_id == "b"


def test_e2_sheds_on_the_soonest_the_first_token_could_come() -> None:
    """Overtakers stretch the expected wait far past the SLO, but with none the first token
    could still come within 1.5x of it: shedding is final, so the request is routed."""
    slo = Slo(ttft_ms=2000.0, tpot_ms=100.0)
    a = replace(ev("a", hb=_hb(queued=12_000)), rate_per_s=1e-6, prefill_rate=900.0)
    view = FakeView([a], sooner=1.0)
    est = estimate(a, ctx(slo=slo), 0, view, 0.0, {})
    assert est.ttft_floor_ms <= 1.5 * slo.ttft_ms < 2 * slo.ttft_ms < est.ttft_ms
    assert make_policy("e2").choose(ctx(slo=slo), view, 0.0).engine_id == "a"
    # admission control on the expected TTFT (opt-in): shed
    d = make_policy("e2", {"shed_expected": True}).choose(ctx(slo=slo), view, 0.0)
    assert d.shed and d.fallback == "a"
    # the baselines' filter (no margin) likewise: a shorter queue that could make the SLO
    b = replace(
        a,
        engine_id="b",
        heartbeat=_hb(queued=4_000),
        queued_prefill_ms=queued_prefill_ms(PROFILE, _hb(queued=4_000), 0),
    )
    view = FakeView([b], sooner=1.0)
    est = estimate(b, ctx(slo=slo), 0, view, 0.0, {})
    assert est.ttft_floor_ms <= slo.ttft_ms < est.ttft_ms
    d = make_policy("least_load", {"slo_filter": True}).choose(ctx(slo=slo), view, 0)
    assert d.engine_id == "b"


def test_the_shed_floor_counts_only_what_decodes_now() -> None:
    """Routing counts every request in flight in the decode batch (most queue ahead of a
    typical request), but an urgent one overtakes the queued ones: the soonest its first token
    could come meets only today's decoders, so a saturated engine's admission wait does not
    get it shed."""
    slo = Slo(ttft_ms=1000.0, tpot_ms=100.0)
    a = ev("a", inflight=40, open_ctx=40 * 12_000.0, decoding=4, decode_ctx=4 * 12_000.0,
           tpot_min=100.0)  # fmt: skip
    a = replace(a, open_tpot_min_ms=100.0, open_inv_tpot=40 / 100.0, decode_inv_tpot=4 / 100.0)
    view = FakeView([a], releases={"a": 3000.0})
    c = ctx(key_len=4_000, slo=slo)
    est = estimate(a, c, 0, view, 0.0, {})
    assert est.ttft_ms > 3000.0  # routing: a full virtual batch to wait for
    step = PROFILE.decode_step_ms(4, 12_000)
    own = PROFILE.prefill_ms(1_000)
    assert est.ttft_floor_ms == pytest.approx(own / (1 - step / 90.0) + step)
    assert est.ttft_floor_ms < slo.ttft_ms
    assert make_policy("e2").choose(c, view, 0.0).engine_id == "a"


def test_e2_skips_engines_too_slow_to_decode_the_request_at_its_tpot() -> None:
    # a 30 ms TPOT on a 10k-token context: ~21 ms a step alone (x1.3 = 27 < 29.7) on the
    # profile; an engine whose decode is fitted 1.5x slower cannot do it, however idle
    slo = Slo(ttft_ms=60_000.0, tpot_ms=30.0)
    slow = ev("slow", decode_scale=1.5)
    view = FakeView([slow, ev("fast", hb=_hb(queued=8_000))])
    d = make_policy("e2").choose(ctx(slo=slo), view, 0.0)
    assert d.engine_id == "fast"
    assert not {c.engine_id: c for c in d.candidates}["slow"].feasible
    d = make_policy("e2").choose(ctx(slo=slo), FakeView([slow]), 0.0)
    assert d.shed and d.fallback is None


def test_e2_waits_for_vbs_admission_on_a_full_decoder() -> None:
    # a's virtual batch is full for a 100 ms TPOT: the request would wait for a decoding one
    # to finish (the view says 3 s); b has a queue of ~1.2 s
    slo = Slo(ttft_ms=60_000.0, tpot_ms=100.0)
    full = ev("a", inflight=40, open_ctx=40 * 12_000.0, hb=_hb(vbs=40.0, running=40))
    view = FakeView([full, ev("b", hb=_hb(queued=10_000))], releases={"a": 3000.0})
    d = make_policy("e2").choose(ctx(slo=slo), view, 0.0)
    assert d.engine_id == "b"
    by_id = {c.engine_id: c for c in d.candidates}
    waited = by_id["a"].load_ms  # the wait, and the decode step its first slice follows
    assert waited >= 3000.0
    view.releases["a"] = 10.0  # a slot frees at once: no wait, but a full batch is congested
    d = make_policy("e2").choose(ctx(slo=slo), view, 0.0)
    assert waited - {c.engine_id: c for c in d.candidates}["a"].load_ms == pytest.approx(2990.0)


def test_a_request_waits_for_a_decode_place_only_behind_the_requests_run_before_it() -> None:
    """S-EDF admits a request due sooner before the ones queued due later, so its wait for a
    place in the decode batch counts only the requests ahead of it; the place it then takes
    delays the ones it overtook, which its cost still charges, and a short context beside long
    ones takes a fraction of one of their places."""
    slo = Slo(ttft_ms=60_000.0, tpot_ms=100.0)
    full = replace(
        ev("a", inflight=40, open_ctx=40 * 12_000.0, hb=_hb(vbs=40.0, running=40)),
        rate_per_s=5.0,
    )
    line = FakeView([full], releases={"a": 3000.0})
    waits = estimate(full, ctx(slo=slo), 0, line, 0.0, {})
    assert waits.admit_ms >= 3000.0
    # 30 of the 40 are queued due later: the 10 ahead of it leave it a place at once
    first = FakeView([full], releases={"a": 3000.0}, behind={"a": 30})
    jumps = estimate(full, ctx(slo=slo), 0, first, 0.0, {})
    assert jumps.admit_ms < 1000.0
    assert jumps.ttft_ms < waits.ttft_ms - 2000.0
    # ... but its place delays the 30 it overtook, and the requests arriving while they wait
    assert jumps.decode_harm == pytest.approx(waits.decode_harm)
    short = estimate(full, ctx(key_len=400, slo=slo), 0, first, 0.0, {})
    assert 0.0 < short.decode_harm < jumps.decode_harm / 5


def test_a_place_in_a_full_decode_batch_is_charged_to_the_requests_waiting_for_one() -> None:
    """Where requests wait for a place in the decode batch (SCORPIO's admission), the place a
    request takes delays every one that arrives before that line drains: the more requests the
    engine is taking, the dearer. A hot document's only holder with its batch full otherwise
    kept its requests (a prefill of a few ms there) at several times their TTFT SLO."""
    slo = Slo(ttft_ms=60_000.0, tpot_ms=100.0)
    full = ev("a", inflight=40, open_ctx=40 * 12_000.0, hb=_hb(vbs=40.0, running=40))
    view = FakeView([full], releases={"a": 3000.0})
    quiet = estimate(full, ctx(slo=slo), 0, view, 0.0, {})
    busy_view = FakeView([replace(full, rate_per_s=5.0)], releases={"a": 3000.0})
    busy = estimate(busy_view.engines[0], ctx(slo=slo), 0, busy_view, 0.0, {})
    assert quiet.admit_ms >= 3000.0 and busy.admit_ms == pytest.approx(quiet.admit_ms)
    # 5 requests a second over a 3 s wait: at least 15 later requests each wait one place more
    assert busy.decode_harm > 10 * quiet.decode_harm
    # no wait for a place: only the batch's fill is priced, whatever the rate
    free = FakeView([replace(full, rate_per_s=5.0)], releases={"a": 0.0})
    assert estimate(free.engines[0], ctx(slo=slo), 0, free, 0.0, {}).decode_harm == (
        pytest.approx(quiet.decode_harm)
    )
    # an engine serving in arrival order (vLLM) has no such admission: no place to charge
    fifo = FakeView([replace(full, rate_per_s=5.0, arrival_order=True)], releases={"a": 3000.0})
    assert estimate(fifo.engines[0], ctx(slo=slo), 0, fifo, 0.0, {}).decode_harm == (
        pytest.approx(quiet.decode_harm)
    )
    # so a document's admission-bound holder loses it to an engine that prefills it (b, as
    # busy, has a queue: its prefill there delays ~11 later requests, ~16 s in all; priced by
    # the batch's fill alone, the holder cost ~8 s)
    holder = replace(full, rate_per_s=5.0)
    other = replace(ev("b", hb=_hb(queued=8_000)), rate_per_s=5.0)
    view = FakeView([holder, other], matched={"a": 39_000}, releases={"a": 3000.0})
    assert make_policy("e2").choose(ctx(slo=slo), view, 0.0).engine_id == "b"
    view.releases["a"] = 0.0  # a place free at once: the holder keeps it
    assert make_policy("e2").choose(ctx(slo=slo), view, 0.0).engine_id == "a"


def test_requests_queued_but_not_decoding_yet_slow_the_prefill_behind_them() -> None:
    """In a burst nothing decodes yet where the router just sent eight requests, but each of
    them decodes while a request queued behind them prefills: prefill's share of the GPU is
    what their batch leaves, not all of it (taken as all of it, a flash crowd's TTFTs came
    out 2-3x the prediction). An engine with nothing in flight prefills at full speed."""
    queued = ev("a", inflight=8, open_ctx=8 * 2_000.0, tpot_min=100.0)
    assert decode_step_ms(queued) > 0.0
    assert 0.0 < prefill_share(queued) < 1.0
    idle = ev("b")
    assert decode_step_ms(idle) == 0.0 and prefill_share(idle) == 1.0
    slo = Slo(ttft_ms=60_000.0, tpot_ms=100.0)
    d = make_policy("e2").choose(ctx(slo=slo), FakeView([queued, idle]), 0.0)
    by_id = {c.engine_id: c for c in d.candidates}
    assert by_id["a"].prefill_ms > by_id["b"].prefill_ms  # the same prefill, a smaller share


def test_e2_prices_a_filling_decode_batch() -> None:
    # the same request on two idle engines, one with a decode batch near SCORPIO's limit for
    # its TPOT SLO (26 requests of 12k context at 100 ms): the request's decode costs more there
    slo = Slo(ttft_ms=60_000.0, tpot_ms=100.0)
    filling = ev("a", inflight=20, open_ctx=20 * 12_000.0)
    d = make_policy("e2").choose(ctx(slo=slo), FakeView([filling, ev("b", load=1.0)]), 0.0)
    assert d.engine_id == "b"
    d = make_policy("e2", {"work_weight": 0.0}).choose(
        ctx(slo=slo), FakeView([filling, ev("b", load=1.0)]), 0.0
    )
    assert d.engine_id == "a"  # without the work term: equal TTFT, the less loaded (a: load 0)


def test_e2_pd_balance_only_within_the_tie_band() -> None:
    engines = [ev("prefill", load=0.0, hit=0.1), ev("decode", load=300.0, hit=0.8)]
    d = make_policy("e2", {"pd_balance": True}).choose(ctx(), FakeView(engines), 0.0)
    assert (d.engine_id, d.reason) == ("decode", "pd_balance")
    off = make_policy("e2").choose(ctx(), FakeView(engines), 0.0)
    assert (off.engine_id, off.reason) == ("prefill", "explore")
    # a decode-heavy engine outside the band (a queue of its own) is not preferred
    engines[1] = ev("decode", load=300.0, hit=0.8, hb=_hb(queued=4_000))
    d = make_policy("e2", {"pd_balance": True}).choose(ctx(), FakeView(engines), 0.0)
    assert d.engine_id == "prefill"


def _rebalance_view(hi: float, lo: float, **kw) -> FakeView:
    return FakeView(
        [ev("busy", load=hi), ev("idle", load=lo), ev("mid", load=(hi + lo) / 2)],
        groups={
            "busy": [GroupLoad(11, hi * 0.3, 5), GroupLoad(12, hi * 0.2, 3), GroupLoad(13, 1.0, 1)]
        },
        **kw,
    )


REBALANCE = {"rebalance": True}


def test_e2_rebalancing_fires_at_1_5x_and_not_below() -> None:
    # Preble's ratio alone (the busiest against the least busy; the fleet's mean: below)
    e2 = make_policy("e2", REBALANCE | {"balance_trigger": 0.0})
    moves = e2.rebalance(ctx(), _rebalance_view(150.0, 100.0), 0.0)
    assert moves and moves[0].kind == "move"
    # group 12 (30 of the busiest's 150) leaves the two at 120 and 130; group 11 (45) would
    # leave them at 105 and 145
    assert (moves[0].group, moves[0].src, moves[0].dst) == (12, "busy", "idle")
    assert all(m.group != 13 for m in moves)  # a single request is not a prefix worth moving
    assert e2.rebalance(ctx(), _rebalance_view(149.9, 100.0), 0.0) == ()
    off = make_policy("e2", {"rebalance": False})
    assert off.rebalance(ctx(), _rebalance_view(300.0, 100.0), 0.0) == ()


def test_e2_rebalancing_waits_until_the_busiest_is_1_3x_the_fleet_s_mean() -> None:
    """Preble's trigger (the busiest engine 1.5x the least busy) fires whenever one engine is
    quiet, also when the busiest is no busier than most; each move prefills a prefix again on
    its new engine and spreads the churn of its requests' new blocks over another cache. So a
    move also waits until the busiest engine takes 1.3x the fleet's mean, by windowed load or
    by requests (the issue's load bound): in the closed-loop vLLM replica, moves 1.17 -> 0.81
    a run, hit rate 0.8411 -> 0.8435."""

    def view(loads: dict[str, float], requests: dict[str, int] | None = None) -> FakeView:
        return FakeView(
            [
                replace(ev(e, load=x), window_requests=(requests or {}).get(e, 25))
                for e, x in loads.items()
            ],
            groups={"busy": [GroupLoad(11, 20.0, 5), GroupLoad(12, 10.0, 3)]},
        )

    e2 = make_policy("e2", REBALANCE)
    # 150 against a quiet 100 (1.5x), but 1.12x the mean load and as many requests: no move
    loads = {"busy": 150.0, "idle": 100.0, "mid": 140.0, "mid2": 145.0}
    assert e2.rebalance(ctx(), view(loads), 0.0) == ()
    preble = make_policy("e2", REBALANCE | {"balance_trigger": 0.0})
    assert preble.rebalance(ctx(), view(loads), 0.0)  # Preble's ratio alone moves
    # the same loads, but 40 of 100 requests (1.6x a fair quarter: hits are cheap): a move
    many = view(loads, {"busy": 40, "idle": 20, "mid": 20, "mid2": 20})
    assert [(m.group, m.src, m.dst) for m in e2.rebalance(ctx(), many, 0.0)][:1] == [
        (11, "busy", "idle")
    ]
    # 150 against 100, 100 and 95: 1.35x the mean load, the heaviest group moves
    heavy = view({"busy": 150.0, "idle": 95.0, "mid": 100.0, "mid2": 100.0})
    assert [(m.group, m.src, m.dst) for m in e2.rebalance(ctx(), heavy, 0.0)][:1] == [
        (11, "busy", "idle")
    ]


def test_e2_rebalancing_compares_two_engines_output_on_one_clock() -> None:
    """Each engine's windowed load prices its output tokens at its own measured TPOT, which
    behind the vLLM bridge counts the prefill chunks in its steps: identical engines read 2x
    apart. Priced at one TPOT, two engines that took the same work are equally busy."""

    def view(tpot_busy: float, tpot_idle: float) -> FakeView:
        busy = replace(ev("busy"), window_ms=1000 * tpot_busy, window_out_tokens=1000)
        busy = replace(busy, tpot_ms=tpot_busy)
        idle = replace(ev("idle"), window_ms=1000 * tpot_idle, window_out_tokens=1000)
        idle = replace(idle, tpot_ms=tpot_idle)
        groups = {"busy": [GroupLoad(11, 300.0 * tpot_busy / 15, 5)]}
        return FakeView([busy, idle], groups=groups)

    e2 = make_policy("e2", REBALANCE)
    # 15 ms against 7 ms a token for the same 1,000 tokens: the same work, no move
    assert e2.rebalance(ctx(), view(15.0, 7.0), 0.0) == ()
    # the same TPOTs and 1,000 tokens against 400: a real imbalance still moves
    unequal = view(15.0, 7.0)
    unequal.engines[1] = replace(unequal.engines[1], window_ms=2800.0, window_out_tokens=400)
    moves = e2.rebalance(ctx(), unequal, 0.0)
    assert moves and (moves[0].src, moves[0].dst) == ("busy", "idle")


def test_e2_rebalancing_finds_the_least_busy_on_one_clock_too() -> None:
    """A live run behind the bridge (2026-11-29, its router view at the end): v1 took 138 of
    300 requests, its measured TPOT 4.4 ms (its steps mostly hits) against 5.9 and 6.7. The
    busiest was picked on one clock, but the least busy was then compared on each engine's own:
    6,668 ms against 4,996 (1.33x), no move, and v1 ended with 46% of the requests. On one
    clock it is 1.67x, and the gap a group must be lighter than is 3,000 ms, not 1,672."""

    def eng(engine_id: str, window_ms: float, out: int, tpot: float, requests: int):
        e = replace(ev(engine_id), window_ms=window_ms, window_out_tokens=out, tpot_ms=tpot)
        return replace(e, window_requests=requests)

    view = FakeView(
        [eng("v0", 4996.1, 664, 5.947, 83), eng("v1", 6667.9, 1104, 4.443, 138),
         eng("v2", 5230.0, 632, 6.714, 79)],
        groups={"v1": [GroupLoad(11, 2400.0, 40)]},
    )  # fmt: skip
    moves = make_policy("e2", REBALANCE).rebalance(ctx(), view, 0.0)
    assert [(m.group, m.src, m.dst) for m in moves] == [(11, "v1", "v0")]


def test_e2_rebalancing_waits_for_warmup_of_50_requests_an_engine_on_average() -> None:
    # 149 requests on 3 engines: still warming up
    view = _rebalance_view(300.0, 100.0)
    view.engines[:] = [ev("busy", load=300.0, routed=100), ev("idle", load=100.0, routed=0),
                       ev("mid", load=200.0, routed=49)]  # fmt: skip
    assert make_policy("e2", REBALANCE).rebalance(ctx(), view, 0.0) == ()
    # 150: warm, though the idle engine has had none (a layout that starves an engine is what
    # rebalancing is for; waiting for every engine to have 50 waited for ever there)
    view.engines[2] = ev("mid", load=200.0, routed=50)
    assert make_policy("e2", REBALANCE).rebalance(ctx(), view, 0.0)


def test_e2_moves_only_a_group_that_fits_in_the_least_busy_engine_s_cache() -> None:
    # group 11 (its key 3 KiB) does not fit in the idle engine's 2 KiB of room beside the
    # prefixes reused there; group 12 (1 KiB) does, and is moved instead
    view = _rebalance_view(150.0, 100.0)
    view.groups["busy"] = [GroupLoad(11, 45.0, 5, 3072), GroupLoad(12, 30.0, 3, 1024)]
    view.rooms["idle"] = 2048
    moves = make_policy("e2", REBALANCE).rebalance(ctx(), view, 0.0)
    assert [(m.group, m.dst) for m in moves] == [(12, "idle")]
    view.rooms["idle"] = 1000  # room for neither: no move
    assert make_policy("e2", REBALANCE).rebalance(ctx(), view, 0.0) == ()


def test_e2_moves_a_group_only_beside_every_prefix_reused_there() -> None:
    """A group moved onto a cache full of prefixes reused less often than it evicts one of
    them, but that prefix's requests still come there (it is held nowhere else) and evict
    another in turn: on the replica of the vLLM benchmark the engine holding the documents'
    cold tail thrashed. So the room a move needs is beside every prefix reused there."""

    class Reused(FakeView):
        def cache_room(self, engine_id: str, min_requests: int) -> int:
            # the idle engine: 4 KiB, three prefixes of 1 KiB reused 3 times each
            if engine_id != "idle":
                return 1 << 40
            reused = 3  # requests each of the three prefixes has there
            return 4096 - sum(1024 for _ in range(3) if reused >= min_requests)

    def view() -> Reused:
        engines = [ev("busy", load=300.0), ev("idle", load=100.0)]
        # group 11: reused 5 times, its key 2 KiB (more than the 1 KiB beside all three)
        return Reused(engines, groups={"busy": [GroupLoad(11, 60.0, 5, 2048)]})

    strict = make_policy("e2", REBALANCE | {"make_way": False})
    assert strict.rebalance(ctx(), view(), 0.0) == ()
    # before the thirty-third session the prefixes reused less often made way
    old = make_policy("e2", REBALANCE | {"room_beside_all_reused": False, "make_way": False})
    assert [(m.group, m.dst) for m in old.rebalance(ctx(), view(), 0.0)] == [(11, "idle")]
    # they still do (``make_way``), but only where no engine tried has room beside every one:
    # then the caches cannot hold all the prefixes reused, and a move that waits for room
    # waits for ever (30 documents on three vLLM engines of 64 blocks: an engine over 45% of
    # the requests in 15 of 60 replica runs, 4 with make_way)
    e2 = make_policy("e2", REBALANCE)
    assert [(m.group, m.dst) for m in e2.rebalance(ctx(), view(), 0.0)] == [(11, "idle")]
    roomy = view()
    roomy.engines.append(replace(ev("roomy", load=150.0), position=2))  # 2x less busy, ample
    assert [(m.group, m.dst) for m in e2.rebalance(ctx(), roomy, 0.0)] == [(11, "roomy")]


def test_e2_finds_the_busiest_engine_with_output_tokens_priced_on_one_clock() -> None:
    """Behind the vLLM bridge a measured TPOT counts the prefill chunks in the engine's steps:
    the engine a group was just moved to (73 requests, TPOT 8.6 ms) read busier by windowed
    load than the one with 149 (5.9 ms), and rebalancing only ever looked at the former. The
    busiest is now read with every output token at one TPOT (the mean of the most loaded)."""

    def eng(name: str, window: float, tpot: float, out: int) -> EngineView:
        return replace(ev(name, load=window), tpot_ms=tpot, window_out_tokens=out)

    view = FakeView(
        [eng("a", 7584.0, 5.9, 1000), eng("b", 7724.0, 8.6, 600), eng("c", 4933.0, 6.3, 600)],
        groups={"a": [GroupLoad(41, 1500.0, 20, 600)], "b": [GroupLoad(51, 1000.0, 10, 600)]},
    )
    moves = make_policy("e2", REBALANCE).rebalance(ctx(), view, 0.0)
    assert [(m.group, m.src, m.dst) for m in moves] == [(41, "a", "c")]


def test_e2_moves_to_the_next_least_busy_engine_when_the_least_has_no_room() -> None:
    """On three vLLM engines of 64 KV blocks the least busy engine often holds the cold tail
    of the documents, its cache full of prefixes reused as often as the one that could move;
    the second least busy had room, and the busiest kept 137 of 300 requests."""

    def view(mid: float) -> FakeView:
        engines = [ev("busy", load=300.0), ev("idle", load=100.0), ev("mid", load=mid)]
        v = FakeView(engines, groups={"busy": [GroupLoad(11, 60.0, 5, 1024)]})
        v.rooms["idle"] = 512  # no room for group 11's 1 KiB key
        return v

    moves = make_policy("e2", REBALANCE).rebalance(ctx(), view(180.0), 0.0)
    assert [(m.group, m.src, m.dst) for m in moves] == [(11, "busy", "mid")]
    # the next one must still be 1.5x less busy than the busiest
    assert make_policy("e2", REBALANCE).rebalance(ctx(), view(201.0), 0.0) == ()


def test_e2_rebalancing_moves_no_work_to_a_slower_engine() -> None:
    # the least busy engine prefills 2x slower: e2 sends it less on purpose, and moving work
    # there would only slow it down; one within SAME_SPEED of the busiest still takes it
    view = _rebalance_view(150.0, 100.0)
    view.engines[1] = replace(view.engines[1], prefill_scale=2.0)
    assert make_policy("e2", REBALANCE).rebalance(ctx(), view, 0.0) == ()
    view.engines[1] = replace(view.engines[1], prefill_scale=1.2)
    assert make_policy("e2", REBALANCE).rebalance(ctx(), view, 0.0)


def test_e2_moves_until_balanced() -> None:
    view = _rebalance_view(1000.0, 100.0)
    moves = make_policy("e2", REBALANCE).rebalance(ctx(), view, 0.0)
    # 1000 -> 700 (moved 300) vs 100 -> 400: still >= 1.5x; moving 200 more: 500 vs 600: done
    assert [m.group for m in moves] == [11, 12]


def test_e2_moves_the_group_that_leaves_the_two_engines_closest_to_even() -> None:
    """Of the groups lighter than the gap, the one that best closes it moves first. Preble's
    heaviest first moved the hottest prefix whenever it was lighter than the gap: here the
    least busy engine would end 4.5x busier than the busiest was left, and on real vLLM, where
    a moved group's requests follow it only within the tie band, the hottest document was
    split over two engines."""
    view = FakeView(
        [ev("busy", load=1000.0), ev("idle", load=100.0), ev("mid", load=500.0)],
        groups={
            "busy": [GroupLoad(11, 800.0, 40), GroupLoad(12, 400.0, 20), GroupLoad(13, 150.0, 8)]
        },
    )
    moves = make_policy("e2", REBALANCE).rebalance(ctx(), view, 0.0)
    # 1000 -> 600 against 100 -> 500: within 1.5x, done
    assert [(m.kind, m.group, m.dst) for m in moves] == [("move", 12, "idle")]
    heaviest = make_policy("e2", REBALANCE | {"moves_by_fit": False})
    assert [m.group for m in heaviest.rebalance(ctx(), view, 0.0)] == [11]  # 200 against 900
    # the best fit must still fit in the least busy engine's cache: else the next best
    view.rooms = {"idle": 1_000}
    view.groups["busy"][1] = GroupLoad(12, 400.0, 20, key_bytes=5_000)
    # 13 (1000 -> 850 against 100 -> 250); then 11 is heavier than the gap left
    assert [m.group for m in make_policy("e2", REBALANCE).rebalance(ctx(), view, 0.0)] == [13]


def test_e2_replicates_a_hot_prefix_only_when_ttft_doubled() -> None:
    hot = FakeView(
        [ev("busy", load=400.0), ev("idle", load=100.0)],
        groups={"busy": [GroupLoad(21, 390.0, 40)]},  # too heavy to move: it is the hot spot
        halves={21: (100.0, 200.0)},
    )
    moves = make_policy("e2", REBALANCE).rebalance(ctx(), hot, 0.0)
    assert [(m.kind, m.group, m.dst) for m in moves] == [("replicate", 21, "idle")]
    hot.halves[21] = (100.0, 199.0)
    assert make_policy("e2", REBALANCE).rebalance(ctx(), hot, 0.0) == ()


def test_e2_moves_a_moved_group_on_when_its_target_became_the_busiest() -> None:
    # group 31 was moved to "b" earlier; "b" is now the busiest: the group may move on (it used
    # to be skipped while its override lasted, so "b" kept every request of it for the window)
    view = FakeView(
        [ev("a", load=200.0), ev("b", load=1000.0), ev("c", load=100.0)],
        overrides={31: "b", 32: "a"},
        groups={"b": [GroupLoad(32, 500.0, 9), GroupLoad(31, 400.0, 9)]},
    )
    moves = make_policy("e2", REBALANCE).rebalance(ctx(), view, 0.0)
    # 32 was moved on to "a" already: only history is left on "b"
    assert [(m.kind, m.group, m.src, m.dst) for m in moves] == [("move", 31, "b", "c")]


def test_e2_does_not_move_a_replicated_group() -> None:
    # a replicated hot group on the busiest engine: moving one copy would pin every replica's
    # traffic to the least busy engine (the override wins over the replicas)
    view = FakeView(
        [ev("a", load=1000.0), ev("b", load=600.0), ev("c", load=100.0)],
        reps={41: frozenset({"a", "b"})},
        groups={"a": [GroupLoad(41, 300.0, 20), GroupLoad(42, 200.0, 5)]},
    )
    moves = make_policy("e2", REBALANCE).rebalance(ctx(), view, 0.0)
    assert [(m.kind, m.group) for m in moves] == [("move", 42)]
    view.halves[41] = (100.0, 250.0)  # its TTFT doubled: one more replica instead
    moves = make_policy("e2", REBALANCE).rebalance(ctx(), view, 0.0)
    assert [(m.kind, m.group, m.dst) for m in moves] == [("replicate", 41, "c"), ("move", 42, "c")]


def test_e2_follows_overrides_and_replicas_within_the_tie_band() -> None:
    engines = [ev("a", load=0.0), ev("b", load=50.0), ev("c", load=20.0)]
    # nobody holds the key: every engine is about as good, and a moved group goes where it was
    # moved, a replicated one to the least loaded replica
    view = FakeView(engines, overrides={1: "b"})
    d = make_policy("e2", REBALANCE).choose(ctx(group=1), view, 0.0)
    assert (d.engine_id, d.reason) == ("b", "rebalance")
    view = FakeView(engines, reps={1: frozenset({"b", "c"})})
    d = make_policy("e2", REBALANCE).choose(ctx(group=1), view, 0.0)
    assert (d.engine_id, d.reason) == ("c", "replicate")
    # a holds 39 KB of it: b and c would prefill it all, far outside the band; the cost decides
    # (followed everywhere, Preble's moves cost 0.7 points on the held-out Mooncake trace)
    view = FakeView(engines, matched={"a": 39_000}, overrides={1: "b"})
    band_only = REBALANCE | {"follow_spare": False}
    d = make_policy("e2", band_only).choose(ctx(group=1), view, 0.0)
    assert (d.engine_id, d.reason) == ("a", "exploit")
    view = FakeView(engines, matched={"a": 39_000}, reps={1: frozenset({"b", "c"})})
    d = make_policy("e2", REBALANCE).choose(ctx(group=1), view, 0.0)
    assert (d.engine_id, d.reason) == ("a", "exploit")


def test_e2_follows_a_move_to_an_engine_with_room_to_spare_as_an_investment() -> None:
    """A moved group's new engine must prefill the prefix again, so beside an idle holder it is
    never in the band; where it has room to spare (nothing queued, prefill and decode under
    half busy) and would be in the band if it held the prefix, the move is followed: the copy
    delays nobody, and what it costs (its request's later first token, the work it adds there)
    is within the tie band's share of the request's TTFT SLO. Anywhere busier, or where the copy
    costs more, the cost decides and the holder keeps the group."""
    slo = Slo(10_000.0, 1_000.0)  # the band's share of it: 5% + 5 ms = 505 ms
    held = {"a": 8_000}  # 2k of the key's 10k tokens: ~1.0 s on a, ~1.2 s on b
    spare = FakeView([ev("a"), ev("b")], matched=held, overrides={1: "b"})
    d = make_policy("e2", REBALANCE).choose(ctx(group=1, slo=slo), spare, 0.0)
    assert (d.engine_id, d.reason) == ("b", "rebalance")
    # a long prefix (39 KB: ~60 ms on a against ~1.2 s on b): the copy would cost over 2 s
    long = FakeView(spare.engines, matched={"a": 39_000}, overrides={1: "b"})
    d = make_policy("e2", REBALANCE).choose(ctx(group=1, slo=slo), long, 0.0)
    assert (d.engine_id, d.reason) == ("a", "exploit")
    # ... unless its SLO is so relaxed that this is within the band's share (60 s: 3 s)
    d = make_policy("e2", REBALANCE).choose(ctx(group=1, slo=Slo(60_000.0, 1_000.0)), long, 0.0)
    assert (d.engine_id, d.reason) == ("b", "rebalance")
    # not without the move, nor with follow_spare off
    d = make_policy("e2", REBALANCE).choose(
        ctx(group=1, slo=slo), FakeView(spare.engines, held), 0.0
    )
    assert (d.engine_id, d.reason) == ("a", "exploit")
    off = make_policy("e2", REBALANCE | {"follow_spare": False})
    assert off.choose(ctx(group=1, slo=slo), spare, 0.0).engine_id == "a"
    # prefill queued at the new engine
    queued = ev("b", hb=_hb(queued=500))
    view = FakeView([ev("a"), queued], matched=held, overrides={1: "b"})
    assert make_policy("e2", REBALANCE).choose(ctx(group=1), view, 0.0).engine_id == "a"
    # its prefill over half busy (600 ms of prefill routed there a second)
    busy = replace(ev("b"), rate_per_s=10.0, prefill_rate=600.0)
    view = FakeView([ev("a"), busy], matched=held, overrides={1: "b"})
    assert make_policy("e2", REBALANCE).choose(ctx(group=1), view, 0.0).engine_id == "a"


def test_e2_replicates_a_hot_prefix_to_a_spare_engine_when_its_requests_repay_the_copy() -> None:
    """A flash crowd of one system prompt: the cost alone keeps every request on the prompt's
    first holders until their queues cost as much as prefilling it elsewhere, and the other
    engines idle (programming on 16 engines at half the knee: 5 engines of 16 served the first
    128 requests, p99 TTFT 1.3x round robin's). Where the prompt is held by two engines or more
    and is the heaviest group on the best of them, an engine with room to spare takes a copy
    when the requests of the prompt expected while the best holder's queue lasts repay it."""
    held = {"a": 39_000, "b": 39_000}  # two holders of most of the key (10k tokens)

    def holder(engine_id: str, rate: float, group: int = 1) -> EngineView:
        busy = ev(engine_id, hb=_hb(queued=4_000))  # ~0.5 s of prefill queued
        return replace(busy, rate_per_s=rate, window_requests=20)

    def view(rate: float, heaviest: int = 1, matched: dict | None = None) -> FakeView:
        groups = {e: [GroupLoad(heaviest, 500.0, 20), GroupLoad(1, 100.0, 5)] for e in "ab"}
        if heaviest == 1:
            groups = {e: [GroupLoad(1, 500.0, 20)] for e in "ab"}
        return FakeView(
            [holder("a", rate), holder("b", rate), ev("c")],
            matched=matched or held,
            groups=groups,
        )

    e2 = make_policy("e2")
    d = e2.choose(ctx(group=1), view(rate=10.0), 0.0)
    assert (d.engine_id, d.reason) == ("c", "replicate")
    # the prompt's requests come too rarely to repay the copy (one a second here)
    assert e2.choose(ctx(group=1), view(rate=1.0), 0.0).engine_id in ("a", "b")
    # held by one engine only: not yet shown to need more than one copy
    one = view(rate=10.0, matched={"a": 39_000})
    assert e2.choose(ctx(group=1), one, 0.0).engine_id == "a"
    # not the heaviest group on its holders: they are busy with other work
    assert e2.choose(ctx(group=1), view(rate=10.0, heaviest=7), 0.0).engine_id in ("a", "b")
    # an engine with prefill queued is not spare
    queued = view(rate=10.0)
    queued.engines[2] = replace(ev("c", hb=_hb(queued=500)), position=2)
    assert make_policy("e2").choose(ctx(group=1), queued, 0.0).engine_id in ("a", "b")
    off = make_policy("e2", {"replicate_to_spare": False})
    assert off.choose(ctx(group=1), view(rate=10.0), 0.0).engine_id in ("a", "b")


def test_an_engine_has_room_to_spare_only_with_nothing_queued_and_both_phases_under_half() -> None:
    def spare(engine: EngineView) -> bool:
        view = FakeView([engine])
        return estimate(view.engines[0], ctx(), 0, view, 0.0, {}).spare()

    assert spare(ev("b"))
    assert not spare(ev("b", hb=_hb(queued=500)))
    assert spare(replace(ev("b"), rate_per_s=10.0, prefill_rate=400.0))
    assert not spare(replace(ev("b"), rate_per_s=10.0, prefill_rate=600.0))
    # the decode batch: half of the places SCORPIO's admission allows there, or more
    view = FakeView([ev("b")])
    capacity = batch_capacity(view.engines[0], 10_100.0, ctx().request.slo.tpot_ms)
    few, many = capacity // 2 - 2, capacity // 2 + 2
    assert spare(ev("b", inflight=few, open_ctx=10_100.0 * few))
    assert not spare(ev("b", inflight=many, open_ctx=10_100.0 * many))


def _hb(queued: int = 0, vbs: float = 0.0, running: int = 0, used: int = 0) -> LoadHeartbeat:
    return LoadHeartbeat(0, running, queued, used, 14_000, vbs, PROFILE.name, "http://x", ("m",))


# ---------------------------------------------------------------------- baselines


def test_round_robin_cycles_in_id_order() -> None:
    rr = make_policy("round_robin")
    view = FakeView([ev("c"), ev("a"), ev("b")])
    assert [rr.choose(ctx(), view, 0.0).engine_id for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_load_picks_fewest_in_flight() -> None:
    view = FakeView([ev("a", inflight=3), ev("b", inflight=1, load=1e6), ev("c", inflight=2)])
    d = make_policy("least_load").choose(ctx(), view, 0.0)
    assert (d.engine_id, d.reason) == ("b", "least_load")


def test_power_of_two_takes_the_less_loaded_of_two_seeded_samples() -> None:
    engines = [ev(f"e{i}", inflight=i) for i in range(8)]
    p2 = make_policy("power_of_two")
    rng = random.Random(3)
    picks = [p2.choose(ctx(), FakeView(engines, rng=rng), 0.0).engine_id for _ in range(200)]
    # replay the same samples by hand
    ref = random.Random(3)
    expected = []
    for _ in range(200):
        i = ref.randrange(8)
        j = ref.randrange(7)
        j += j >= i
        expected.append(f"e{min(i, j)}")
    assert picks == expected
    assert "e7" not in picks  # the busiest can never win a pair


def test_cache_aware_thresholds() -> None:
    ca = make_policy("cache_aware")
    # imbalance: max - min = 65 > 64 and 70 > 1.5 x 5 -> least loaded, despite a full match
    view = FakeView([ev("a", inflight=70), ev("b", inflight=5)], matched={"a": KEY_LEN})
    assert ca.choose(ctx(), view, 0.0).engine_id == "b"
    # max - min = 64 is not > 64 -> cache match
    view = FakeView([ev("a", inflight=69), ev("b", inflight=5)], matched={"a": KEY_LEN})
    d = ca.choose(ctx(), view, 0.0)
    assert (d.engine_id, d.reason) == ("a", "cache_match")
    # match ratio 0.3 is not > 0.3 -> least loaded; just above -> the match
    view = FakeView([ev("a", inflight=3), ev("b", inflight=1)], matched={"a": 12_000})
    assert ca.choose(ctx(), view, 0.0).reason == "least_load"
    view = FakeView([ev("a", inflight=3), ev("b", inflight=1)], matched={"a": 12_001})
    assert ca.choose(ctx(), view, 0.0).engine_id == "a"


def test_session_affinity_is_stable_and_moves_few_sessions_on_engine_add() -> None:
    sa = make_policy("session_affinity")
    eight = FakeView([ev(f"e{i}") for i in range(8)])
    before = {s: sa.choose(ctx(session=f"user-{s}"), eight, 0.0).engine_id for s in range(2000)}
    again = {s: sa.choose(ctx(session=f"user-{s}"), eight, 0.0).engine_id for s in range(2000)}
    assert before == again
    assert len(set(before.values())) == 8
    nine = FakeView([ev(f"e{i}") for i in range(9)])
    after = {s: sa.choose(ctx(session=f"user-{s}"), nine, 0.0).engine_id for s in range(2000)}
    moved = [s for s in before if before[s] != after[s]]
    assert all(after[s] == "e8" for s in moved)  # only to the new engine
    assert 0.05 < len(moved) / 2000 < 0.2  # about 1/9
    d = sa.choose(ctx(), FakeView([ev("a", inflight=2), ev("b")]), 0.0)
    assert (d.engine_id, d.reason) == ("b", "least_load")


# ---------------------------------------------------------------------- helpers


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from([f"e{i}" for i in range(40)]), st.integers(0, 6)),
    st.integers(0, 8),
)
def test_top_matched_is_the_k_longest_then_by_id(matched: dict[str, int], k: int) -> None:
    """The one-pass selection equals sorting every engine (most first, equal lengths by id),
    whatever the dict's order: many engines sharing one length is the common case."""
    want = sorted(matched.items(), key=lambda em: (-em[1], em[0]))[:k]
    assert top_matched(matched, k) == want
    assert top_matched(dict(reversed(matched.items())), k) == want


def test_the_kv_memory_a_request_holds_is_dear_where_memory_binds() -> None:
    """Its decode holds its whole context's memory; the requests arriving meanwhile wait for
    it where the engine's memory is nearly full, not where it has memory to spare: the same
    request on two engines alike but for the memory held there costs more work on the full
    one, and e2 sends it to the other (the cost counted GPU time and decode places only, and a
    hot document stayed on a small engine whose memory it filled)."""
    cap = PROFILE.kv_blocks * PROFILE.block_tokens
    need, hold = 10_000.0, 2_000.0
    assert kv_harm_ms(ev("idle"), 0.0, hold) == 0.0
    spare = kv_harm_ms(ev("s", held_kv=cap * 0.1), need, hold)
    full = kv_harm_ms(ev("f", held_kv=cap * 0.8), need, hold)
    fill = (cap * 0.8 + need) / cap
    assert full == pytest.approx(need / cap * hold * fill / (1 - fill))
    assert full > 5 * spare > 0.0
    full_ev = ev("full", inflight=4, decoding=4, decode_ctx=cap / 8, held_kv=cap * 0.85)
    spare_ev = ev("spare", inflight=4, decoding=4, decode_ctx=cap / 8, held_kv=cap * 0.1)
    view = FakeView([full_ev, spare_ev], releases={"full": 1.0, "spare": 1.0})
    c = ctx(key_len=4 * 2_000)
    assert (
        estimate(full_ev, c, 0, view, 0.0, {}).decode_harm
        > 2 * estimate(spare_ev, c, 0, view, 0.0, {}).decode_harm
    )
    assert make_policy("e2").choose(c, view, 0.0).engine_id == "spare"


def test_a_cached_prefix_no_request_pins_is_not_credited_where_the_memory_ahead_evicts_it() -> None:
    """An engine short of KV memory evicts the cached blocks no request pins before a request
    waits for memory: where the memory held there and the requests queued ahead of this one
    leave no room beside its cached prefix, the prefix is most of its prompt, and no request
    of its prefix group is in flight there, the router counts the prefix as prefilled again
    (its credit came from the last block events, not from what will be cached when the
    request starts), and e2 sends the request where it costs less to compute."""
    cap = PROFILE.kv_blocks * PROFILE.block_tokens
    key_len, cached = 4 * 30_000, 20_000
    full = ev("h", inflight=4, open_ctx=cap / 8, decoding=4, decode_ctx=cap / 8,
              held_kv=cap - 25_000)  # fmt: skip
    spare = ev("f", inflight=4, open_ctx=cap / 8, decoding=4, decode_ctx=cap / 8,
               held_kv=cap / 4)  # fmt: skip
    view = FakeView([full, spare], releases={"h": 50.0, "f": 50.0}, queued_kv={"h": 10_000.0})
    c = ctx(key_len=key_len)
    # 25,000 tokens free, 10,000 taken by the queue ahead: no room for its 20,000
    assert cached_at_start(full, view, 0.0, 4 * cached, c, 1.0) == 0
    est = estimate(full, c, 4 * cached, view, 0.0, {})
    assert est.credited == 0
    assert est.own_ms == pytest.approx(p_ms(0, key_len))
    view.matched = {"h": 4 * cached}
    assert make_policy("e2").choose(c, view, 0.0).engine_id == "f"
    # a request of its group in flight there: the engine keeps the prefix
    view.pinned.add(("h", c.group))
    assert cached_at_start(full, view, 0.0, 4 * cached, c, 1.0) == 4 * cached
    assert estimate(full, c, 4 * cached, view, 0.0, {}).own_ms == pytest.approx(
        p_ms(4 * cached, key_len)
    )
    view.pinned.clear()
    # a prefix that is a small part of the prompt (a system prompt) stays credited
    long = ctx(key_len=3 * 4 * cached)
    assert cached_at_start(full, view, 0.0, 4 * cached, long, 1.0) == 4 * cached
    # nothing queued ahead: room beside the memory held, the prefix stays
    view.queued_kv.clear()
    assert cached_at_start(full, view, 0.0, 4 * cached, c, 1.0) == 4 * cached
    # on an engine with memory to spare, it always does
    view.queued_kv["f"] = 10_000.0
    assert cached_at_start(spare, view, 0.0, 4 * cached, c, 1.0) == 4 * cached


def test_a_request_waits_for_the_kv_memory_the_requests_decoding_hold() -> None:
    """Where the requests decoding on an engine and this one pass its KV capacity, the request
    waits until enough of them finish (the view's release time for that many), and e2 prices
    it: a long prompt goes to the engine whose memory is free, not to the one whose compute
    is (their decode batches equally full)."""
    cap = PROFILE.kv_blocks * PROFILE.block_tokens
    held = ev("a", inflight=4, open_ctx=cap - 20_000, decoding=4, decode_ctx=cap - 20_000)
    free = ev("b", inflight=4, open_ctx=cap / 2, decoding=4, decode_ctx=cap / 2)
    view = FakeView([held, free], releases={"a": 4000.0, "b": 4000.0})
    assert kv_wait_ms(held, view, 0.0, 30_000) == 4000.0  # 10k tokens short: one must finish
    assert kv_wait_ms(held, view, 0.0, 10_000) == 0.0
    assert kv_wait_ms(free, view, 0.0, 30_000) == 0.0
    assert kv_wait_ms(ev("idle"), view, 0.0, cap * 2) == 0.0  # (nothing to wait for)
    # its prefix cached there takes no new memory
    assert kv_wait_ms(held, view, 0.0, 30_000, cached=12_000) == 0.0
    # what the requests decoding there hold, not their summed contexts: readers of one cached
    # document hold it once
    readers = ev("c", inflight=4, decoding=4, decode_ctx=cap - 20_000, held_kv=cap / 4)
    assert kv_wait_ms(readers, view, 0.0, 30_000) == 0.0
    c = ctx(key_len=4 * 30_000)
    assert (
        estimate(held, c, 0, view, 0.0, {}).ttft_ms
        > estimate(free, c, 0, view, 0.0, {}).ttft_ms + 3000.0
    )
    # the estimate asks for its whole context, its output at the cap (what the engine
    # reserves): 19,930 tokens of prompt and 100 of output do not fit in the 20,000 free,
    # though at its mean context (19,930 + 50) it would
    fits_at_mean = RequestContext(RouteRequest("r2", "m", b"k" * 4 * 19_930, 19_930, 100),
                                  4 * 19_930, 1)  # fmt: skip
    with_wait = estimate(held, fits_at_mean, 0, view, 0.0, {})
    without = estimate(free, fits_at_mean, 0, view, 0.0, {})
    assert with_wait.admit_ms >= without.admit_ms + 4000.0
    assert make_policy("e2").choose(c, view, 0.0).engine_id == "b"
    # the requests queued there ahead of it take theirs before it starts
    view.queued_kv["b"] = cap / 2
    assert kv_wait_ms(free, view, 0.0, 30_000) == 4000.0
