"""Each policy on hand-built cluster states where the right answer is known."""

from __future__ import annotations

import ast
import random
from collections import Counter
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
from router.policies.e2 import _holders_by_length
from router.policies.feasibility import next_decode_step_ms, queued_prefill_ms
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

    def engine(self, engine_id: str) -> EngineView | None:
        return next((e for e in self.engines if e.engine_id == engine_id), None)

    def __post_init__(self) -> None:  # positions: the order of ``engines``, as the cluster's
        self.engines = [replace(e, position=i) for i, e in enumerate(self.engines)]

    def by_load(self) -> Iterator[EngineView]:
        return iter(sorted(self.engines, key=lambda e: (e.load_ms, e.position)))

    def load_extremes(self, window: bool = False) -> tuple[EngineView, EngineView] | None:
        def load(e: EngineView) -> float:
            return e.window_ms if window else e.load_ms

        if not self.engines:
            return None
        return min(self.engines, key=load), max(self.engines, key=load)  # first of equals

    def min_routed(self) -> int:
        return min((e.routed_total for e in self.engines), default=0)

    def profiles(self) -> list[CostProfile]:
        return list({ev.profile.name: ev.profile for ev in self.engines}.values())

    def prefill_ahead_ms(self, ev: EngineView, deadline: float) -> float:
        return ev.queued_prefill_ms  # hand-built states: the whole queue is ahead

    def eviction_ms(self, engine_id: str, need_bytes: int, now: float) -> float:
        return self.evictions.get(engine_id, 0.0)

    def override(self, group: int) -> str | None:
        return self.overrides.get(group)

    def replicas(self, group: int) -> frozenset[str]:
        return self.reps.get(group, frozenset())

    def groups_on(self, engine_id: str, min_requests: int = 1) -> list[GroupLoad]:
        return self.groups.get(engine_id, [])  # unfiltered: the policy must skip what it must

    def ttft_halves(self, group: int, now: float) -> tuple[float, float]:
        return self.halves.get(group, (0.0, 0.0))


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


def test_e2_exploits_least_loaded_holder_of_longest_match_when_missed_lt_matched() -> None:
    view = FakeView(
        [ev("a", load=500.0), ev("b", load=10.0), ev("c", load=0.0), ev("d", load=0.0)],
        matched={"a": 30_000, "b": 30_000, "c": 20_000},  # missed 10k < matched 30k
    )
    d = make_policy("e2").choose(ctx(), view, 0.0)
    assert (d.engine_id, d.reason, d.matched_bytes) == ("b", "exploit", 30_000)


def test_e2_explores_when_missed_not_below_matched() -> None:
    # matched == missed (20k each) is not an exploit: Preble needs missed < matched
    view = FakeView(
        [ev("a", load=50_000.0), ev("b", load=0.0)],
        matched={"a": 20_000},
    )
    d = make_policy("e2", {"pd_balance": False}).choose(ctx(), view, 0.0)
    assert d.reason == "explore"
    assert d.engine_id == "b"  # a's load outweighs its prefill saving
    by_id = {c.engine_id: c for c in d.candidates}
    assert by_id["a"].prefill_ms == pytest.approx(p_ms(20_000))
    assert by_id["b"].prefill_ms == pytest.approx(p_ms(0))
    assert by_id["a"].load_ms == 50_000.0


def test_e2_explore_uses_all_three_terms() -> None:
    # L: a is busiest; P: a holds a third of the key; M: c would have to evict hot prefixes.
    saving = p_ms(0) - p_ms(13_000)
    assert saving > 100
    engines = [
        ev("a", load=saving - 50),  # L + P = saving - 50 + p(13k) = p(0) - 50: the cheapest
        ev("b", load=0.0),  # L + P = p(0)
        ev("c", load=0.0, free=0),  # L + P = p(0) - 0, but M = 1000
    ]
    view = FakeView(engines, matched={"a": 13_000}, evictions={"c": 1000.0, "b": 0.0})
    e2 = make_policy("e2", {"pd_balance": False})
    assert e2.choose(ctx(), view, 0.0).engine_id == "a"
    # without P, a is just the busiest: b or c (c is equal on L but pays M) -> b
    no_p = make_policy("e2", {"pd_balance": False, "prefill_term": False})
    assert no_p.choose(ctx(), view, 0.0).engine_id in {"b", "c"}
    # M decides between b and c: make c's L lower than b's; with M it still loses, without it wins
    engines2 = [ev("b", load=10.0), ev("c", load=0.0, free=0)]
    view2 = FakeView(engines2, evictions={"c": 1000.0})
    assert make_policy("e2", {"pd_balance": False}).choose(ctx(), view2, 0.0).engine_id == "b"
    no_m = make_policy("e2", {"pd_balance": False, "eviction_term": False})
    assert no_m.choose(ctx(), view2, 0.0).engine_id == "c"
    d = make_policy("e2", {"pd_balance": False}).choose(ctx(), view2, 0.0)
    by_id = {c.engine_id: c for c in d.candidates}
    assert by_id["c"].eviction_ms == 1000.0
    assert by_id["b"].total_ms == pytest.approx(10.0 + p_ms(0))


def test_e2_pd_balance_sends_prefill_heavy_requests_to_decode_heavy_engine() -> None:
    engines = [ev("prefill", load=0.0, hit=0.1), ev("decode", load=300.0, hit=0.8)]
    d = make_policy("e2").choose(ctx(), FakeView(engines), 0.0)
    assert (d.engine_id, d.reason) == ("decode", "pd_balance")
    off = make_policy("e2", {"pd_balance": False}).choose(ctx(), FakeView(engines), 0.0)
    assert (off.engine_id, off.reason) == ("prefill", "explore")
    # below the 0.7 threshold there is no decode-heavy engine
    engines[1] = ev("decode", load=300.0, hit=0.69)
    assert make_policy("e2").choose(ctx(), FakeView(engines), 0.0).engine_id == "prefill"


def _rebalance_view(hi: float, lo: float, **kw) -> FakeView:
    return FakeView(
        [ev("busy", load=hi), ev("idle", load=lo), ev("mid", load=(hi + lo) / 2)],
        groups={
            "busy": [GroupLoad(11, hi * 0.3, 5), GroupLoad(12, hi * 0.2, 3), GroupLoad(13, 1.0, 1)]
        },
        **kw,
    )


def test_e2_rebalancing_fires_at_1_5x_and_not_below() -> None:
    e2 = make_policy("e2")
    moves = e2.rebalance(ctx(), _rebalance_view(150.0, 100.0), 0.0)
    assert moves and moves[0].kind == "move"
    assert (moves[0].group, moves[0].src, moves[0].dst) == (11, "busy", "idle")
    assert all(m.group != 13 for m in moves)  # a single request is not a prefix worth moving
    assert e2.rebalance(ctx(), _rebalance_view(149.9, 100.0), 0.0) == ()
    assert (
        make_policy("e2", {"rebalance": False}).rebalance(ctx(), _rebalance_view(300.0, 100.0), 0.0)
        == ()
    )


def test_e2_rebalancing_waits_for_warmup() -> None:
    view = _rebalance_view(300.0, 100.0)
    view.engines[1] = ev("idle", load=100.0, routed=49)
    assert make_policy("e2").rebalance(ctx(), view, 0.0) == ()


def test_e2_moves_until_balanced() -> None:
    view = _rebalance_view(1000.0, 100.0)
    moves = make_policy("e2").rebalance(ctx(), view, 0.0)
    # 1000 -> 700 (moved 300) vs 100 -> 400: still >= 1.5x; moving 200 more: 500 vs 600: done
    assert [m.group for m in moves] == [11, 12]


def test_e2_replicates_a_hot_prefix_only_when_ttft_doubled() -> None:
    hot = FakeView(
        [ev("busy", load=400.0), ev("idle", load=100.0)],
        groups={"busy": [GroupLoad(21, 390.0, 40)]},  # too heavy to move: it is the hot spot
        halves={21: (100.0, 200.0)},
    )
    moves = make_policy("e2").rebalance(ctx(), hot, 0.0)
    assert [(m.kind, m.group, m.dst) for m in moves] == [("replicate", 21, "idle")]
    hot.halves[21] = (100.0, 199.0)
    assert make_policy("e2").rebalance(ctx(), hot, 0.0) == ()


def test_e2_moves_a_moved_group_on_when_its_target_became_the_busiest() -> None:
    # group 31 was moved to "b" earlier; "b" is now the busiest: the group may move on (it used
    # to be skipped while its override lasted, so "b" kept every request of it for the window)
    view = FakeView(
        [ev("a", load=200.0), ev("b", load=1000.0), ev("c", load=100.0)],
        overrides={31: "b", 32: "a"},
        groups={"b": [GroupLoad(32, 500.0, 9), GroupLoad(31, 400.0, 9)]},
    )
    moves = make_policy("e2").rebalance(ctx(), view, 0.0)
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
    moves = make_policy("e2").rebalance(ctx(), view, 0.0)
    assert [(m.kind, m.group) for m in moves] == [("move", 42)]
    view.halves[41] = (100.0, 250.0)  # its TTFT doubled: one more replica instead
    moves = make_policy("e2").rebalance(ctx(), view, 0.0)
    assert [(m.kind, m.group, m.dst) for m in moves] == [("replicate", 41, "c"), ("move", 42, "c")]


def test_e2_follows_overrides_and_replicas() -> None:
    engines = [ev("a", load=0.0), ev("b", load=50.0), ev("c", load=20.0)]
    view = FakeView(engines, matched={"a": 39_000}, overrides={1: "b"})
    d = make_policy("e2").choose(ctx(group=1), view, 0.0)
    assert (d.engine_id, d.reason) == ("b", "rebalance")
    view = FakeView(engines, matched={"a": 39_000}, reps={1: frozenset({"b", "c"})})
    d = make_policy("e2").choose(ctx(group=1), view, 0.0)
    assert (d.engine_id, d.reason) == ("c", "replicate")


def _hb(queued: int = 0, vbs: float = 0.0, running: int = 0, used: int = 0) -> LoadHeartbeat:
    return LoadHeartbeat(0, running, queued, used, 14_000, vbs, PROFILE.name, "http://x", ("m",))


def test_slo_filter_skips_infeasible_engines_and_sheds_when_none_left() -> None:
    slo = Slo(ttft_ms=2000.0, tpot_ms=100.0)
    # a has 40k queued prefill tokens (~5 s of work); b is idle
    engines = [ev("a", hb=_hb(queued=40_000)), ev("b", load=10_000.0, hb=_hb())]
    view = FakeView(engines, matched={"a": 39_000})
    d = make_policy("e2").choose(ctx(slo=slo), view, 0.0)
    assert d.engine_id == "b"
    off = make_policy("e2", {"slo_filter": False}).choose(ctx(slo=slo), view, 0.0)
    assert off.engine_id == "a"  # exploit without the filter
    # TPOT: b's virtual batch is so large a 100 ms TPOT cannot be kept
    engines = [ev("a", hb=_hb(queued=40_000)), ev("b", hb=_hb(vbs=800.0, running=800, used=16_000))]
    d = make_policy("e2").choose(ctx(slo=slo), FakeView(engines), 0.0)
    assert d.shed and d.reason == "shed" and d.engine_id is None
    assert 0.5 <= d.retry_after_s <= 30.0
    # a prefix cache full of idle blocks is no decode context: one running request of ~13k
    # tokens is TPOT-feasible (the KV-blocks-in-use estimate said 224k tokens of context each)
    busy_cache = ev("c", inflight=1, open_ctx=13_170.0, hb=_hb(vbs=1.0, running=1, used=14_000))
    d = make_policy("e2").choose(ctx(slo=slo), FakeView([busy_cache]), 0.0)
    assert d.engine_id == "c"
    # baselines can opt in to the same filter
    d = make_policy("least_load", {"slo_filter": True}).choose(ctx(slo=slo), FakeView(engines), 0)
    assert d.shed


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


# ---------------------------------------------------------------------- e2's lazy cost order

SLOW = replace(PROFILE, name="slow-test-profile", efficiency=PROFILE.efficiency / 2)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(  # loads: ties on purpose, and anything
                st.sampled_from([0.0, 10.0, 10.0, 55.5, 300.0, 1e4]), st.floats(0.0, 3000.0)
            ),
            st.sampled_from([0, 0, 4096, 4096, 4096, 16_000, 39_000]),  # matched (some rare)
            st.booleans(),  # slow profile
        ),
        min_size=1,
        max_size=24,
    ),
    st.booleans(),
)
def test_e2_cost_order_equals_sorting_every_engine(spec: list, prefill_term: bool) -> None:
    """E2's lazy explore order is exactly every candidate sorted by (L + P, L, position)."""
    from router.policies.base import prefill_cost_ms
    from router.policies.e2 import _CostOrder

    engines = [replace(ev(f"e{i}", load=load), profile=SLOW if slow else PROFILE)
               for i, (load, _, slow) in enumerate(spec)]  # fmt: skip
    matched = {f"e{i}": m for i, (_, m, _) in enumerate(spec) if m}
    view = FakeView(engines, matched=matched)
    cache: dict = {}

    def p_of(e: EngineView) -> float:
        return (
            prefill_cost_ms(e, KEY_LEN, matched.get(e.engine_id, 0), cache) if prefill_term else 0.0
        )

    brute = sorted((e.load_ms + p_of(e), e.load_ms, e.position, e.engine_id) for e in view.engines)
    brute = [(lp, pos, e) for lp, _, pos, e in brute]
    order = _CostOrder(view, KEY_LEN, p_of, cache if prefill_term else None)
    assert [(lp, pos, e.engine_id) for lp, pos, e in order] == brute
    again = _CostOrder(view, KEY_LEN, p_of, cache if prefill_term else None)
    assert [(lp, pos, e.engine_id) for lp, pos, e in again.first(3)] == brute[:3]


def _guard_view(holder_load: float) -> FakeView:
    # h holds 39k of the 40k key (exploit); x is idle, y a little busier: explore's winner is x
    return FakeView(
        [ev("h", load=holder_load), ev("x", load=0.0), ev("y", load=500.0)],
        matched={"h": 39_000},
    )


GUARD = {"exploit_guard": True, "pd_balance": False}


def test_e2_exploit_guard_replicates_to_explore_winner_beyond_the_ratio() -> None:
    c_e = p_ms(0)  # x: idle, nothing cached
    c_h = 1.5 * c_e + 1.0  # just over 1.5 x C_e
    d = make_policy("e2", GUARD).choose(ctx(), _guard_view(c_h - p_ms(39_000)), 0.0)
    assert (d.engine_id, d.reason) == ("x", "replicate")
    assert "h" in d.detail
    by_id = {c.engine_id: c for c in d.candidates}
    assert by_id["x"].total_ms == pytest.approx(c_e)
    assert by_id["h"].matched_bytes == 39_000  # the holder is listed with its match
    # the slack raises the threshold by as much
    slack = make_policy("e2", {**GUARD, "guard_slack_ms": 2.0})
    assert slack.choose(ctx(), _guard_view(c_h - p_ms(39_000)), 0.0).reason == "exploit"


def test_e2_exploit_guard_does_not_fire_just_below_the_ratio() -> None:
    c_h = 1.5 * p_ms(0) - 1.0
    d = make_policy("e2", GUARD).choose(ctx(), _guard_view(c_h - p_ms(39_000)), 0.0)
    assert (d.engine_id, d.reason) == ("h", "exploit")


def test_e2_exploit_guard_counts_eviction_and_respects_the_switch() -> None:
    overloaded = _guard_view(10 * p_ms(0))
    # off (the default, and explicitly): the old behaviour, exploit however loaded the holder
    for e2 in (make_policy("e2"), make_policy("e2", {**GUARD, "exploit_guard": False})):
        d = e2.choose(ctx(), overloaded, 0.0)
        assert (d.engine_id, d.reason) == ("h", "exploit")
    # the winner must beat the threshold including its M: x would evict hot prefixes, y wins
    view = FakeView(
        [ev("h", load=10 * p_ms(0)), ev("x", load=0.0, free=0), ev("y", load=500.0)],
        matched={"h": 39_000},
        evictions={"x": 1e9},
    )
    d = make_policy("e2", GUARD).choose(ctx(), view, 0.0)
    assert (d.engine_id, d.reason) == ("y", "replicate")
    # every other engine infeasible or too dear: exploit as before
    view.engines[2] = replace(view.engines[2], load_ms=20 * p_ms(0))
    assert make_policy("e2", GUARD).choose(ctx(), view, 0.0).reason == "exploit"


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


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=3), st.integers(0, 5), max_size=40))
def test_holders_by_length_counts_each_matched_length(matched: dict[str, int]) -> None:
    """E2's explore order counts the holders of each matched length with a typed fast path for
    the first two lengths; it must equal a plain count."""
    assert _holders_by_length(matched) == dict(Counter(matched.values()))
