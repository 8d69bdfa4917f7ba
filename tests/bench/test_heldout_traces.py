"""The held-out trace shapes: written in Qwen-Bailian's format and read back by the trace
loader as 16-token blocks in seconds, with the sharing each shape claims."""

from __future__ import annotations

import json
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
