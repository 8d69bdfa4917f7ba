"""Block hashing, cost model, SLO parsing and routing-key derivation."""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine_reporter.hashing import ROOT, block_hash, chain_hashes, split_blocks
from kvgate.cost_model import (
    MIN_PREFILL_SHARE,
    CostProfile,
    PrefillSegment,
    ProfileError,
    announced_profile,
    default_profile,
    load_profile,
    prefill_share,
)
from kvgate.openai_request import (
    ChatTemplate,
    RequestError,
    canonical_chat_bytes,
    parse_request,
)
from kvgate.slo import SLO_CLASSES, Slo


def test_block_hash_is_stable_and_chained() -> None:
    # Fixed values: a change of hash function breaks every stored snapshot, so it must be loud.
    assert block_hash(None, b"hello") == block_hash(ROOT, b"hello")
    assert block_hash(None, b"hello") == 0xD44590FB573E0397
    a, b = chain_hashes(None, [b"ab", b"cd"])
    assert a == block_hash(None, b"ab") and b == block_hash(a, b"cd")
    assert block_hash(1, b"cd") != block_hash(2, b"cd")
    assert list(split_blocks(b"abcdefg", 3)) == [b"abc", b"def"]


def test_default_profile_matches_preble_equation() -> None:
    p = default_profile()
    assert p.prefill_ms(100) == pytest.approx(22 / 0.9)
    # Preble's linear piece, extended down to its 22-ms floor (its 192-383 quadratic dropped)
    assert p.prefill_ms(200) == pytest.approx((0.10842571 * 200 + 4.2098) / 0.9)
    assert p.prefill_ms(164) == pytest.approx(22 / 0.9)
    n, c = 1000, 2000  # n c > 1024^2: attention term applies
    expect = 0.10842571 * n + 4.2098 + 1.13e-3 * n + 1.75e-3 * c + 2.19e-6 * n * c
    assert p.prefill_ms(n, c) == pytest.approx(expect / 0.9)
    assert p.prefill_ms(1000, 0) == pytest.approx((0.10842571 * 1000 + 4.2098) / 0.9)
    assert p.decode_step_ms(0, 100) == 0
    assert p.decode_step_ms(2, 100) == pytest.approx(1.7e-4 * 200 + 0.16 + 19)
    assert p.tokens_for_bytes(9) == 3 and p.tokens_for_bytes(0) == 1
    assert p.block_bytes == 64


def test_a_chunked_prompt_pays_each_chunks_attention_to_the_ones_before_it() -> None:
    """An engine that prefills a long prompt in pieces runs each piece with the earlier ones
    as its context: the prompt costs the pieces' sum, more than one piece of it (whose
    attention the profile's linear fit averages in), and the same where it fits in a piece."""
    p = default_profile()
    assert p.prompt_prefill_ms(5000, 0, 8192) == p.prefill_ms(5000)
    assert p.prompt_prefill_ms(5000, 300, 0) == p.prefill_ms(5000, 300)
    pieces = p.prefill_ms(8192) + p.prefill_ms(8192, 8192) + p.prefill_ms(7616, 16384)
    assert p.prompt_prefill_ms(24000, 0, 8192) == pytest.approx(pieces)
    assert p.prompt_prefill_ms(24000, 0, 8192) > 1.15 * p.prefill_ms(24000)
    # smaller pieces attend more (each to more of the prompt's own context, in more pieces)
    assert p.prompt_prefill_ms(24000, 0, 2048) > p.prompt_prefill_ms(24000, 0, 8192)
    # a cached prefix is every piece's context
    assert p.prompt_prefill_ms(9000, 4000, 8192) == pytest.approx(
        p.prefill_ms(8192, 4000) + p.prefill_ms(808, 12192)
    )
    assert p.prompt_prefill_ms(0, 100, 8192) == 0.0
    # summed in closed form: the same as pricing each piece in turn, wherever the attention
    # threshold falls among the pieces (and a tiny chunk is no slower to price)
    for n, c, k in [(24000, 0, 8192), (9000, 4000, 8192), (5000, 0, 64), (40001, 3, 1000),
                    (16384, 0, 8192), (1_000_000, 0, 16), (3000, 2_000_000, 512)]:  # fmt: skip
        total, left, ctx = 0.0, n, c
        while left > 0:
            piece = min(k, left)
            total += p.prefill_ms(piece, ctx)
            ctx += piece
            left -= piece
        assert p.prompt_prefill_ms(n, c, k) == pytest.approx(total, rel=1e-9)


def test_extra_prefill_is_the_tokens_share_without_a_prefills_fixed_cost() -> None:
    """What recomputing evicted tokens adds to the prefill of the request that wants them: the
    curve's last segment's slope, and their attention to the context, not a prefill of their
    own (a 32-token block alone sits on the 22-ms floor)."""
    p = default_profile()
    slope = 0.10842571 / 0.9
    assert p.extra_prefill_ms(0) == 0.0
    assert p.extra_prefill_ms(32) == pytest.approx(32 * slope)
    assert p.extra_prefill_ms(32) < p.prefill_ms(32) / 6
    assert p.extra_prefill_ms(2000) == pytest.approx(2000 * slope)
    assert p.extra_prefill_ms(2000) < p.prefill_ms(2000)
    n, c = 1000, 2000  # n c > 1024^2: their attention to the context counts
    attention = (1.13e-3 * n + 2.19e-6 * n * c) / 0.9
    assert p.extra_prefill_ms(n, c) == pytest.approx(n * slope + attention)
    assert p.slowed(2.0).extra_prefill_ms(500) == pytest.approx(2 * p.extra_prefill_ms(500))


def test_prefill_share_is_what_the_decode_step_leaves_of_the_step_budget() -> None:
    assert prefill_share(0.0, 90.0) == 1.0  # nothing decodes
    assert prefill_share(30.0, 90.0) == pytest.approx(2 / 3)
    assert prefill_share(120.0, 90.0) == MIN_PREFILL_SHARE  # one operator a step, at least
    assert prefill_share(30.0, math.inf) == 1.0  # no TPOT SLO to keep


def test_profile_round_trip_and_errors(tmp_path) -> None:
    p = default_profile()
    assert CostProfile.from_dict(p.to_dict()) == p
    with pytest.raises(ProfileError, match="malformed"):
        CostProfile.from_dict({"name": "x"})
    with pytest.raises(ProfileError, match="no profile"):
        load_profile("no-such-profile")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ProfileError, match="invalid JSON"):
        load_profile(str(bad))


@pytest.mark.parametrize(
    "change",
    [
        {"decode": {"a": 0.0, "b": 0.08, "c": 0.0, "d": 1.7e308}},
        {"decode": {"a": 0.0, "b": 0.08, "c": 1.7e308, "d": 19.0}},
        {"block_tokens": 1.7e308},
        {"block_tokens": 1 << 20},
        {"bytes_per_token": 1e300},
        {"kv_blocks": 2**64},
        {"max_running": 1e300},
    ],
)
def test_a_profile_no_engine_has_is_refused(change: dict) -> None:
    """Finite but absurd figures (a profile comes off the wire, inline in a heartbeat)
    overflowed the router's arithmetic and failed every decision of the fleet."""
    data = {**default_profile().to_dict(), **change}
    with pytest.raises(ProfileError, match=r"no engine's|whole number up to"):
        CostProfile.from_dict(data)
    eff = default_profile().to_dict()
    eff["prefill"]["efficiency"] = 1e-300
    with pytest.raises(ProfileError, match="efficiency"):
        CostProfile.from_dict(eff)


def test_parse_chat_canonical_key_and_slo() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 7,
        "slo": {"class": "chat"},
    }
    req = parse_request("chat", body, {"x-kvgate-tpot-ms": "40"})
    assert req.key == b"<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert req.stream and req.include_usage and req.max_tokens == 7
    assert req.slo == Slo(250.0, 40.0, "chat") and req.slo_stated


def test_tools_are_a_shared_prefix() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    k1 = canonical_chat_bytes([{"role": "user", "content": "a"}], tools)
    k2 = canonical_chat_bytes([{"role": "user", "content": "b"}], tools)
    assert k1.startswith(b"<|tools|>\n") and k1[:40] == k2[:40]


@pytest.mark.parametrize(
    "endpoint, body, headers, param",
    [
        ("chat", [], {}, None),
        ("chat", {"messages": [{"role": "user", "content": "x"}]}, {}, "model"),
        ("chat", {"model": "m", "messages": []}, {}, "messages"),
        ("chat", {"model": "m", "messages": [{"content": "x"}]}, {}, "messages[0].role"),
        ("completions", {"model": "m"}, {}, "prompt"),
        ("completions", {"model": "m", "prompt": 5}, {}, "prompt"),
        ("completions", {"model": "m", "prompt": "x", "max_tokens": -1}, {}, "max_tokens"),
        ("completions", {"model": "m", "prompt": "x", "stream": "yes"}, {}, "stream"),
        ("completions", {"model": "m", "prompt": "x"}, {"x-kvgate-ttft-ms": "abc"}, None),
        ("completions", {"model": "m", "prompt": "x"}, {"x-kvgate-ttft-ms": "-5"}, None),
        ("completions", {"model": "m", "prompt": "x", "slo": {"class": "nope"}}, {}, "slo.class"),
        ("completions", {"model": "m", "prompt": "x", "kvgate": {"input_tokens": 0}}, {}, None),
    ],
)
def test_bad_requests_raise_with_param(endpoint, body, headers, param) -> None:
    with pytest.raises(RequestError) as exc:
        parse_request(endpoint, body, headers)
    assert exc.value.status == 400
    if param is not None:
        assert exc.value.param == param
    assert exc.value.to_body()["error"]["message"]


def test_content_parts_are_objects_and_bounded_in_number() -> None:
    """Each part is rendered for the routing key on the gateway's event loop: millions of
    non-object parts in a body under the size limit held every client for a minute."""
    from kvgate.openai_request import MAX_CONTENT_PARTS

    def chat(*contents: list) -> dict:
        return {"model": "m", "messages": [{"role": "user", "content": c} for c in contents]}

    with pytest.raises(RequestError) as exc:
        parse_request("chat", chat(["a", None]), {})
    assert exc.value.param == "messages[0].content[1]"
    part = {"type": "text", "text": "x"}
    half = [part] * (MAX_CONTENT_PARTS // 2)
    parse_request("chat", chat(half, half), {})  # at the bound
    with pytest.raises(RequestError, match="content parts") as exc:
        parse_request("chat", chat(half, [*half, part]), {})
    assert exc.value.param == "messages[1].content"
    deep: object = {"type": "x"}
    for _ in range(300):  # (orjson reads 1,024 levels but writes 254)
        deep = [deep]
    with pytest.raises(RequestError, match="nested too deeply"):
        parse_request("chat", chat([{"type": "x", "a": deep}]), {})


def test_what_openai_accepts_still_parses() -> None:
    """The edges of the checks: bounds included, every prompt shape, plain SLO numbers."""
    ok = {"model": "m", "temperature": 2, "top_p": 1.0, "stop": ["a", "b"]}
    for prompt in ("x", ["a", "b"], [0, 5], [[1, 2], [3]]):
        parse_request("completions", {**ok, "prompt": prompt}, {})
    parse_request("completions", {"model": "m", "prompt": "x", "temperature": 0}, {})
    parse_request("completions", {"model": "m", "prompt": "x", "stop": "\n", "top_p": 0}, {})
    for text, ms in (("250", 250.0), (" 1.5 ", 1.5), (".5", 0.5), ("1e3", 1000.0), ("1e+03", 1e3)):
        slo = parse_request(
            "completions", {"model": "m", "prompt": "x"}, {"x-kvgate-ttft-ms": text}
        )
        assert slo.slo.ttft_ms == ms, text


def test_chat_template_rendering() -> None:
    tpl = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}",
        bos_token="<s>",
    )
    req = parse_request(
        "chat", {"model": "m", "messages": [{"role": "user", "content": "q"}]}, {}, template=tpl
    )
    assert req.key == b"<s>[user]q[assistant]"


def test_slo_defaults_to_relaxed_class() -> None:
    req = parse_request("completions", {"model": "m", "prompt": "x"}, {})
    assert req.slo == SLO_CLASSES["relaxed"] and not req.slo_stated


def test_tune_gc_freezes_and_raises_the_young_threshold() -> None:
    """The router and gateway processes' collector settings (kvgate.runtime)."""
    import gc

    from kvgate.runtime import GC_THRESHOLDS, tune_gc

    before = gc.get_threshold()
    try:
        applied = tune_gc()
        assert gc.get_threshold() == GC_THRESHOLDS == tuple(applied["thresholds"])
        assert gc.get_freeze_count() > 0 and applied["frozen_objects"] == gc.get_freeze_count()
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_speed_fit_converges_follows_drift_and_ignores_nonsense() -> None:
    from kvgate.cost_model import SpeedFit

    fit = SpeedFit(alpha=0.05)
    assert (fit.prefill, fit.decode) == (1.0, 1.0)  # the profile until told otherwise
    fit.observe_prefill(100.0, 200.0)
    assert fit.prefill == pytest.approx(2.0)  # young evidence: a running mean, at once
    for _ in range(20):
        fit.observe_prefill(100.0, 200.0)
        fit.observe_decode(10.0, 5.0)
    assert fit.prefill == pytest.approx(2.0) and fit.decode == pytest.approx(0.5)
    for _ in range(200):  # the engine got faster: followed within ~1/alpha samples
        fit.observe_prefill(100.0, 100.0)
    assert fit.prefill == pytest.approx(1.0, rel=0.01)
    before = fit.prefill
    for bad in ((0.0, 10.0), (10.0, 0.0), (float("nan"), 1.0), (1.0, float("inf"))):
        fit.observe_prefill(*bad)
    assert fit.prefill == before
    fit.observe_prefill(1.0, 1e9)  # one absurd sample moves it by at most alpha x log 8
    assert fit.prefill <= before * 8.0**0.05 + 1e-9
    # a ratio that underflows (or overflows) a float is clipped, not a math domain error
    for predicted, observed in ((1e300, 5e-324), (5e-324, 1e300)):
        fit.observe_prefill(predicted, observed)
        fit.observe_decode(predicted, observed)
    assert math.isfinite(fit.prefill) and math.isfinite(fit.decode)
    weak = SpeedFit()
    weak.observe_prefill(100.0, 300.0, weight=0.5)
    assert weak.prefill_evidence == 0.5 and weak.prefill == pytest.approx(3.0)


def test_ttft_fit_reads_one_engine_against_the_fleets_fastest_and_not_noise() -> None:
    """What every engine's TTFT holds beside its prefill (the HTTP path, the host) cancels in
    the comparison; the engines within noise of the fastest are the reference, and a gap
    within two standard errors of the difference reads as none."""
    from kvgate.cost_model import TtftFit, slower_than, ttft_reference

    fast, slow, twin, few = TtftFit(), TtftFit(), TtftFit(), TtftFit()
    assert fast.se2() == math.inf and ttft_reference([fast], 2.0) is None  # nothing seen yet
    noise = (0.9, 1.1, 1.0, 1.2, 0.8) * 8
    for n in noise:  # all 3x their prediction (a common delay); slow 2x more
        assert fast.observe(100.0, 300.0 * n)
        slow.observe(100.0, 600.0 * n)
        twin.observe(100.0, 300.0 * n * (1.05 if n > 1 else 0.95))
    assert fast.log == pytest.approx(math.log(3.0), abs=0.05)
    for _ in range(2):  # two samples that happen to agree: their own variance is 0
        few.observe(100.0, 400.0)
    ref = ttft_reference([fast, slow, twin, few], 2.0)
    assert ref is not None and ref.log == pytest.approx(math.log(3.0), abs=0.05)  # fast, twin
    assert ref.variance > 0.0 and ref.sd == 2.0  # pooled over the fleet; 4 engines: 2 sd
    gap = slower_than(slow, ref)
    assert math.log(1.6) < gap < math.log(2.0)  # 2x, less two standard errors
    blunt = dataclasses.replace(ref, sd=0.0)
    assert slower_than(slow, blunt) == pytest.approx(math.log(2.0), abs=0.05)
    assert slower_than(twin, ref) == 0.0 and slower_than(fast, ref) == 0.0
    # 1.33x on two samples: the fleet's variance, not their own, bounds what they say
    assert 0.0 <= slower_than(few, ref) < 0.5 * math.log(4.0 / 3.0)
    assert slower_than(few, blunt) == pytest.approx(math.log(4.0 / 3.0), abs=0.05)
    before = (fast.log, fast.evidence)
    for bad in ((0.0, 1.0), (1.0, math.nan), (100.0, 200.0, 0.0)):
        assert not fast.observe(*bad)
    assert (fast.log, fast.evidence) == before


def test_a_fleet_reference_is_re_read_once_in_as_many_readings_as_engines() -> None:
    """The reference is a fleet-wide figure: due at the first reading, then once in as many
    readings as the fleet has engines; a re-read over no fitted engine leaves it unset (due
    again at the next)."""
    from kvgate.cost_model import FleetReference, TtftFit, ttft_reference

    fits = [TtftFit(), TtftFit()]
    for f, x in zip(fits, (300.0, 600.0), strict=True):
        for _ in range(3):
            f.observe(100.0, x)
    reference = FleetReference(2.0)
    assert reference.due(3) and reference.reread([]) is None and reference.ref is None
    assert reference.due(3)  # (still nothing to read against)
    assert reference.reread(fits) == ttft_reference(fits, 2.0) == reference.ref
    assert [reference.due(3) for _ in range(4)] == [False, False, True, True]
    reference.reread(fits)
    assert not reference.due(3)


def test_output_fit_plans_on_the_cap_until_answers_under_it_have_ended() -> None:
    from kvgate.cost_model import OutputFit

    fit = OutputFit(alpha=0.05)
    assert fit.expected(4096) == 4096 and fit.fraction(4096) == 1.0  # nothing known yet
    fit.observe(4096, 200)
    assert fit.expected(4096) == 200  # the first answer under that cap, at once
    for out in (100, 300) * 10:
        fit.observe(4096, out)
    assert fit.expected(4096) == pytest.approx(200, abs=3)
    assert fit.expected(5000) == round(5000 * fit.fraction(4096))  # same power-of-two bucket
    assert fit.expected(300) == 300  # another client's cap: its own bucket, still the cap
    for _ in range(50):  # a trace replay states each answer's length: planned at exactly that
        fit.observe(300, 300)
    assert fit.expected(300) == 300 and fit.fraction(300) == 1.0
    for _ in range(200):  # answers got longer: followed within ~1/alpha of them
        fit.observe(4096, 2048)
    assert fit.expected(4096) == pytest.approx(2048, rel=0.01)
    before = fit.fraction(4096)
    for bad in ((0, 10), (10, 0), (-5, 3)):
        fit.observe(*bad)
    assert fit.fraction(4096) == before
    fit.observe(100, 5000)  # more than its cap (a miscounted report): at most the cap
    assert fit.expected(100) == 100 and fit.expected(1) == 1 and fit.expected(0) == 1


def test_slowed_profiles_by_name() -> None:
    base = load_profile("mistral-7b-a6000")
    slow = load_profile("mistral-7b-a6000@x2")
    assert slow.name == "mistral-7b-a6000@x2"
    assert slow.prefill_ms(3000, 1000) == pytest.approx(2 * base.prefill_ms(3000, 1000))
    assert slow.decode_step_ms(8, 2000) == pytest.approx(2 * base.decode_step_ms(8, 2000))
    assert slow.kv_blocks == base.kv_blocks
    assert base.slowed(1) is base
    with pytest.raises(ProfileError, match="NAME@xFACTOR"):
        load_profile("mistral-7b-a6000@xfast")
    with pytest.raises(ProfileError, match="positive"):
        load_profile("mistral-7b-a6000@x0")


def test_an_engine_announces_its_profile_by_name_only_where_a_router_can_load_it() -> None:
    """A built-in profile (or NAME@xK of one) goes by its name; any other, such as a file
    fitted on the engine's host or a built-in's name with other numbers, goes inline as JSON,
    which a router resolves to the very same profile."""
    from dataclasses import replace

    tiny = load_profile("vllm-cpu-tiny")
    assert announced_profile(tiny) == "vllm-cpu-tiny"
    assert announced_profile(load_profile("vllm-cpu-tiny@x3")) == "vllm-cpu-tiny@x3"
    for custom in (replace(tiny, name="my-vllm"), replace(tiny, kv_blocks=128)):
        spec = announced_profile(custom)
        assert spec.startswith("{") and len(spec) < 1024
        assert load_profile(spec) == custom
    assert load_profile("vllm-cpu-tiny") is tiny
    for bad in ("{not json", "[1, 2]", '{"name": "x"}', "no-such-profile"):
        with pytest.raises(ProfileError):
            load_profile(bad)


def test_a_prefill_curve_that_falls_with_more_tokens_is_rejected() -> None:
    # Preble's released fit: its quadratic piece falls from 33 ms at 200 tokens to 0 at 381
    released = (
        PrefillSegment(384, (4.2098, 0.10842571)),
        PrefillSegment(192, (-118.0, 1.25, -2.56e-3)),
        PrefillSegment(0, (22.0,)),
    )
    with pytest.raises(ProfileError, match="prefill time falls as tokens grow"):
        CostProfile("preble-released", released)
    # a jump down at a segment's boundary is caught too
    with pytest.raises(ProfileError, match="at 384"):
        CostProfile("step-down", (PrefillSegment(384, (10.0,)), PrefillSegment(0, (22.0,))))
    # every shipped profile grows, at every speed
    for name in ("mistral-7b-a6000", "vllm-cpu-small", "vllm-cpu-tiny"):
        prof = load_profile(name)
        assert prof.slowed(2.0).prefill_ms(383) >= prof.slowed(2.0).prefill_ms(300)
