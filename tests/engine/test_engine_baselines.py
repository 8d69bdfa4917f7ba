"""The fcfs and preble baselines."""

from __future__ import annotations

import pytest
from engine_testkit import core, first_token_times, req, run_until

from broker.events import RequestStarted
from engine.scheduler.preble import PreblePolicy, group_quota, hit_group
from kvgate.cost_model import default_profile


def test_fcfs_serves_in_arrival_order_and_never_rejects_for_slo() -> None:
    c = core("fcfs", chunked_budget=100)
    c.submit(req("A", 100, ttft_ms=5000), 0.0)
    c.submit(req("B", 100, ttft_ms=150), 0.0)
    c.submit(req("C", 100, ttft_ms=50), 0.0)  # infeasible: served anyway, late
    outs = run_until(c, 10.0)
    assert not [o for o in outs if o.rejected]
    ft = first_token_times(outs)
    assert ft == pytest.approx({"A": 0.1, "B": 0.2, "C": 0.3})


@pytest.mark.parametrize(
    ("policy", "order"), [("fcfs", "arrival"), ("preble", "arrival"), ("slo", "deadline")]
)
def test_heartbeats_announce_the_order_the_prefill_queue_is_served_in(
    policy: str, order: str
) -> None:
    """Routers predict a request's wait from it: S-EDF lets a request due sooner overtake and
    rejects one past saving; the baselines serve their queue first come first served."""
    assert core(policy).heartbeat("http://127.0.0.1:1", ("m",)).queue_order == order


@pytest.mark.parametrize(
    ("policy", "config", "chunk"),
    [
        ("slo", {"chunk_tokens": 4096}, 4096),
        ("fcfs", {"chunked_budget": 512}, 512),
        ("preble", {}, 2048),
    ],
)
def test_heartbeats_announce_the_most_prompt_tokens_prefilled_in_one_piece(
    policy: str, config: dict, chunk: int
) -> None:
    """Routers price a long prompt piece by piece from it (each piece attends to the ones
    before it): S-EDF's chunks, the baselines' token budget a step."""
    hb = core(policy, **config).heartbeat("http://127.0.0.1:1", ("m",))
    assert hb.prefill_chunk_tokens == chunk


def test_a_long_prompt_alone_takes_what_its_announced_chunks_cost() -> None:
    """What the heartbeat announces is what the engine does: a prompt four chunks long, alone
    on an idle S-EDF engine, gives its first token when the profile's four pieces (each with the
    earlier ones as context) are done, not its one-piece time."""
    prof = default_profile()
    c = core("slo", profile=prof, chunk_tokens=4096)
    chunk = c.heartbeat("http://127.0.0.1:1", ("m",)).prefill_chunk_tokens
    c.submit(req("long", 16_000, ttft_ms=60_000), 0.0)
    ft = first_token_times(run_until(c, 30.0))
    assert ft["long"] == pytest.approx(prof.prompt_prefill_ms(16_000, 0, chunk) / 1000, rel=0.02)
    assert ft["long"] > 1.1 * prof.prefill_ms(16_000) / 1000


def test_fcfs_chunks_long_prompts_and_decodes_everyone_every_step() -> None:
    c = core("fcfs", chunked_budget=2048)
    c.submit(req("D1", 10, out=1000, tpot_ms=1), 0.0)
    c.submit(req("D2", 10, out=1000, tpot_ms=10_000), 0.0)
    run_until(c, 0.019)  # both prefill in one 20 ms step, ending at 0.020
    c.submit(req("L", 5000, at=0.02), 0.02)
    c.advance(0.02)
    steps = []
    for _ in range(3):
        t = c.next_event_time()
        steps.append((t, {o.request_id for o in c.advance(t)}))
    # Every step decodes both (no SLO classes) plus a chunk of L: 2046, 2046 then 908 tokens.
    assert all({"D1", "D2"} <= ids for _, ids in steps)
    assert "L" in steps[2][1] and "L" not in steps[1][1]
    assert steps[0][0] - 0.02 == pytest.approx((2 + 10 + 2046) / 1000)
    assert steps[2][0] - steps[1][0] == pytest.approx((2 + 10 + 908) / 1000)


def test_preble_groups() -> None:
    assert [hit_group(h) for h in (0.0, 0.01, 0.1, 0.11, 0.5, 0.95, 1.0)] == [0, 0, 0, 1, 4, 9, 9]
    assert group_quota(0) == 10 and group_quota(9) == 100


class _View:
    def __init__(self, waiting: list) -> None:
        self.waiting = waiting


class _St:
    def __init__(self, name: str, hit: float) -> None:
        self.name = name
        self.hit_ratio = hit


def test_preble_round_robin_from_group_9_with_quotas() -> None:
    waiting = [_St(f"g0-{i}", 0.0) for i in range(15)]
    waiting += [_St(f"g9-{i}", 0.99) for i in range(3)] + [_St(f"g5-{i}", 0.55) for i in range(2)]
    order = [s.name for s in PreblePolicy()._order(_View(waiting))]  # type: ignore[arg-type]
    expect = [f"g9-{i}" for i in range(3)] + ["g5-0", "g5-1"]
    expect += [f"g0-{i}" for i in range(10)]  # group 0's quota is 10 a visit
    expect += [f"g0-{i}" for i in range(10, 15)]  # ... the rest after a full round
    assert order == expect


def test_preble_quota_is_spent_only_on_admitted_requests() -> None:
    p = PreblePolicy()
    waiting = [_St(f"a{i}", 0.0) for i in range(30)]
    it = p._order(_View(waiting))  # type: ignore[arg-type]
    taken = [next(it) for _ in range(4)]
    it.close()  # the fourth was not admitted
    assert p.group == 0 and p.left == 10 - 3
    assert taken[-1].name == "a3"


def test_preble_admits_cache_hits_before_earlier_misses() -> None:
    c = core("preble", chunked_budget=64)
    shared = b"S" * 4096
    c.submit(req("warm", 1024, key=shared), 0.0)
    run_until(c, 100.0)
    c.drain_events()
    c.policy = PreblePolicy()  # a fresh round (warming up left the visit on group 0)
    c.submit(req("miss", 64, at=1000.0), 1000.0)
    c.submit(req("hit", 1100, at=1000.0, key=shared + b"tail" * 100), 1000.0)
    run_until(c, 2000.0)
    started = [e.request_id for e in c.drain_events() if isinstance(e, RequestStarted)]
    assert started == ["hit", "miss"]  # hit: group 9, visited first; miss: group 0


@pytest.mark.parametrize(("policy", "cached"), [("fcfs", 2992), ("preble", 2992), ("slo", 3488)])
def test_a_follower_reuses_the_chunks_a_long_prompt_has_computed(policy: str, cached: int) -> None:
    """vLLM caches a chunk's full blocks as it computes them (SGLang keeps a chunked request's
    computed prefix too): a request with the same prompt admitted while the first is still
    prefilling reuses what is done and computes the rest. Cached only when the whole prompt
    was, such a follower recomputed a long document beside its first request. kvgate's S-EDF
    engine caches a prompt when its prefill completes, and holds the follower until then."""
    c = core(policy, chunked_budget=1000, chunk_tokens=1000)
    doc = b"d" * 4 * 3500  # 3,500 tokens: chunks of 1,000, 1,000, 1,000 and 500 (1 ms a token)
    c.submit(req("first", 3500, key=doc), 0.0)
    assert not first_token_times(run_until(c, 2.5))
    c.submit(req("follower", 3501, key=doc + b"q2q2", at=2.5), 2.5)
    outs = run_until(c, 20.0)
    usage = {o.request_id: o.usage for o in outs if o.usage is not None}
    # admitted beside the last chunk, the follower finds the first three chunks' whole 16-token
    # blocks (2,992 tokens; the third ends mid-block); S-EDF's, the whole prompt's (3,488)
    assert usage["follower"].cached_tokens == cached
