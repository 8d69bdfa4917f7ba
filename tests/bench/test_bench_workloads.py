"""Workloads: determinism, prefix sharing, token rules, transforms, keys equal the gateway's."""

from __future__ import annotations

import gzip
import itertools
import math
from pathlib import Path

import orjson
import pytest

from bench.workloads import (
    WorkloadOptions,
    assign_slo,
    build_workload,
    limit,
    merge,
    scale_rate,
    synthetic,
    window,
)
from bench.workloads.request import Request, Segment, Turn, content_seed, segment_bytes
from bench.workloads.traces import (
    LoadStats,
    hash_segments,
    infer_block_tokens,
    infer_time_unit,
    load_csv_trace,
    load_hash_trace,
)
from bench.workloads.transform import SloSpecError, parse_slo_spec, scaled_slo
from kvgate.cost_model import default_profile, load_profile
from kvgate.openai_request import parse_request
from kvgate.slo import SLO_CLASSES


def _write_mooncake(path: Path, rows: list[dict]) -> Path:
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    return path


def _common_prefix(a: bytes, b: bytes) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_segment_bytes_is_deterministic_ascii_and_prefix_consistent() -> None:
    a = segment_bytes(42, 2048)
    assert a == segment_bytes(42, 2048)
    assert a.isascii() and len(a) == 2048
    assert segment_bytes(42, 100) == a[:100]
    assert segment_bytes(43, 2048) != a
    assert content_seed("mooncake", 7) != content_seed("tool", 7)


def test_mooncake_equal_leading_ids_iff_equal_leading_bytes(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 5, "input_length": 1300, "output_length": 10, "hash_ids": [1, 2, 9]},
        {"timestamp": 9, "input_length": 1100, "output_length": 10, "hash_ids": [4, 2, 3]},
        {"timestamp": 12, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
    ]
    reqs = load_hash_trace(_write_mooncake(tmp_path / "t.jsonl", rows))
    keys = [r.key() for r in reqs]
    block = 512 * 4
    # exact sizes: input_length x 4 bytes, the last block partial
    assert [len(k) for k in keys] == [6000, 5200, 4400, 4096]
    assert all(r.input_tokens == math.ceil(len(k) / 4) for r, k in zip(reqs, keys, strict=True))
    # two shared leading ids -> exactly two shared blocks (then they differ almost at once)
    shared = _common_prefix(keys[0], keys[1])
    assert 2 * block <= shared < 2 * block + 8
    # different first id -> different from the first byte or so
    assert _common_prefix(keys[0], keys[2]) < 8
    # request 3 is a prefix of request 0 (same ids, full blocks)
    assert keys[0].startswith(keys[3])
    # the same id in another position renders the same block bytes
    assert keys[0][block : 2 * block] == keys[2][block : 2 * block]
    assert [r.arrival for r in reqs] == [0.0, 0.005, 0.009, 0.012]


def test_mooncake_bad_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_bytes(
        b'{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [0]}\n'
        b"not json\n"
        b'{"timestamp": 1, "input_length": 5000, "output_length": 3, "hash_ids": [0]}\n'
        b'{"timestamp": 2, "output_length": 3, "hash_ids": [0]}\n'
        b'{"timestamp": 3, "input_length": 10, "output_length": 3, "hash_ids": []}\n'
        b'{"timestamp": -4, "input_length": 10, "output_length": 3, "hash_ids": [1]}\n'
        b"\n"
    )
    stats = LoadStats()
    reqs = load_hash_trace(p, stats=stats)
    assert len(reqs) == 2 and stats.kept == 2 and stats.skipped == 4
    # 5000 tokens named by one 512-token block: kept at its length, the rest its own text
    assert stats.mended == 1 and reqs[1].key_len == 5000 * 4
    assert reqs[1].key()[:40] == reqs[0].key()[:40]


def test_hash_segments_take_the_length_over_the_ids() -> None:
    # more ids than the length fills: the extra ones are dropped
    segs, mended = hash_segments([1, 2, 3], 100, block_tokens=64)
    assert mended and [s.n_bytes for s in segs] == [256, 144]
    # fewer (a trace hashing only whole blocks): the rest is text of its own
    segs, mended = hash_segments([1, 2], 40, block_tokens=16, tail_seed=99)
    assert mended and [s.n_bytes for s in segs] == [64, 64, 32] and segs[2].seed == 99
    segs, mended = hash_segments([1, 2], 30, block_tokens=16)
    assert not mended and [s.n_bytes for s in segs] == [64, 56]
    with pytest.raises(ValueError):
        hash_segments([], 10)


def _qwen_rows() -> list[dict]:
    """Qwen-Bailian-format lines: 16-token blocks, seconds, session keys; a shared system
    prompt of three blocks, and a second turn that extends the first."""
    return [
        {"chat_id": 0, "parent_chat_id": -1, "timestamp": 0.25, "input_length": 70,
         "output_length": 20, "type": "text", "turn": 1, "hash_ids": [1, 2, 3, 4, 5]},
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 1.5, "input_length": 60,
         "output_length": 9, "type": "search", "turn": 1, "hash_ids": [1, 2, 3, 6]},
        {"chat_id": 2, "parent_chat_id": 0, "timestamp": 61.114, "input_length": 130,
         "output_length": 5, "type": "text", "turn": 2,
         "hash_ids": [1, 2, 3, 4, 7, 8, 9, 10, 11]},
    ]  # fmt: skip


def test_qwen_bailian_trace_is_read_as_16_token_blocks_in_seconds(tmp_path: Path) -> None:
    stats = LoadStats()
    reqs = load_hash_trace(_write_mooncake(tmp_path / "q.jsonl", _qwen_rows()), stats=stats)
    assert stats.inferred["block_tokens"] == 16 and stats.inferred["time_unit"] == "s"
    assert [r.arrival for r in reqs] == [0.25, 1.5, 61.114]
    assert [r.key_len for r in reqs] == [280, 240, 520] and stats.mended == 0
    k0, k1, k2 = (r.key() for r in reqs)
    block = 16 * 4
    # three shared ids: three shared 16-token blocks, then different text
    assert 3 * block <= _common_prefix(k0, k1) < 3 * block + 8
    # the second turn shares four whole blocks with the first (id 5 was its partial last)
    assert 4 * block <= _common_prefix(k0, k2) < 4 * block + 8
    # read as Mooncake's 512-token blocks in milliseconds, every line would be lost: given
    # explicitly, the reader obeys (and mends)
    forced = LoadStats()
    reqs = load_hash_trace(tmp_path / "q.jsonl", block_tokens=512, time_unit="ms", stats=forced)
    assert forced.mended == 3 and reqs[2].arrival == pytest.approx(0.061114)
    with pytest.raises(ValueError):
        load_hash_trace(tmp_path / "q.jsonl", time_unit="minutes")


def test_block_size_and_time_unit_inference() -> None:
    # Mooncake's lines: the last block partial
    assert infer_block_tokens([(6758, 14), (7322, 15), (100, 1)]) == (512, 1.0)
    # whole blocks hashed only (floor): 16 fits both lines
    assert infer_block_tokens([(40, 2), (521, 32)])[0] == 16
    # nothing to tell by (one id each): Mooncake's
    assert infer_block_tokens([(10, 1), (5000, 1)]) == (512, 0.0)
    assert infer_time_unit([0, 27482, 30000], session_keys=False) == "ms"
    assert infer_time_unit([0, 61.114], session_keys=False) == "s"
    assert infer_time_unit([0, 61], session_keys=True) == "s"


def test_trace_files_gzipped_or_not_and_an_empty_one_is_an_error(tmp_path: Path) -> None:
    plain = _write_mooncake(tmp_path / "q.jsonl", _qwen_rows())
    packed = tmp_path / "q.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    opts = WorkloadOptions(slo="keep")
    a, b = build_workload(str(plain), opts), build_workload(str(packed), opts)
    assert [r.key() for r in a] == [r.key() for r in b] and len(a) == 3
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"not json\n")
    with pytest.raises(ValueError, match="no requests"):
        build_workload(str(empty), opts)
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload(str(tmp_path / "trace.parquet"), opts)


def test_burstgpt_csv_loads_with_seconds_and_skips_failed_requests(tmp_path: Path) -> None:
    p = tmp_path / "burst.csv"
    p.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,0,1087,Conversation log\n"
        "7.5,GPT-4,120,300,420,API log\n"
    )
    stats = LoadStats()
    reqs = load_csv_trace(p, stats=stats)
    assert stats.skipped == 1 and [r.arrival for r in reqs] == [0.0, 2.5]
    assert [(r.input_tokens, r.output_tokens) for r in reqs] == [(472, 18), (120, 300)]
    no_lengths = tmp_path / "x.csv"
    no_lengths.write_text("Timestamp,what\n1,2\n")
    with pytest.raises(ValueError, match="no input column"):
        load_csv_trace(no_lengths)


def test_real_mooncake_trace_loads_with_the_readme_figures() -> None:
    reqs = build_workload("mooncake", WorkloadOptions(slo="keep"))
    assert len(reqs) == 12031
    assert abs(sum(r.input_tokens for r in reqs) / len(reqs) - 12035) < 1
    assert reqs[0].key_len == reqs[0].input_tokens * 4


def test_azure_loads_unique_prompts(tmp_path: Path) -> None:
    p = tmp_path / "az.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,374,109\n"
        "garbage,1,2\n"
    )
    stats = LoadStats()
    reqs = load_csv_trace(p, stats=stats)
    assert len(reqs) == 2 and stats.skipped == 1
    assert reqs[0].arrival == 0.0 and reqs[1].arrival == pytest.approx(4.314579, abs=1e-6)
    a, b = reqs[0].key(), reqs[1].key()
    assert len(a) == len(b) == 374 * 4 and _common_prefix(a, b) < 8


@pytest.mark.parametrize(
    "name", ["tool_use", "long_doc_qa", "programming", "multi_turn_chat", "qwen_mix", "preble_mix"]
)
def test_synthetic_families_are_seeded_and_sorted(name: str) -> None:
    opts = WorkloadOptions(seed=3, rate=5, duration=60)
    a = build_workload(name, opts)
    b = build_workload(name, opts)
    c = build_workload(name, WorkloadOptions(seed=4, rate=5, duration=60))
    assert [r.request_id for r in a] == [r.request_id for r in b]
    assert [r.key() for r in a[:20]] == [r.key() for r in b[:20]]
    assert [r.arrival for r in a] != [r.arrival for r in c]
    assert all(x.arrival <= y.arrival for x, y in itertools.pairwise(a))
    assert 150 <= len(a) <= 450  # ~5 req/s for 60 s
    for r in a[:30]:
        assert r.key_len == len(r.key())
        assert r.input_tokens == math.ceil(len(r.key()) / 4)


def test_tool_use_shares_tool_prompts_with_zipf_popularity() -> None:
    reqs = synthetic.tool_use(20, 60, seed=1, n_tools=50)
    firsts = [r.turns[0].segments[0].seed for r in reqs]
    top = max(set(firsts), key=firsts.count)
    assert firsts.count(top) > len(reqs) / 10  # rank 0 of Zipf(1.1) over 50 tools: ~22%
    same = [r for r in reqs if r.turns[0].segments[0].seed == top]
    k0, k1 = same[0].key(), same[1].key()
    assert _common_prefix(k0, k1) >= same[0].turns[0].n_bytes


def test_multi_turn_chat_resends_history_as_a_prefix() -> None:
    reqs = synthetic.multi_turn_chat(5, 300, seed=2, mean_turns=4)
    by_session: dict[str, list[Request]] = {}
    for r in reqs:
        by_session.setdefault(r.session or "", []).append(r)
    multi = [v for v in by_session.values() if len(v) >= 2]
    assert multi
    for turns in multi[:10]:
        turns.sort(key=lambda r: r.arrival)
        prev, nxt = turns[0].key(), turns[1].key()
        assert nxt.startswith(prev)  # canonical rendering ends in "<|assistant|>\n"


def test_chat_sessions_wait_for_their_answers_and_resend_them() -> None:
    """``chat_sessions``: multi_turn_chat's requests, each turn naming the one before it and the
    answer it gets, which the next turn's key resends right after this one's."""
    opts = WorkloadOptions(seed=2, rate=5, duration=120)
    plain = build_workload("multi_turn_chat", opts)
    chats = build_workload("chat_sessions", opts)
    assert [(r.request_id, r.arrival, r.key()) for r in plain] == [
        (r.request_id, r.arrival, r.key()) for r in chats
    ]
    assert all(r.after is None and r.reply is None and not r.answer_key() for r in plain)
    by_id = {r.request_id: r for r in chats}
    followers = [r for r in chats if r.after is not None]
    assert followers
    for r in followers:
        before = by_id[r.after or ""]
        assert before.session == r.session and before.arrival <= r.arrival
        assert r.key().startswith(before.key() + before.answer_key())
        assert before.answer_key() == before.reply.render() + b"\n"  # type: ignore[union-attr]
        assert len(before.answer_key()) == 4 * before.output_tokens + 1
    firsts = [r for r in chats if r.after is None]
    assert len({r.session for r in firsts}) == len(firsts)  # one first turn a session


def test_chat_key_matches_the_gateways_parse() -> None:
    for r in build_workload("qwen_mix", WorkloadOptions(rate=5, duration=20))[:10]:
        parsed = parse_request("chat", r.body(), r.headers())
        assert parsed.key == r.key()
        assert parsed.slo.ttft_ms == r.slo.ttft_ms and parsed.slo.tpot_ms == r.slo.tpot_ms
        assert parsed.hint.input_tokens == r.input_tokens
        assert parsed.hint.output_tokens == r.output_tokens
    r = build_workload("long_doc_qa", WorkloadOptions(rate=5, duration=5))[0]
    parsed = parse_request("completions", r.body(hint=False), {})
    assert parsed.key == r.key() and parsed.hint.input_tokens is None


def test_qwen_mix_uses_flowprefills_slos() -> None:
    reqs = build_workload("qwen_mix", WorkloadOptions(rate=20, duration=60))
    kinds = {r.kind for r in reqs}
    assert kinds == {"chat", "image", "search", "file"}
    for r in reqs:
        assert r.slo == SLO_CLASSES[r.kind]


def test_rate_scaling_and_window_and_limit() -> None:
    reqs = build_workload("mooncake", WorkloadOptions(start=600, duration=600, slo="keep"))
    assert reqs and reqs[0].arrival >= 0 and reqs[-1].arrival < 600
    fast = scale_rate(reqs, 4)
    assert [r.request_id for r in fast] == [r.request_id for r in reqs]
    assert fast[-1].arrival == pytest.approx(reqs[-1].arrival / 4)
    assert len(window(fast, 0, 60)) > len(window(reqs, 0, 60))
    assert len(limit(reqs, 5)) == 5
    opts = WorkloadOptions(start=600, duration=600, rate_scale=4, max_requests=10, slo="keep")
    assert [r.arrival for r in build_workload("mooncake", opts)] == [r.arrival for r in fast[:10]]
    with pytest.raises(ValueError):
        scale_rate(reqs, 0)


def test_merge_interleaves_by_arrival() -> None:
    a = synthetic.programming(2, 30, seed=1)
    b = synthetic.tool_use(2, 30, seed=1)
    m = merge(a, b)
    assert len(m) == len(a) + len(b)
    assert all(x.arrival <= y.arrival for x, y in itertools.pairwise(m))


def test_slo_specs() -> None:
    prof = default_profile()
    r = Request("x", 0.0, (Turn("", (Segment(1, 40000),)),), 10000, 5)
    (a,) = assign_slo([r], "class:search", prof)
    assert a.slo == SLO_CLASSES["search"]
    (b,) = assign_slo([r], "scaled:5:80", prof)
    assert b.slo.ttft_ms == pytest.approx(5 * prof.prefill_ms(10000)) and b.slo.tpot_ms == 80
    assert scaled_slo(10, prof, 5, 100).ttft_ms == 250.0  # floor for tiny prompts
    (c,) = assign_slo([r], "300,40", prof)
    assert (c.slo.ttft_ms, c.slo.tpot_ms) == (300, 40)
    assert parse_slo_spec("keep") == ("keep", None)
    for bad in ("class:nope", "scaled:x", "1,2,3", "-1,5", "scaled:0"):
        with pytest.raises(SloSpecError):
            parse_slo_spec(bad)


def test_request_validation() -> None:
    turn = (Turn("", (Segment(1, 10),)),)
    with pytest.raises(ValueError):
        Request("x", -1.0, turn, 3, 1)
    with pytest.raises(ValueError):
        Request("x", 0.0, turn, 0, 1)
    with pytest.raises(ValueError):
        Request("x", 0.0, (*turn, *turn), 3, 1)  # a completion has one prompt
    with pytest.raises(ValueError):
        build_workload("nope")


def test_thin_keeps_a_stable_fraction_by_request_id() -> None:
    from bench.workloads import thin

    reqs = build_workload("azure", WorkloadOptions(slo="keep"))[:4000]
    kept = thin(reqs, 0.25, seed=0)
    assert 0.22 * len(reqs) < len(kept) < 0.28 * len(reqs)
    assert {r.request_id for r in thin(reqs[:2000], 0.25)} == {
        r.request_id for r in kept if r.request_id in {q.request_id for q in reqs[:2000]}
    }
    assert thin(reqs, 1.0) == reqs
    with pytest.raises(ValueError):
        thin(reqs, 0)


def test_spread_ties_orders_simultaneous_requests() -> None:
    from bench.workloads import spread_ties

    reqs = build_workload("mooncake", WorkloadOptions(duration=30, slo="keep"))
    assert len({r.arrival for r in reqs}) < len(reqs)  # the trace has one-second ties
    spread = spread_ties(reqs, 1.0)
    assert len({r.arrival for r in spread}) == len(spread)
    assert sorted(r.request_id for r in spread) == sorted(r.request_id for r in reqs)
    by_id = {r.request_id: r.arrival for r in reqs}
    assert all(0 <= r.arrival - by_id[r.request_id] < 1.0 for r in spread)
    same_second = [r for r in reqs if r.arrival == reqs[0].arrival]
    ids = [r.request_id for r in spread if r.request_id in {q.request_id for q in same_second}]
    assert ids == [r.request_id for r in same_second]  # ties keep their trace order
    assert spread_ties(reqs, 0) == reqs


def test_workloads_are_written_in_the_profiles_bytes_per_token() -> None:
    """With an engine profile whose tokenizer takes 2 bytes a token, a workload's prompts are
    written at that rate: the same requests and token counts, each prompt's bytes read at the
    profile's rate giving back its tokens (the router reads them so), shared prefixes and
    resent answers still shared."""
    small = load_profile("vllm-cpu-small")
    assert small.bytes_per_token == 2
    opts = WorkloadOptions(max_requests=40)
    four = build_workload("mooncake", opts)
    two = build_workload("mooncake", opts, profile=small)
    assert [(r.request_id, r.arrival, r.input_tokens) for r in four] == [
        (r.request_id, r.arrival, r.input_tokens) for r in two
    ]
    for a, b in zip(four, two, strict=True):
        assert len(b.key()) * 2 == len(a.key())
        assert small.tokens_for_bytes(len(b.key())) == b.input_tokens
    # requests sharing their first hash block share its bytes at either rate
    keys = [r.key()[:64] for r in four]
    pairs = [(i, j) for i in range(40) for j in range(i) if keys[i] == keys[j]]
    assert pairs
    for i, j in pairs:
        assert two[i].key()[:32] == two[j].key()[:32]
    opts = WorkloadOptions(seed=2, rate=5, duration=60)
    chats = build_workload("chat_sessions", opts, profile=small)
    by_id = {r.request_id: r for r in chats}
    followers = [r for r in chats if r.after is not None]
    assert followers
    for r in followers:
        before = by_id[r.after or ""]
        assert r.key().startswith(before.key() + before.answer_key())
        assert len(before.answer_key()) == 2 * before.output_tokens + 1


def test_clients_that_overstate_max_tokens_keep_their_answers_lengths() -> None:
    """``--stated-max-tokens 1024``: every request states 1024 (or its answer's length, when
    that is longer) and its answer still ends where it did; 0 leaves the workload as it was."""
    opts = WorkloadOptions(seed=3, duration=30.0)
    plain = build_workload("tool_use", opts)
    stated = build_workload(
        "tool_use", WorkloadOptions(seed=3, duration=30.0, stated_max_tokens=1024)
    )
    assert [r.output_tokens for r in stated] == [r.output_tokens for r in plain]
    assert all(r.stated_tokens == max(1024, r.output_tokens) for r in stated)
    assert all(r.max_tokens is None and r.stated_tokens == r.output_tokens for r in plain)
    with pytest.raises(ValueError, match="below the answer"):
        plain[0].with_(max_tokens=plain[0].output_tokens - 1)
    with pytest.raises(ValueError, match=">= 0"):
        build_workload("tool_use", WorkloadOptions(duration=5.0, stated_max_tokens=-1))
