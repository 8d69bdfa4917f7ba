"""kvgate's SLO scheduler for vLLM, its pure half: ordering, step budget and admission, driven
through a fake of what the plug-in sees of vLLM (tests/vllm/fake_vllm.py). No vLLM needed.

Profile: prefill costs exactly 1 ms per new token (FlowPrefill's cubic predictor fits it to
within a fraction of a millisecond), a decode step ``1 x B + 10`` ms.
"""

from __future__ import annotations

import pytest
from fake_vllm import FakeVllm

from broker.events import (
    FirstToken,
    LoadHeartbeat,
    RequestEnqueued,
    RequestFinished,
    RequestPreempted,
    RequestRejected,
    RequestStarted,
)
from engine.core import EngineCore, EngineRequest
from engine.scheduler.slo import SloPolicy
from engine.scheduler.state import Phase, SchedulerConfig
from kvgate.cost_model import CostProfile, PrefillSegment
from kvgate.slo import Slo
from kvgate.vllm.book import Arrival, Capacity, StepResult, VllmBook, _tokens_within

PROFILE = CostProfile(
    name="linear-test",
    segments=(PrefillSegment(0, (0.0, 1.0)),),
    attn_threshold=1e30,
    efficiency=1.0,
    decode_a=0.0,
    decode_b=1.0,
    decode_c=0.0,
    decode_d=10.0,
    kv_blocks=100_000,
    block_tokens=16,
    bytes_per_token=4,
)
RELAXED = Slo(60_000.0, 1_000.0, "relaxed")
URGENT = Slo(2_000.0, 1_000.0, "urgent")


def book(**cfg: object) -> VllmBook:
    reject = bool(cfg.pop("reject", False))
    return VllmBook(PROFILE, SchedulerConfig(**cfg), reject=reject)  # type: ignore[arg-type]


def events_of(b: VllmBook, kind: type) -> list:
    return [e for e in b.drain_events() if isinstance(e, kind)]


# ------------------------------------------------------------------ the same policy


def test_the_book_runs_the_simulated_engines_policy_and_agrees_with_it() -> None:
    """The plug-in is not a second copy: its policy is SloPolicy, and on the same queue it
    starts the same batch as kvgate's simulated engine, in the same order."""
    b = book()
    assert isinstance(b.policy, SloPolicy)
    sizes = {"a": 3000, "b": 400, "c": 900, "d": 200}
    ttfts = {"a": 50_000.0, "b": 9_000.0, "c": 4_000.0, "d": 6_000.0}
    sim = EngineCore("sim", PROFILE, policy="slo")
    fake = FakeVllm(b)
    for rid in sizes:
        slo = Slo(ttfts[rid], 1_000.0)
        sim.submit(EngineRequest(rid, rid.encode() * 64, sizes[rid], 4, slo, 0.0), 0.0)
        fake.add(rid, sizes[rid], slo=slo, now=0.0)
    sim.advance(0.0)
    sim_unit = [st.request_id for st, _, _ in sim._step.unit.pieces]  # type: ignore[union-attr]
    order = fake.step(0.0)
    assert list(order.start) == sim_unit == ["c", "d", "b"]  # S-EDF head, then batched by EDF
    assert [rid for rid, _ in order.prefill] == sim_unit


# ------------------------------------------------------------------ ordering


def test_an_earlier_deadline_takes_the_next_chunk_from_a_running_prefill() -> None:
    b = book()
    fake = FakeVllm(b, max_tokens=1000)  # vLLM's step budget: a 6000-token prompt takes 6 steps
    fake.add("long", 6000, slo=RELAXED, now=0.0)
    first = fake.step(0.0)
    assert first.start == ("long",) and first.prefill == (("long", 1000),)
    fake.step(1.0)
    fake.add("urgent", 300, slo=URGENT, now=1.5)
    b.drain_events()
    order = fake.step(2.0)
    assert order.start == ("urgent",)
    assert order.prefill[0] == ("urgent", 300)  # the chunk boundary: urgent first
    assert [e.request_id for e in events_of(b, RequestPreempted)] == ["long"]
    assert b.phase_of("long") is Phase.PREEMPTED
    order = fake.step(3.0)
    assert "urgent" in fake.first_token_at and order.decode == ("urgent",)
    assert b.phase_of("long") is Phase.PREFILLING  # it resumes where it stopped: 2000 done
    # ... in a slice the TPOT guard sizes (a step lasts at most 0.9 x 1000 ms while urgent
    # decodes): whole operators of its unit (6000 ms / 64) within 900 - 11 ms
    assert fake.steps[-1]["long"] == 9 * 6000 // 64 == fake.reqs["long"].computed - 2000


def test_max_step_ms_bounds_a_lone_prefill_so_an_arrival_waits_one_short_step() -> None:
    """Nothing decodes, so no TPOT guard: without the cap a 6000-token prompt takes vLLM's whole
    step budget (6 s here); with ``max_step_ms`` every step is ~250 ms, and a tight request that
    arrives meanwhile is seen, and served, at the next boundary."""
    b = VllmBook(PROFILE, SchedulerConfig(), max_step_ms=250.0)
    fake = FakeVllm(b)
    fake.add("long", 6000, slo=RELAXED, now=0.0)
    assert fake.step(0.0).prefill == (("long", 250),)
    assert fake.step(0.25).prefill == (("long", 250),)
    fake.add("urgent", 100, slo=Slo(400.0, 1_000.0), now=0.6)
    order = fake.step(0.6)
    assert order.start == ("urgent",) and order.prefill[0] == ("urgent", 100)
    uncapped = FakeVllm(book())
    uncapped.add("long", 6000, slo=RELAXED, now=0.0)
    assert uncapped.step(0.0).prefill == (("long", 6000),)


def test_a_batch_member_decodes_once_its_own_prompt_is_in() -> None:
    """SLO-aware batching puts a short prompt and a long one in one unit, run in steps of
    ``max_step_ms``. vLLM streams the short one's first token the step its prompt is in; from
    the next step it decodes, also while the long one's rest is paused for an urgent arrival
    (held until the whole unit was in, it sat out every step: live gaps of 19 to 47 s)."""
    b = VllmBook(PROFILE, SchedulerConfig(), max_step_ms=300.0)
    fake = FakeVllm(b)
    fake.add("short", 100, slo=Slo(5_000.0, 1_000.0), now=0.0, max_tokens=20)
    fake.add("long", 1000, slo=RELAXED, now=0.0)
    first = fake.step(0.0)
    assert first.prefill == (("short", 100), ("long", 200))  # one unit, the short one first
    assert "short" in fake.first_token_at and b.phase_of("short") is Phase.DECODING
    second = fake.step(0.3)
    assert second.decode == ("short",) and second.prefill == (("long", 300),)
    fake.add("urgent", 200, slo=URGENT, now=0.5)
    third = fake.step(0.6)
    assert third.prefill[0] == ("urgent", 200) and b.phase_of("long") is Phase.PREEMPTED
    assert third.decode == ("short",)  # it decodes while the rest of its unit is paused
    assert fake.reqs["short"].outputs == 3


def test_a_unit_member_starts_in_the_step_that_gives_it_tokens() -> None:
    """SLO-aware batching admits two prompts as one unit; ``max_step_ms`` gives the first step
    only the first one's tokens, so only it starts; the second starts with its own tokens (no
    start vLLM would refuse for lack of budget)."""
    b = VllmBook(PROFILE, SchedulerConfig(), max_step_ms=300.0)
    fake = FakeVllm(b)
    fake.add("a", 300, slo=RELAXED, now=0.0)
    fake.add("b", 300, slo=RELAXED, now=0.0)
    first = fake.step(0.0)
    assert first.start == ("a",) and first.prefill == (("a", 300),)
    second = fake.step(0.3)
    assert second.start == ("b",) and second.prefill == (("b", 300),)
    assert b.stats.start_refused == 0 and b.stats.started == 2


def test_queued_requests_start_earliest_deadline_first_minus_their_prefill() -> None:
    b = book(token_budget=1)  # no batching: one request per step (one-token answers)
    fake = FakeVllm(b)
    # deadlines 10 s, 8 s and 9 s; "big" needs 5 s of prefill, so its latest start is 4 s
    fake.add("a", 100, slo=Slo(10_000.0, 1_000.0), now=0.0, max_tokens=1)
    fake.add("big", 5000, slo=Slo(9_000.0, 1_000.0), now=0.0, max_tokens=1)
    fake.add("c", 100, slo=Slo(8_000.0, 1_000.0), now=0.0, max_tokens=1)
    starts = [rid for _ in range(3) for rid in fake.step(0.0, 1.0).start]
    assert starts == ["c", "big", "a"]  # EDF on the deadline (the slack only sorts sign)


def test_a_late_request_queues_behind_feasible_ones_or_is_refused_with_reject() -> None:
    for reject in (False, True):
        b = book(token_budget=1, reject=reject)
        fake = FakeVllm(b)
        fake.add("late", 500, slo=Slo(1_000.0, 1_000.0), now=0.0)
        fake.add("ok", 500, slo=RELAXED, now=0.0)
        order = fake.step(0.8)  # late: 200 ms left, 500 ms of prefill: infeasible
        if reject:
            assert order.rejected and order.rejected[0][0] == "late"
            assert "can no longer be met" in order.rejected[0][1]
            assert order.start == ("ok",) and "late" not in b
        else:
            assert order.start == ("ok",) and not order.rejected
            assert fake.step(2.0).start == ("late",)  # still served, after feasible work


def test_a_paused_prefill_past_its_deadline_is_refused_and_its_blocks_freed() -> None:
    """``long`` (6000 tokens, due at 6.5 s) is paused at 2 s by ``urgent``; at 3 s it still
    needs ~4 s: with reject vLLM aborts it (its blocks come back), without it resumes."""
    for reject in (True, False):
        b = book(reject=reject)
        fake = FakeVllm(b, max_tokens=1000)
        fake.add("long", 6000, slo=Slo(6_500.0, 1_000.0), now=0.0)
        fake.step(0.0)
        fake.step(1.0)
        fake.add("urgent", 300, slo=URGENT, now=1.5)
        assert fake.step(2.0).start == ("urgent",)
        assert b.phase_of("long") is Phase.PREEMPTED
        free_before = fake.free
        order = fake.step(3.0)
        if reject:
            assert [rid for rid, _ in order.rejected] == ["long"]
            assert "paused" in order.rejected[0][1]
            assert "long" not in b and fake.free > free_before
            assert b.admitted_tpot_stats()[3] == 1  # only urgent holds a place in the ledger
        else:
            assert not order.rejected and b.phase_of("long") is Phase.PREFILLING


def test_a_waiting_request_vllm_now_finds_cached_is_not_refused() -> None:
    # "late" would need its 500 tokens (200 ms left): vLLM's cache now holds 480 of them
    b = book(token_budget=1, reject=True)
    b.cache_probe = lambda rid: 480 if rid == "late" else None
    fake = FakeVllm(b)
    fake.add("late", 500, slo=Slo(1_000.0, 1_000.0), now=0.0)
    order = fake.step(0.8)
    assert not order.rejected and order.start == ("late",)


# ------------------------------------------------------------------ the step's token budget


def test_the_tpot_guard_cuts_a_prefill_to_keep_decodes_within_their_tpot() -> None:
    b = book()
    fake = FakeVllm(b)
    tight = Slo(60_000.0, 100.0, "tight")
    for i in range(4):
        fake.add(f"d{i}", 50, slo=tight, now=0.0, max_tokens=50)
    fake.step(0.0)  # the four short prompts prefill in one batch
    fake.step(0.05)
    assert len(b.decoding) == 4
    fake.add("doc", 4000, slo=RELAXED, now=0.1)
    order = fake.step(0.1)
    prefill = sum(n for _, n in order.prefill)
    decode_ms = PROFILE.decode_step_ms(4, 50)  # 14 ms
    # the step lasts at most 0.9 x 100 ms: 76 ms are left for prefill, 1 ms a token
    assert len(order.decode) == 4
    assert 60 <= prefill <= 0.9 * 100 - decode_ms
    assert order.token_budget == 4 + prefill
    # with nothing decoding, a prefill runs whole (up to vLLM's own step budget)
    b2 = book()
    fake2 = FakeVllm(b2, max_tokens=3000)
    fake2.add("doc", 4000, slo=RELAXED, now=0.0)
    assert fake2.step(0.0).prefill == (("doc", 3000),)


def test_scorpio_credits_decode_a_looser_tpot_class_less_often() -> None:
    b = book()
    fake = FakeVllm(b)
    fake.add("fast", 20, slo=Slo(60_000.0, 50.0), now=0.0, max_tokens=100)
    fake.add("slow", 20, slo=Slo(60_000.0, 100.0), now=0.0, max_tokens=100)
    fake.step(0.0)
    decoded = {"fast": 0, "slow": 0}
    for i in range(1, 21):
        for rid in fake.step(i * 0.02).decode:
            decoded[rid] += 1
    assert decoded == {"fast": 20, "slow": 10}  # TRP: 1 and 50/100


def test_tokens_within_inverts_the_profile() -> None:
    assert _tokens_within(PROFILE, 76.0, 0, 4000) == 76
    assert _tokens_within(PROFILE, 0.1, 0, 4000) == 1  # at least one token a step
    assert _tokens_within(PROFILE, 10_000.0, 0, 4000) == 4000


# ------------------------------------------------------------------ admission


def test_vbs_admission_holds_a_request_back_while_the_decode_batch_is_full() -> None:
    # each decode step costs 1 ms per request + 10 ms: with a 30 ms TPOT SLO the batch holds
    # requests while (B + 10) x 1.3 < 0.99 x 30, i.e. at most 12
    b = book()
    fake = FakeVllm(b)
    tpot = Slo(600_000.0, 30.0, "t30")
    for i in range(14):
        fake.add(f"r{i}", 10, slo=tpot, now=0.0, max_tokens=200)
    fake.step(0.0)
    assert len(fake.running) == 12
    assert b.running == 12 and b.vbs == pytest.approx(12.0)
    waiting = {st.request_id for st in b.waiting}
    assert waiting == {"r12", "r13"} and all(st.blocked_by == "vbs" for st in b.waiting)
    for i in range(1, 5):
        assert not fake.step(i * 0.03).start  # still full: nothing starts
    # two finish: room for two more
    for rid in ("r0", "r1"):
        fake._drop(fake.reqs[rid])
        b.finish(rid, 0.2)
    # admitted together as one unit; the TPOT guard's slice reaches r13 a step later (a start
    # with no tokens this step would only be refused by vLLM)
    started = [*fake.step(0.2).start, *fake.step(0.23).start]
    assert started == ["r12", "r13"] and b.stats.start_refused == 0


def test_kv_admission_and_a_start_vllm_refuses() -> None:
    b = book()
    fake = FakeVllm(b, blocks=40, block_size=16)  # 640 tokens of KV
    fake.add("a", 500, slo=RELAXED, now=0.0)
    fake.add("b", 500, slo=RELAXED, now=0.0)
    order = fake.step(0.0)
    assert order.start == ("a",)  # b does not fit next to a
    assert b.waiting[0].request_id == "b" and b.waiting[0].blocked_by == "kv"
    fake.refuse.add("c")
    fake.add("c", 10, slo=URGENT, now=0.0)
    fake.step(0.6)
    assert b.stats.start_refused == 1 and b.phase_of("c") is Phase.WAITING
    assert b.running == 1  # the refused start gave its share of the ledger back


def test_a_tpot_slo_the_engine_cannot_meet_alone_is_raised_or_refused() -> None:
    impossible = Slo(60_000.0, 5.0, "impossible")  # a lone decode step takes 11 ms
    b = book()
    fake = FakeVllm(b)
    assert fake.add("x", 10, slo=impossible, now=0.0) is None
    enq = events_of(b, RequestEnqueued)[0]
    assert enq.tpot_slo_ms > 11.0 * 1.3 / 0.99 and b.stats.tpot_raised == 1
    assert fake.step(0.0).start == ("x",)  # it runs rather than waiting forever
    b2 = book(reject=True)
    reason = FakeVllm(b2).add("x", 10, slo=impossible, now=0.0)
    assert reason is not None and "TPOT SLO" in reason
    # the router learns why, and the engine's own time for one decode step of it alone
    (refused,) = events_of(b2, RequestRejected)
    assert (refused.reason, refused.cause, refused.estimate_tokens) == (reason, "tpot", 12)
    assert refused.estimate_ms == pytest.approx(PROFILE.decode_step_ms(1, 10 + 4 / 2))


# ------------------------------------------------------------------ vLLM's own moves


def test_vllm_cache_hits_shrink_a_planned_prefill() -> None:
    b = book()
    fake = FakeVllm(b)
    fake.add("r", 1000, slo=RELAXED, now=0.0, cached=800, estimate=0)
    order = fake.step(0.0)
    assert order.prefill == (("r", 1000),)  # planned on the estimate
    assert fake.steps[-1] == {"r": 200}  # vLLM found 800 cached tokens
    assert b.phase_of("r") is Phase.DECODING  # and the book knows the prefill is done
    ft = events_of(b, FirstToken)[0]
    assert ft.context_tokens == 800 and ft.prefill_tokens == 200


def test_evicted_requests_wait_again_or_resume_first() -> None:
    b = book()
    fake = FakeVllm(b)
    fake.add("early", 100, slo=RELAXED, now=0.0, max_tokens=50)
    fake.add("streaming", 100, slo=RELAXED, now=0.0, max_tokens=50)
    fake.step(0.0)
    fake.step(0.01)
    assert b.phase_of("streaming") is Phase.DECODING
    fake.evict("streaming", 0.02)
    assert b.running == 1 and b.stats.evicted == 1
    fake.add("new", 100, slo=URGENT, now=0.02)
    order = fake.step(0.03)
    assert order.resume == ("streaming",) and order.start == ("new",)
    assert fake.steps[-1]["streaming"] == 102  # its prompt and its two tokens, recomputed
    assert b.phase_of("streaming") is Phase.DECODING and b.running == 3


# ------------------------------------------------------------------ what it reports


def test_events_name_requests_by_the_gateway_id_and_carry_slos_and_load() -> None:
    b = book()
    now = 100.0
    b.arrive(Arrival("vllm-1", 200, 3, now, URGENT, event_id="gw-1", key_bytes=800), now)
    cap = Capacity(free_blocks=1000, block_size=16, max_running=8, running=0, max_tokens=4096)
    hb = b.heartbeat("http://e:8000", ("m",), kv_blocks_used=0, kv_blocks_total=1000)
    assert isinstance(hb, LoadHeartbeat) and hb.waiting == 1 and hb.queued_prefill_tokens == 200
    # vLLM's free blocks include the cached ones no request uses: what is used is held
    assert hb.kv_blocks_held == 0
    assert b.heartbeat("u", ("m",), kv_blocks_used=9, kv_blocks_total=1000).kv_blocks_held == 9
    assert hb.queue_order == "deadline"  # kvgate's S-EDF inside vLLM, unlike vLLM's own FCFS
    assert b.slack_ms("vllm-1", now) == pytest.approx(2_000.0 - 200.0, abs=2.0)
    order = b.plan(now, cap)
    b.after_schedule(StepResult({"vllm-1": 200}, {"vllm-1": 200}, started=["vllm-1"]), now)
    b.step_executed(200.0)
    b.on_output("vllm-1", 1, now + 0.2)
    b.on_output("vllm-1", 2, now + 0.3)
    b.finish("vllm-1", now + 0.3)
    evs = b.drain_events()
    assert order.start == ("vllm-1",)
    assert [type(e).__name__ for e in evs] == [
        "RequestEnqueued",
        "RequestStarted",
        "FirstToken",
        "RequestFinished",
    ]
    assert {e.request_id for e in evs} == {"gw-1"}
    enq, started, ft, fin = evs
    assert isinstance(enq, RequestEnqueued) and isinstance(started, RequestStarted)
    assert (enq.key_bytes, enq.input_tokens, enq.ttft_slo_ms) == (800, 200, 2_000.0)
    assert isinstance(ft, FirstToken) and ft.ttft_ms == pytest.approx(200.0)
    assert ft.prefill_ms == 200.0 and ft.prefill_tokens == 200
    assert isinstance(fin, RequestFinished)
    assert (fin.output_tokens, fin.tpot_ms) == (3, pytest.approx(50.0))
    assert fin.max_tokens == 3  # the cap vLLM was given: routers learn answers against it
    assert b.running == 0 and not b.waiting and "vllm-1" not in b
    # a later request under a 4096 cap, cut short by its client: reported without a cap, and
    # the book's plan for such caps learns nothing from it
    b.arrive(Arrival("vllm-2", 200, 4096, now + 1, RELAXED, event_id="gw-2"), now + 1)
    b.plan(now + 1, cap)
    b.after_schedule(StepResult({"vllm-2": 200}, {"vllm-2": 200}, started=["vllm-2"]), now + 1)
    b.on_output("vllm-2", 1, now + 1.2)
    b.finish("vllm-2", now + 1.3, cancelled=True)
    (cut,) = events_of(b, RequestFinished)
    assert cut.max_tokens is None and b.output_fit.fraction(4096) == 1.0


def test_steps_are_timed_against_the_profiles_plan_for_them() -> None:
    """Each step's run time is summed beside what the profile planned for it (a 100-token
    prefill alone: 100 ms on the test profile), and a step over 1.5x its plan is counted:
    the operator's sign that the profile the policy sizes steps with needs refitting."""
    b = book()
    f = FakeVllm(b)
    f.add("r", 100, slo=RELAXED, now=0.0, max_tokens=3)
    f.step(0.0, exec_ms=90.0)  # the whole prefill, a bit faster than planned
    assert f.last_planned_ms == pytest.approx(100.0)
    assert (b.stats.step_exec_ms, b.stats.step_planned_ms) == (90, 100)
    assert b.stats.steps_over_plan == 0
    f.step(0.1, exec_ms=40.0)  # one decode step (1 x 1 + 10 = 11 ms planned): far over
    assert (b.stats.step_exec_ms, b.stats.step_planned_ms) == (130, 111)
    assert b.stats.steps_over_plan == 1
    assert b.stats.as_dict()["steps_over_plan"] == 1


def test_fit_speed_slows_the_plan_to_the_steps_as_they_run() -> None:
    """Steps that run twice their plan make the book plan on a profile twice as slow (same
    name: routers load it by name), so its slices and feasibility match the engine; off by
    default in the book (the plug-in turns it on)."""
    import math

    b = VllmBook(PROFILE, SchedulerConfig(), fit_speed=True)
    f = FakeVllm(b)
    t = 0.0
    for i in range(800):
        f.add(f"r{i}", 20, slo=RELAXED, now=t, max_tokens=2)
        f.step(t, exec_ms=1.0)
        t += 0.05
    # what the fake reported is 1 ms a step, far under plan: the profile speeds up
    assert b.speed < 1.0 and b.stats.speed_permille == round(b.speed * 1000)
    slow = VllmBook(PROFILE, SchedulerConfig(), fit_speed=True)
    for _ in range(1000):  # a step the base profile plans at 50 ms takes 100
        slow._step_base_ms = 50.0
        slow.step_executed(100.0)
    assert slow.speed == pytest.approx(2.0, rel=0.1)
    assert slow.profile.name == PROFILE.name
    assert slow.profile.prefill_ms(100) == pytest.approx(2 * PROFILE.prefill_ms(100), rel=0.1)
    assert slow.predict(1000) > 1.8 * book().predict(1000)
    assert math.isclose(book().speed, 1.0)
    # steps on plan: nothing changes
    steady = VllmBook(PROFILE, SchedulerConfig(), fit_speed=True)
    for _ in range(1000):
        steady._step_base_ms = 50.0
        steady.step_executed(52.0)
    assert steady.speed == 1.0 and steady.profile is PROFILE


def test_fit_speed_finds_a_per_step_overhead_the_profile_lacks() -> None:
    """Steps of varied size that run 1.5x their plan plus 10 ms each (vLLM's own per-step
    work): the book plans on 1.5x the profile with the 10 ms in every decode step, so a
    small decode step is planned at its real time, not at a ratio fitted on big prefills."""
    b = VllmBook(PROFILE, SchedulerConfig(), fit_speed=True)
    for i in range(1000):
        base = (5.0, 20.0, 80.0)[i % 3]
        b._step_base_ms = base
        b.step_executed(1.5 * base + 10.0)
    assert b.speed == pytest.approx(1.5, rel=0.02)
    assert b.overhead_ms == pytest.approx(10.0, rel=0.05)
    assert (b.stats.speed_permille, b.stats.overhead_us) == (
        round(b.speed * 1000),
        round(b.overhead_ms * 1000),
    )
    small = PROFILE.decode_step_ms(2, 100.0)
    assert b.profile.decode_step_ms(2, 100.0) == pytest.approx(1.5 * small + 10.0, rel=0.02)
    assert b.profile.prefill_ms(500) == pytest.approx(1.5 * PROFILE.prefill_ms(500), rel=0.02)
    planned_small = b.profile.decode_step_ms(2, 100.0)
    # then a long stretch of small decode steps only, 20% slower than that line: they are
    # planned at their real time and the slope stays about what the varied steps showed (a
    # ratio of the means would plan them, and every prefill, at ~4x the profile)
    for _ in range(1000):
        b._step_base_ms = 5.0
        b.step_executed(1.2 * (1.5 * 5.0 + 10.0))
    assert b.speed * 5.0 + b.overhead_ms == pytest.approx(21.0, rel=0.05)
    assert 1.3 < b.speed < 2.0
    # the old rule, one ratio of the means, would plan that small step at ~2x (not 1.5x + 10)
    ratio = (1.5 * 35.0 + 10.0) / 35.0
    assert ratio * small < 0.8 * planned_small
    # plans that hardly vary cannot tell an overhead from a slope: the ratio alone
    flat = VllmBook(PROFILE, SchedulerConfig(), fit_speed=True)
    for _ in range(1000):
        flat._step_base_ms = 40.0
        flat.step_executed(70.0)
    assert flat.speed == pytest.approx(1.75, rel=0.01) and flat.overhead_ms == 0.0
