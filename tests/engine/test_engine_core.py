"""EngineCore: the state machine, events, usage, cancellation, heartbeat, the token rule."""

from __future__ import annotations

import pytest
from engine_testkit import core, linear_profile, req, run_until

from broker.events import (
    BlockStored,
    FirstToken,
    RequestEnqueued,
    RequestFinished,
    RequestRejected,
    RequestStarted,
)
from engine.core import EngineCore
from engine.costs import TtftPredictor, least_squares, prefill_batch_ms
from engine.scheduler import POLICIES, make_policy
from engine.scheduler.state import Phase, TransitionError
from engine.text import TOKEN_BYTES, token_text, tokens_text
from kvgate.cost_model import default_profile, load_profile


def test_illegal_transition_names_the_request_and_the_move() -> None:
    c = core()
    c.submit(req("A", 10), 0.0)
    st = c.waiting[0]
    with pytest.raises(TransitionError, match=r"request A: illegal move waiting -> decoding"):
        st.move(Phase.DECODING)


def test_events_and_usage_of_one_request() -> None:
    c = core()
    key = b"k" * 200  # 50 tokens, 3 full 64-byte blocks
    c.submit(req("A", 50, out=3, tpot_ms=100, key=key), 0.0)
    outs = run_until(c, 10.0)
    kinds = [type(e) for e in c.drain_events()]
    assert kinds == [RequestEnqueued, RequestStarted, BlockStored, FirstToken, RequestFinished]
    assert [o.index for o in outs] == [0, 1, 2]
    usage = outs[-1].usage
    assert usage is not None and usage.completion_tokens == 3 and usage.cached_tokens == 0
    assert usage.ttft_ms == pytest.approx(50.0)  # 1 ms per token
    assert usage.tpot_ms == pytest.approx(11.0)  # decode step B + 10 ms with B = 1
    # The same prompt again: 3 cached blocks = 192 of 200 bytes = 48 tokens.
    c.submit(req("B", 50, out=1, key=key, at=10.0), 10.0)
    outs = run_until(c, 20.0)
    assert outs[-1].usage.cached_tokens == 48
    assert outs[-1].usage.ttft_ms == pytest.approx(2.0)


def test_inter_token_latencies_are_counted_as_tokens_come() -> None:
    """The engine counts each decoded token's time since its request's previous token, as
    vLLM's inter-token latency histogram does: while a request is still decoding, not when it
    ends (a bridge reads an engine's current TPOT off the difference of two readings)."""
    c = core()
    c.submit(req("A", 50, out=200, tpot_ms=100), 0.0)
    run_until(c, 0.5)  # its first token at 50 ms, then a token every 11 ms
    assert c.finished == 0
    assert c.itl_tokens == 40  # the tokens after the first that came by 0.5 s
    assert c.itl_s_total == pytest.approx(40 * 0.011)
    run_until(c, 10.0)
    assert c.finished == 1 and c.itl_tokens == 199
    assert c.itl_s_total == pytest.approx(199 * 0.011)


def test_a_finished_answer_is_cached_for_the_turn_that_resends_it() -> None:
    """vLLM and SGLang cache a finished request's output tokens: a conversation's next turn,
    which resends the answer, finds it cached. 50 prompt tokens (200 bytes, 3 whole blocks of
    64) and 30 output tokens: 320 bytes, 5 whole blocks cached after it ends. Without the
    answer's bytes (``answer_key``) its 5 blocks are cached all the same (they take room, as in
    vLLM), but as bytes of its own: the next turn finds only the prompt's 3."""
    from dataclasses import replace

    prompt = bytes(range(65, 65 + 50)) * 4
    answer = b"z" * 120  # what the next turn resends of the answer (30 tokens)
    nxt = prompt + answer + b"<|user|> and then?"
    for answer_key, cached in ((answer, 320 // 4), (b"", 192 // 4)):
        c = core()
        c.submit(replace(req("A", 50, out=30, key=prompt), answer_key=answer_key), 0.0)
        run_until(c, 10.0)
        stored = [e for e in c.drain_events() if isinstance(e, BlockStored)]
        assert sum(len(e.hashes) for e in stored) == 5
        assert c.cache.used_blocks == 5  # (finished: cached, unpinned)
        c.submit(req("B", len(nxt) // 4, key=nxt, at=10.0), 10.0)
        outs = run_until(c, 20.0)
        assert outs[-1].usage is not None and outs[-1].usage.cached_tokens == cached
    # a refused or cancelled request has no answer to cache
    c = core()
    c.submit(replace(req("A", 50, out=1000, key=prompt), answer_key=answer), 0.0)
    run_until(c, 0.1)
    c.cancel("A", 0.1)
    assert c.cache.match(c.cache.key_hashes(nxt)) == 3


def test_an_answer_key_given_as_a_function_is_made_once_and_only_when_it_ends() -> None:
    from dataclasses import replace

    prompt = bytes(range(65, 65 + 50)) * 4
    made: list[str] = []

    def answer(name: str) -> bytes:
        made.append(name)
        return b"z" * 120

    c = core()
    c.submit(replace(req("A", 50, out=30, key=prompt), answer_key=lambda: answer("A")), 0.0)
    c.submit(replace(req("B", 50, out=1000, key=prompt), answer_key=lambda: answer("B")), 0.0)
    run_until(c, 0.1)
    assert made == []
    c.cancel("B", 0.1)
    run_until(c, 10.0)
    assert made == ["A"]  # B was cancelled: its answer never made
    nxt = prompt + b"z" * 120 + b"<|user|> and then?"
    assert c.cache.match(c.cache.key_hashes(nxt)) == 5  # A's answer is cached as its bytes


def test_cancel_frees_kv_and_emits_a_terminal_event() -> None:
    c = core(profile=linear_profile(kv_blocks=100))
    c.submit(req("A", 100, out=1000), 0.0)
    run_until(c, 0.2)
    assert c.phase_of("A") is Phase.DECODING and c.cache.used_blocks > 60
    c.cancel("A", 0.2)
    assert "A" not in c and c.running == 0 and c.cache.evictable_blocks == c.cache.used_blocks
    fin = [e for e in c.drain_events() if isinstance(e, RequestFinished)]
    assert fin and fin[0].output_tokens >= 1
    c.submit(req("W", 10, at=0.3), 0.3)
    c.cancel("W", 0.3)
    assert isinstance(c.drain_events()[-1], RequestRejected)
    assert run_until(c, 5.0) == []


def test_request_larger_than_the_kv_is_rejected_at_once() -> None:
    c = core(profile=linear_profile(kv_blocks=10))
    c.submit(req("big", 200, out=1), 0.0)
    (out,) = c.advance(0.0)
    assert out.rejected and "KV blocks" in out.rejected


def test_kv_pressure_makes_requests_wait_then_run() -> None:
    c = core("fcfs", profile=linear_profile(kv_blocks=20))
    c.submit(req("A", 160, out=100), 0.0)  # 17 blocks for its whole life
    c.submit(req("B", 160, out=1), 0.0)  # 11 blocks: waits for A
    outs = run_until(c, 100.0)
    done = [o.request_id for o in outs if o.usage]
    assert done == ["A", "B"]


def test_heartbeat_reports_load() -> None:
    c = core()
    c.submit(req("A", 1000, tpot_ms=50), 0.0)
    c.submit(req("B", 500, tpot_ms=100), 0.0)
    c.advance(0.0)
    hb = c.heartbeat("http://127.0.0.1:1", ("m",))
    assert hb.running + hb.waiting == 2 and hb.kv_blocks_total == 100_000
    assert hb.queued_prefill_tokens == 1500
    assert hb.vbs == pytest.approx(1.5)
    # a profile no router has by its name ("linear-test") goes inline, for routers to read
    assert load_profile(hb.profile) == c.profile and hb.profile.startswith("{")
    assert core(profile=default_profile()).heartbeat("u", ("m",)).profile == "mistral-7b-a6000"


def test_heartbeat_reports_the_kv_its_requests_hold_apart_from_idle_cache() -> None:
    """``kv_blocks_held`` is what admitted requests hold (pinned prefix and reservation, the
    whole output reserved at admission): a request in its prefill holds its memory, and once
    it ends its blocks stay cached (``kv_blocks_used``) but nobody holds them."""
    c = core(profile=linear_profile(kv_blocks=1_000))
    c.submit(req("A", 1600, out=3), 0.0)  # 100 blocks of 16 tokens, its output in one more
    c.advance(0.0)  # admitted: its prefill runs
    hb = c.heartbeat("u", ("m",))
    assert hb.kv_blocks_held == 101 and hb.kv_blocks_used == 101
    run_until(c, 100.0)
    hb = c.heartbeat("u", ("m",))
    assert hb.kv_blocks_held == 0 and hb.kv_blocks_used >= 100  # cached, evictable


def test_heartbeats_time_the_prefill_work_of_a_running_step() -> None:
    """An engine running twice as slow as the profile it names: a heartbeat in the middle of a
    lone 4,000-token prefill (one step) already reports the operators done so far, timed and
    planned on the named profile; the next reports the rest; together, the whole prefill."""
    named = linear_profile()
    c = EngineCore("e-slow", named.slowed(2.0), announced=named)
    c.submit(req("A", 4000), 0.0)
    c.advance(0.0)
    hb = c.heartbeat("http://127.0.0.1:1", ("m",), now=4.0)  # half of its 8 s
    assert hb.prefill_ms == pytest.approx(4000.0, rel=0.05)
    assert hb.prefill_plan_ms == pytest.approx(hb.prefill_ms / 2)
    outs = run_until(c, 10.0)
    assert outs and outs[0].first_token and outs[0].times[0] == pytest.approx(8.0)
    rest = c.heartbeat("http://127.0.0.1:1", ("m",), now=10.0)
    assert hb.prefill_ms + rest.prefill_ms == pytest.approx(8000.0)
    assert hb.prefill_plan_ms + rest.prefill_plan_ms == pytest.approx(4000.0)
    idle = c.heartbeat("http://127.0.0.1:1", ("m",), now=11.0)
    assert idle.prefill_ms is None and idle.prefill_plan_ms is None  # nothing ran since


def test_duplicate_request_id_is_a_caller_error() -> None:
    c = core()
    c.submit(req("A", 10), 0.0)
    with pytest.raises(ValueError, match="already"):
        c.submit(req("A", 10), 0.0)


def test_registry_is_the_one_list_of_policies() -> None:
    assert set(POLICIES) == {"slo", "fcfs", "preble"}
    for name in POLICIES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="known: slo, fcfs, preble"):
        make_policy("nope")


def test_output_text_is_deterministic_and_follows_the_token_rule() -> None:
    assert token_text("r1", 5) == token_text("r1", 5)
    assert tokens_text("r1", 0, 3) != tokens_text("r2", 0, 3)
    text = tokens_text("r1", 0, 100)
    assert len(text.encode()) == 100 * TOKEN_BYTES == 100 * default_profile().bytes_per_token


def test_least_squares_recovers_a_cubic() -> None:
    xs = [float(x) for x in range(1, 40)]
    ys = [3.0 - 2.0 * x + 0.5 * x * x + 0.01 * x**3 for x in xs]
    coef = least_squares([(1.0, x, x * x, x**3) for x in xs], ys)
    assert coef == pytest.approx([3.0, -2.0, 0.5, 0.01], rel=1e-7, abs=1e-9)
    with pytest.raises(ValueError, match="rank deficient"):
        least_squares([(1.0, 2.0), (2.0, 4.0), (3.0, 6.0)], [1.0, 2.0, 3.0])


def test_ttft_predictor_tracks_the_profile() -> None:
    p = default_profile()
    pred = TtftPredictor.fit(p)
    for n in (512, 1024, 2048, 8192, 32768):
        assert pred(n) == pytest.approx(p.prefill_ms(n), rel=0.05)
    assert pred(10) == pytest.approx(p.prefill_ms(1))  # the floor
    linear = TtftPredictor.fit(linear_profile())
    assert linear(1234) == pytest.approx(1234.0, rel=1e-6)


def test_batch_prefill_shares_the_dense_part() -> None:
    p = default_profile()
    assert prefill_batch_ms(p, [(1000, 2000)]) == pytest.approx(p.prefill_ms(1000, 2000))
    two = prefill_batch_ms(p, [(100, 0), (100, 0)])
    assert two == pytest.approx(p.prefill_ms(200)) and two < 2 * p.prefill_ms(100)


def test_usage_says_whether_the_slo_was_met() -> None:
    """Two 50-token prompts prefill together (100 ms), then decode in 12 ms steps (B = 2)."""
    c = core(policy="fcfs")
    c.submit(req("met", 50, out=3, ttft_ms=100.5, tpot_ms=12.5), 0.0)
    c.submit(req("slow_tpot", 50, out=3, ttft_ms=10_000, tpot_ms=5, at=0.0), 0.0)
    outs = {o.request_id: o.usage for o in run_until(c, 10.0) if o.usage is not None}
    assert outs["met"].slo_met and outs["met"].slo_class == "custom"
    assert not outs["slow_tpot"].slo_met
    c.submit(req("late", 50, out=1, ttft_ms=1, at=20.0), 20.0)
    (late,) = [o.usage for o in run_until(c, 30.0) if o.usage is not None]
    assert late.ttft_ms > 1 and not late.slo_met


def test_output_filler_is_fixed_by_the_request_and_unique_to_it() -> None:
    """The bytes standing for an answer nobody resends: the same for a request every time (the
    simulation is deterministic), different between requests (no two answers share a block)."""
    from engine.core import output_filler

    a = output_filler("r1", 200)
    assert len(a) == 200 and a == output_filler("r1", 200)
    assert a[:64] != output_filler("r2", 200)[:64]
    assert output_filler("r1", 0) == b""


def test_the_scheduler_plans_answers_at_what_answers_under_their_cap_took() -> None:
    """Clients state max_tokens 4096 and the answers end after 20 tokens: the first request is
    planned at its cap (SCORPIO's mean context: prompt + 2048), the ones submitted after
    answers under that cap ended at about 20; every natural end reports the cap it was given
    (routers learn from it too), a client's cancel reports none and teaches nothing."""
    from dataclasses import replace

    c = core()
    first = replace(req("a0", 100, out=20), max_tokens=4096)
    c.submit(first, 0.0)
    assert c._states["a0"].mean_context == 100 + 4096 / 2
    run_until(c, 1e9)
    assert c.next_event_time() is None  # (idle: the next submits start its clock anew)
    for i in range(1, 4):
        c.submit(replace(req(f"a{i}", 100, out=20, at=100.0), max_tokens=4096), 100.0)
    assert c._states["a3"].mean_context == 100 + 20 / 2
    run_until(c, 1e9)
    events = c.drain_events()
    finished = [e for e in events if isinstance(e, RequestFinished)]
    assert finished and all((e.output_tokens, e.max_tokens) == (20, 4096) for e in finished)
    enqueued = [e for e in events if isinstance(e, RequestEnqueued)]
    assert all(e.max_tokens == 4096 for e in enqueued)  # the cap, as the engine was told
    before = c.output_fit.fraction(4096)
    c.submit(replace(req("gone", 100, out=3000, at=200.0), max_tokens=4096), 200.0)
    outs = run_until(c, 200.5)
    assert any(o.request_id == "gone" for o in outs)  # it is decoding
    c.cancel("gone", 200.5)
    (cut,) = [e for e in c.drain_events() if isinstance(e, RequestFinished)]
    assert cut.request_id == "gone" and cut.max_tokens is None
    assert c.output_fit.fraction(4096) == before
    plain = core()  # no cap stated: the answer's own length, as before
    plain.submit(req("p", 100, out=20), 0.0)
    assert plain._states["p"].mean_context == 100 + 10
