"""Prefill/decode disaggregation in the pure router: roles, the pair choice, the KV move's cost,
both phases' records, and decode retries (router.pd)."""

from __future__ import annotations

import math

import pytest

from broker.codec import decode_batch, encode_batch
from broker.events import (
    AllCleared,
    Envelope,
    EventError,
    FirstToken,
    LoadHeartbeat,
    RequestFinished,
)
from kvgate.cost_model import KvLink, default_profile
from kvgate.slo import Slo
from router.api import Decision, RouteRequest
from router.pd import choose_decode, decode_id, decode_score
from router.policies.base import EngineView
from tests.router.test_router_core import PROMPT, Fleet


def pd_fleet(roles: dict[str, str], **cluster) -> Fleet:
    f = Fleet(n=0, **cluster)
    for engine, role in roles.items():
        f.send(engine, AllCleared(), 0.0)
        f.heartbeat(engine, 0.0, role=role)
    return f


def test_role_is_validated_and_survives_the_codec() -> None:
    hb = dict(
        waiting=0, running=0, queued_prefill_tokens=0, kv_blocks_used=0, kv_blocks_total=10,
        vbs=0.0, profile="p", url="http://x", models=("m",),
    )  # fmt: skip
    with pytest.raises(EventError, match="role"):
        LoadHeartbeat(**hb, role="mixed")
    for event in (
        LoadHeartbeat(**hb, role="decode"),
        LoadHeartbeat(**hb),
        FirstToken("r", 5.0, kv_transfer_ms=3.5, kv_transfer_tokens=100),
        FirstToken("r", 5.0, 1.0, 10, 0, 2.0, 7),
    ):
        env = Envelope("e", "ep", 0, 1.0, event)
        assert decode_batch(encode_batch([env]))[0].event == event


def test_a_colocated_fleet_has_no_pairs() -> None:
    f = Fleet(n=3)
    d = f.route("r1", PROMPT, 1.0)
    assert not d.disaggregated and d.decode_engine_id is None
    assert "prefill=" not in d.header_value()
    assert f.router.cluster.roled == 0


def test_prefill_engine_gets_a_decode_engine_and_both_phases_are_recorded() -> None:
    f = pd_fleet({"p0": "prefill", "d0": "decode"})
    d = f.route("r1", PROMPT, 1.0, max_tokens=200)
    assert (d.engine_id, d.decode_engine_id, d.decode_url) == ("p0", "d0", "http://d0")
    assert d.disaggregated and d.kv_transfer_ms > 0
    hv = d.header_value()
    assert "prefill=p0" in hv and "decode=d0" in hv and "engine=" not in hv
    cl = f.router.cluster
    pre, dec = cl._inflight["r1"], cl._inflight[decode_id("r1")]
    assert (pre.engine_id, pre.out_tokens) == ("p0", 1)  # the prefill phase: one token
    assert (dec.engine_id, dec.out_tokens, dec.missed_tokens) == ("d0", 200, 1)
    # each engine's events release its own phase
    f.send("p0", RequestFinished("r1", 1, 50.0, 0.0), 1.1)
    assert "r1" not in cl._inflight and decode_id("r1") in cl._inflight
    f.send("d0", RequestFinished(decode_id("r1"), 200, 60.0, 20.0), 5.0)
    assert cl.inflight_count == 0
    # the gateway's report releases both phases
    f.route("r2", PROMPT, 6.0)
    assert f.router.report("r2", "p0", "failed", 6.1)
    assert cl.inflight_count == 0


def test_decode_only_engines_never_prefill() -> None:
    f = pd_fleet({"p0": "prefill", "d0": "decode", "d1": "decode"})
    for i in range(20):
        d = f.route(f"r{i}", PROMPT + str(i).encode() * 100, 1.0 + i * 0.01)
        assert d.engine_id == "p0" and d.decode_engine_id in ("d0", "d1")
    # the decode load spreads: the second decode engine is used too
    decs = {f.router.cluster._inflight[decode_id(f"r{i}")].engine_id for i in range(20)}
    assert decs == {"d0", "d1"}


def test_a_fleet_of_only_decode_engines_sheds_and_one_with_no_decoder_colocates() -> None:
    f = pd_fleet({"d0": "decode"})
    assert f.route("r1", PROMPT, 1.0).shed
    g = pd_fleet({"p0": "prefill"})
    d = g.route("r1", PROMPT, 1.0)
    assert d.engine_id == "p0" and not d.disaggregated and "colocated" in d.detail


def test_a_mixed_fleet_prices_the_kv_move() -> None:
    # a colocated engine and a prefill engine, both idle and empty: over a slow link the KV
    # move outweighs decode interference, over a fast one the prefill engine is as good
    slow = pd_fleet({"b0": "both", "p0": "prefill", "d0": "decode"}, kv_link_gbps=0.1)
    d = slow.route("r1", PROMPT, 1.0)
    assert d.engine_id == "b0" and not d.disaggregated
    fast = pd_fleet({"p0": "prefill", "b0": "both", "d0": "decode"}, kv_link_gbps=1e6)
    # the colocated engine is busy decoding: the prefill engine wins
    for i in range(30):
        fast.route(f"x{i}", b"other" * 10 + str(i).encode(), 0.5)
    d = fast.route("r1", PROMPT, 1.0)
    assert d.engine_id == "p0" and d.decode_engine_id == "d0"


def test_decode_choice_prefers_headroom_then_kv_room_then_decode_only() -> None:
    prof = default_profile()
    req = RouteRequest("r", "m", b"x" * 4000, 1000, 100, Slo("s", 1000.0, 100.0))

    def view(eid: str, role: str = "decode", inflight: int = 0, free: int = 10**9) -> EngineView:
        return EngineView(
            eid, "u", prof, inflight, 0.0, 50.0, 0.0, free, 0, 0,
            open_ctx_tokens=inflight * 1500.0, position=int(eid[1:]), role=role,
        )  # fmt: skip

    busy, idle = view("e1", inflight=40), view("e2")
    assert choose_decode([busy, idle], req, 4000) is idle
    full = view("e3", free=100)
    assert choose_decode([full, busy], req, 4000) is busy  # room for the KV first
    both = view("e4", role="both")
    assert choose_decode([both, view("e5")], req, 4000).engine_id == "e5"
    assert choose_decode([view("e6", role="prefill")], req, 4000) is None
    assert decode_score(busy, req, 4000)[3] > decode_score(idle, req, 4000)[3]


def test_decode_room_is_sized_in_the_bytes_the_engine_s_blocks_hold() -> None:
    """Free KV is counted in the key bytes the engine's blocks hold (measured, not the
    profile's guess): a request's KV is sized in the same unit, so an engine whose text takes
    more bytes a token has room for exactly the tokens its free blocks hold."""
    prof = default_profile()
    req = RouteRequest("r", "m", b"x" * 4000, 1000, 100, Slo("s", 1000.0, 100.0))
    tokens = prof.prompt_tokens(1000, 4000) + 100
    wide = 1.5 * prof.bytes_per_token  # its blocks hold 1.5x the profile's bytes a token

    def view(free: float, per_token: float) -> EngineView:
        return EngineView("d0", "u", prof, 0, 0.0, 50.0, 0.0, int(free), 0, 0, role="decode",
                          key_bytes_per_token=per_token)  # fmt: skip

    assert not decode_score(view(tokens * wide, wide), req, 4000)[0]  # room for all of it
    assert decode_score(view(tokens * wide - wide, wide), req, 4000)[0]  # a token short
    # with nothing measured, the profile's bytes a token
    assert not decode_score(view(tokens * prof.bytes_per_token, 0.0), req, 4000)[0]
    assert decode_score(view(tokens * prof.bytes_per_token - 1, 0.0), req, 4000)[0]


def test_decode_retry_picks_another_decode_engine_for_the_same_prefill() -> None:
    f = pd_fleet({"p0": "prefill", "d0": "decode", "d1": "decode"})
    first = f.route("r1", PROMPT, 1.0)
    assert first.decode_engine_id is not None
    retry = f.route(
        "r1", PROMPT, 1.2, exclude=frozenset({first.decode_engine_id}), prefilled_on="p0"
    )
    assert retry.reason == "decode" and retry.engine_id == "p0"
    assert retry.decode_engine_id not in (None, first.decode_engine_id)
    cl = f.router.cluster
    assert cl._inflight[decode_id("r1")].engine_id == retry.decode_engine_id
    # no decode engine left: shed (the gateway re-runs the prefill or answers 502)
    none = f.route("r1", PROMPT, 1.3, exclude=frozenset({"d0", "d1"}), prefilled_on="p0")
    assert none.shed


def test_link_fits_reported_transfer_times() -> None:
    link = KvLink(131_072, 100.0)
    assert link.transfer_ms(1000) == pytest.approx(10.48576)
    f = pd_fleet({"p0": "prefill", "d0": "decode"}, kv_bytes_per_token=131_072, kv_link_gbps=100)
    for i in range(30):  # the link is 4x slower than configured
        f.send("d0", FirstToken(f"r{i}", 50.0, kv_transfer_ms=41.94, kv_transfer_tokens=1000), 1)
    assert f.router.cluster.kv.factor == pytest.approx(4.0, rel=0.01)
    d = f.route("r1", PROMPT, 2.0)
    assert d.kv_transfer_ms == pytest.approx(4 * f.router.cluster.kv.nominal_ms(4096), rel=0.01)
    assert f.router.state(2.0)["kv_link"]["fitted_factor"] == pytest.approx(4.0, rel=0.01)
    with pytest.raises(ValueError):
        KvLink(0, 1)
    assert math.isfinite(Decision("a", "u", "explore", "e2").kv_transfer_ms)


def test_pairs_and_decode_retries_cross_the_remote_routers_wire() -> None:
    from router.wire import (
        decision_from_json,
        decision_to_json,
        engine_from_json,
        engine_to_json,
        request_from_json,
        request_to_json,
    )

    f = pd_fleet({"p0": "prefill", "d0": "decode"})
    d = f.route("r1", PROMPT, 1.0)
    back = decision_from_json(decision_to_json(d))
    assert (back.engine_id, back.decode_engine_id, back.decode_url) == ("p0", "d0", "http://d0")
    assert back.kv_transfer_ms == pytest.approx(d.kv_transfer_ms)
    req = RouteRequest("r1", "m", b"k", 1, 2, prefilled_on="p0")
    assert request_from_json(request_to_json(req)).prefilled_on == "p0"
    infos = {e.engine_id: e for e in f.router.engines(1.0)}
    assert engine_from_json(engine_to_json(infos["d0"])).role == "decode"
