"""The held-out trace shapes: written in Qwen-Bailian's format and read back by the trace
loader as 16-token blocks in seconds, with the sharing each shape claims."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from pathlib import Path

import pytest

from bench.heldout_traces import SHAPES, main, write
from bench.workloads.traces import LoadStats, load_hash_trace


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_shape_reads_back_as_16_token_blocks_in_seconds(tmp_path: Path, shape: str) -> None:
    path = tmp_path / f"{shape}.jsonl"
    n = write(shape, path, rate=2.0, duration=120.0, seed=1)
    stats = LoadStats()
    reqs = load_hash_trace(path, stats=stats)
    assert len(reqs) == n > 50 and stats.skipped == 0 and stats.mended == 0
    assert stats.inferred["block_tokens"] == 16 and stats.inferred["time_unit"] == "s"
    assert max(r.arrival for r in reqs) < 120.0


def test_the_shapes_share_what_they_claim(tmp_path: Path) -> None:
    firsts = {}
    for shape in SHAPES:
        write(shape, tmp_path / f"{shape}.jsonl", rate=2.0, duration=300.0, seed=3)
        lines = _lines(tmp_path / f"{shape}.jsonl")
        firsts[shape] = len({line["hash_ids"][0] for line in lines}) / len(lines)
    assert firsts["bimodal"] == 1.0  # nothing shared
    assert firsts["reasoning"] < 0.1  # 30 system prompts
    assert firsts["agent_sessions"] < 0.1  # 3 tool prompts
    assert firsts["rotating_docs"] < 0.5
    assert firsts["rag_chunks"] < 0.01  # 4 system prompts
    assert firsts["diurnal_docs"] < 0.5
    assert firsts["fanout"] < 0.1  # 20 instruction prompts
    assert 0.3 < firsts["hot_prompt"] < 0.5  # one agent prompt for six in ten, the rest alone
    assert firsts["two_tier"] < 0.35  # sessions of 2-14 turns, a tenth one-off documents
    assert firsts["tenant_bursts"] < 0.1  # 60 tenants' system prompts
    # an agent's turn resends its parent's context and appends to it
    lines = {line["chat_id"]: line for line in _lines(tmp_path / "agent_sessions.jsonl")}
    turns = [line for line in lines.values() if line["parent_chat_id"] >= 0]
    assert turns
    for line in turns:
        parent = lines[line["parent_chat_id"]]["hash_ids"]
        assert line["hash_ids"][: len(parent)] == parent and len(line["hash_ids"]) > len(parent)


def test_the_hot_documents_rotate(tmp_path: Path) -> None:
    write("rotating_docs", tmp_path / "r.jsonl", rate=4.0, duration=480.0, seed=5)
    lines = _lines(tmp_path / "r.jsonl")

    def hottest(lo: float, hi: float) -> int:
        counts: dict[int, int] = {}
        for line in lines:
            if lo <= line["timestamp"] < hi:
                counts[line["hash_ids"][0]] = counts.get(line["hash_ids"][0], 0) + 1
        return max(counts, key=counts.__getitem__)

    assert hottest(0, 120) != hottest(120, 240)


def test_cli_writes_the_shapes_asked_and_refuses_unknown_ones(tmp_path: Path, capsys) -> None:
    main(["--out-dir", str(tmp_path), "--shapes", "bimodal", "--duration", "30"])
    assert (tmp_path / "bimodal.jsonl").exists() and not (tmp_path / "reasoning.jsonl").exists()
    assert "bimodal.jsonl" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--out-dir", str(tmp_path), "--shapes", "nope"])
    assert "unknown shape" in capsys.readouterr().err


def test_rag_prompts_share_the_system_prompt_and_only_some_chunks(tmp_path: Path) -> None:
    write("rag_chunks", tmp_path / "r.jsonl", rate=4.0, duration=300.0, seed=2)
    lines = _lines(tmp_path / "r.jsonl")
    # the first 25 blocks are a system prompt's (400 tokens at least); the first 121 hold the
    # system prompt (25 to 94 blocks) and the start of the retrieved chunks
    systems = {tuple(line["hash_ids"][:25]) for line in lines}
    firsts = {tuple(line["hash_ids"][:121]) for line in lines}
    assert len(systems) <= 4
    assert 0.05 < len(firsts) / len(lines) < 0.95  # some retrievals agree, most do not
    assert all(line["input_length"] >= 400 + 3 * 256 for line in lines)


def test_the_diurnal_rate_swings(tmp_path: Path) -> None:
    write("diurnal_docs", tmp_path / "d.jsonl", rate=4.0, duration=600.0, seed=4)
    phases = [
        math.sin(2 * math.pi * line["timestamp"] / 60.0) for line in _lines(tmp_path / "d.jsonl")
    ]
    peaks = sum(phase > 0.7 for phase in phases)
    troughs = sum(phase < -0.7 for phase in phases)
    assert peaks > 4 * troughs > 0


def test_a_fanout_job_sends_its_requests_at_once_on_one_context(tmp_path: Path) -> None:
    write("fanout", tmp_path / "f.jsonl", rate=4.0, duration=300.0, seed=6)
    bursts: list[list[dict]] = []  # requests within 50 ms of the one before
    for line in _lines(tmp_path / "f.jsonl"):
        if bursts and line["timestamp"] - bursts[-1][-1]["timestamp"] <= 0.05:
            bursts[-1].append(line)
        else:
            bursts.append([line])

    def shared_blocks(burst: list[dict]) -> int:
        """The blocks every request of the burst starts with."""
        first = burst[0]["hash_ids"]
        n = len(first)
        for line in burst[1:]:
            ids = line["hash_ids"][:n]
            n = next((k for k, block in enumerate(ids) if block != first[k]), len(ids))
        return n

    # the instruction prompt (300+ tokens) and the context (1,000+): 81 blocks at least, then
    # each request's own suffix (two jobs rarely start within 50 ms of each other)
    one_job = [b for b in bursts if len(b) >= 2 and 81 <= shared_blocks(b) < len(b[0]["hash_ids"])]
    assert len(bursts) > 50 and len(one_job) >= 0.9 * len(bursts)


def test_the_hot_prompt_opens_most_requests_and_each_adds_its_own_task(tmp_path: Path) -> None:
    write("hot_prompt", tmp_path / "h.jsonl", rate=4.0, duration=300.0, seed=8)
    lines = _lines(tmp_path / "h.jsonl")
    hot, _ = Counter(line["hash_ids"][0] for line in lines).most_common(1)[0]
    agent = [line for line in lines if line["hash_ids"][0] == hot]
    assert 0.5 < len(agent) / len(lines) < 0.7
    prompt = agent[0]["hash_ids"][: 12_000 // 16]  # 12,000 tokens of one prompt at least
    assert all(line["hash_ids"][: len(prompt)] == prompt for line in agent)
    assert len({tuple(line["hash_ids"]) for line in agent}) == len(agent)  # each its own task
    assert all(line["input_length"] <= 4000 for line in lines if line["hash_ids"][0] != hot)


def test_two_tier_turns_grow_their_history_beside_long_unshared_documents(tmp_path: Path) -> None:
    write("two_tier", tmp_path / "t.jsonl", rate=4.0, duration=300.0, seed=9)
    lines = _lines(tmp_path / "t.jsonl")
    sessions: dict[int, list[dict]] = {}
    for line in lines:
        sessions.setdefault(line["hash_ids"][0], []).append(line)
    documents = [s[0] for s in sessions.values() if len(s) == 1 and s[0]["input_length"] >= 8000]
    assert 0.05 < len(documents) / len(lines) < 0.2
    chats = [s for s in sessions.values() if len(s) >= 2]
    assert chats
    for chat in chats:  # in time order, each turn resends the one before and adds to it
        for before, after in itertools.pairwise(chat):
            assert after["timestamp"] - before["timestamp"] >= 2.0
            n = len(before["hash_ids"])
            assert after["hash_ids"][:n] == before["hash_ids"] and len(after["hash_ids"]) > n


def test_a_tenant_is_busy_in_bursts_then_quiet(tmp_path: Path) -> None:
    write("tenant_bursts", tmp_path / "b.jsonl", rate=4.0, duration=600.0, seed=10)
    times: dict[int, list[float]] = {}
    for line in _lines(tmp_path / "b.jsonl"):
        times.setdefault(line["hash_ids"][0], []).append(line["timestamp"])
    assert 20 <= len(times) <= 60
    # a tenant's requests come within 40 s of its burst's start: most gaps between two of its
    # requests are short, and some (between bursts) are long
    gaps = [b - a for ts in times.values() for a, b in itertools.pairwise(ts)]
    assert sum(g < 5.0 for g in gaps) > 0.8 * len(gaps)
    assert any(g > 40.0 for g in gaps)
