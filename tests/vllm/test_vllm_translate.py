"""vLLM block events to kvgate block events: the captured runs rebuild the cache exactly."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from kvbridge_helpers import mirror_of

from broker.events import AllCleared, BlockRemoved, BlockStored
from engine_reporter.builder import ReportBuilder
from engine_reporter.hashing import block_hash
from engine_reporter.vllm.tokens import TokenBytes
from engine_reporter.vllm.translate import Translator
from engine_reporter.vllm.wire import (
    VllmAllCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    decode_payload,
)

tokenizers = pytest.importorskip("tokenizers")
enc = msgspec.msgpack.Encoder()


def sessions(records: list[dict]) -> list[list[dict]]:
    """Split a capture where vLLM's sequence restarts (a new vLLM process)."""
    out: list[list[dict]] = []
    for rec in records:
        if not out or rec["seq"] <= out[-1][-1]["seq"]:
            out.append([])
        out[-1].append(rec)
    return out


class VllmModel:
    """What vLLM holds, straight from its raw events (the oracle)."""

    def __init__(self) -> None:
        self.parent: dict[int, int | None] = {}
        self.tokens: dict[int, list[int]] = {}
        self.held: set[int] = set()

    def apply(self, raw: dict) -> None:
        if raw["type"] == "BlockStored":
            parent, size = raw["parent_block_hash"], raw["block_size"]
            for i, h in enumerate(raw["block_hashes"]):
                self.parent[h] = parent
                self.tokens[h] = raw["token_ids"][i * size : (i + 1) * size]
                self.held.add(h)
                parent = h
        elif raw["type"] == "BlockRemoved":
            self.held.difference_update(raw["block_hashes"])
        else:
            self.held.clear()


def fold(builder: ReportBuilder, events: list) -> None:
    for ev in events:
        builder.emit(ev, 0.0)
    builder.take(len(events) + 1)


def check_session(session: list[dict], tokens: TokenBytes, tok) -> int:
    """Replay one vLLM process's batches; the mirror must match what vLLM holds at every step,
    block for block, with bytes the real tokenizer agrees with. Returns blocks checked."""
    translator = Translator(tokens)
    builder = ReportBuilder("vllm-0", "epoch-1")
    model = VllmModel()
    removed_seen = 0
    for rec in session:
        batch = decode_payload(enc.encode(rec["raw"]))
        out = translator.apply_all(batch.events)
        fold(builder, out)
        for raw in rec["raw"][1]:
            model.apply(raw)
        removed_seen += sum(isinstance(e, BlockRemoved) for e in out)
        # The mirror holds one kvgate block per block vLLM holds, at every step.
        assert builder.cached_blocks == len(model.held)
    if len(session) > 100:
        assert removed_seen > 0
    assert translator.stats.orphan_blocks == 0
    assert translator.stats.unknown_removals == 0

    mirror = mirror_of(builder)
    expected: dict[int, int | None] = {}

    def ours(h: int) -> int | None:
        if h not in expected:
            parent = model.parent[h]
            parent_ours = None if parent is None else ours(parent)
            ids = model.tokens[h]
            if parent is None and ids[0] == 0:
                ids = ids[1:]  # the BOS vLLM added to the completion prompt
            mine = translator.ours(h)
            assert mine in mirror
            data = mirror[mine][1]
            assert data.decode("utf-8", "replace") == tok.decode(ids, skip_special_tokens=False)
            expected[h] = block_hash(parent_ours, data)
        return expected[h]

    for h in model.held:
        assert translator.ours(h) == ours(h)
        parent = model.parent[h]
        assert mirror[ours(h)][0] == (None if parent is None else ours(parent))
    return len(model.held)


def test_captured_runs_rebuild_the_cache_mirror(
    captures: dict[str, list[dict]], token_bytes: TokenBytes, model_dir: Path
) -> None:
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    checked = 0
    for records in captures.values():
        for session in sessions(records):
            checked += check_session(session, token_bytes, tok)
    assert checked > 50


def test_clear_and_removals_apply(captures: dict[str, list[dict]], token_bytes: TokenBytes) -> None:
    records = captures["vllm_cpu_0.32_kv_events_with_evictions.jsonl"]
    session = sessions(records)[1]
    translator = Translator(token_bytes)
    builder = ReportBuilder("vllm-0", "epoch-1")
    sizes = []
    for rec in session:
        batch = decode_payload(enc.encode(rec["raw"]))
        before = builder.cached_blocks
        out = translator.apply_all(batch.events)
        fold(builder, out)
        kinds = {type(e) for e in batch.events}
        if VllmAllCleared in kinds:
            assert out[-1] == AllCleared() or AllCleared() in out
            assert before > 0
            sizes.append(("cleared", before, builder.cached_blocks))
        elif kinds == {VllmBlockRemoved}:
            assert builder.cached_blocks < before
    assert sizes and all(after <= 1 for _, _, after in sizes)
    assert translator.stats.blocks_removed > 1000


def stored(hashes, parent, tokens, *, medium="GPU", group=None, kind=None, size=2):
    return VllmBlockStored(
        tuple(hashes), parent, tuple(tokens), size, medium=medium, group_idx=group,
        kv_cache_spec_kind=kind,
    )  # fmt: skip


def test_block_announced_twice_is_stored_once(token_bytes: TokenBytes) -> None:
    t = Translator(token_bytes)
    first = t.apply(stored([1, 2], None, [0, 72, 73, 74]))
    assert len(first) == 1 and len(first[0].hashes) == 2
    again = t.apply(stored([1, 2, 3], None, [0, 72, 73, 74, 75, 76]))
    # Only the new block is announced, chained to the known one.
    assert again == [BlockStored(first[0].hashes[1], (t.ours(3),), (again[0].blocks[0],))]
    assert t.stats.duplicate_blocks == 2
    # One removal of a block announced twice (same holder) removes it.
    assert t.apply(VllmBlockRemoved((2,), "GPU")) == [BlockRemoved((first[0].hashes[1],))]


def test_block_held_by_two_media_stays_until_both_remove_it(token_bytes: TokenBytes) -> None:
    t = Translator(token_bytes)
    (ev,) = t.apply(stored([1], None, [72, 73]))
    assert t.apply(stored([1], None, [72, 73], medium="CPU")) == []
    assert t.apply(VllmBlockRemoved((1,), "GPU")) == []
    assert t.apply(VllmBlockRemoved((1,), "CPU")) == [BlockRemoved(ev.hashes)]
    assert t.held_blocks == 0


def test_same_bytes_under_two_vllm_hashes_are_one_kvgate_block(token_bytes: TokenBytes) -> None:
    """Different LoRA or cache salt: two vLLM blocks, one kvgate block, removed with the last."""
    t = Translator(token_bytes)
    (ev,) = t.apply(stored([1], None, [72, 73]))
    assert t.apply(stored([2], None, [72, 73])) == []
    assert t.ours(1) == t.ours(2) and t.stats.shared_blocks == 1
    (child,) = t.apply(stored([3], 2, [74, 75]))
    assert child.parent_hash == ev.hashes[0]
    assert t.apply(VllmBlockRemoved((1,), "GPU")) == []
    assert t.apply(VllmBlockRemoved((2,), "GPU")) == [BlockRemoved(ev.hashes)]


def test_orphans_unknown_tokens_and_unknown_removals_are_counted(
    token_bytes: TokenBytes,
) -> None:
    t = Translator(token_bytes)
    assert t.apply(stored([5, 6], 999, [72, 73, 74, 75])) == []
    assert t.stats.orphan_blocks == 2
    out = t.apply(stored([7, 8, 9], None, [72, 73, 74, 99999, 75, 76]))
    assert len(out) == 1 and len(out[0].hashes) == 1  # blocks from the bad token on are skipped
    assert t.stats.unknown_token_blocks == 2
    assert t.apply(VllmBlockRemoved((12345,), "GPU")) == []
    assert t.stats.unknown_removals == 1


def test_a_block_of_only_the_leading_bos_is_transparent(token_bytes: TokenBytes) -> None:
    t = Translator(token_bytes)
    out = t.apply(stored([1, 2, 3], None, [0, 72, 73], size=1))
    first = block_hash(None, token_bytes.token_bytes(72))
    second = block_hash(first, token_bytes.token_bytes(73))
    assert len(out) == 1 and out[0].parent_hash is None
    assert out[0].hashes == (first, second)
    assert t.stats.empty_blocks == 1
    assert t.apply(VllmBlockRemoved((1,), "GPU")) == []
    assert t.held_blocks == 2


def test_non_full_attention_groups_are_ignored(token_bytes: TokenBytes) -> None:
    t = Translator(token_bytes)
    assert t.apply(stored([1], None, [72, 73], group=1, kind="sliding_window")) == []
    assert t.apply(VllmBlockRemoved((1,), "GPU", 1)) == []
    assert t.stats.ignored_group_events == 2
    (ev,) = t.apply(stored([1], None, [72, 73], group=0, kind="full_attention"))
    assert t.apply(VllmBlockRemoved((1,), "GPU", 0)) == [BlockRemoved(ev.hashes)]


def test_all_cleared_forgets_everything(token_bytes: TokenBytes) -> None:
    t = Translator(token_bytes)
    t.apply(stored([1, 2], None, [72, 73, 74, 75]))
    assert t.apply(VllmAllCleared()) == [AllCleared()]
    assert t.held_blocks == 0 and t.ours(1) is None
    assert t.apply(stored([3], 2, [76, 77])) == []  # its parent went with the clear
    assert t.stats.orphan_blocks == 1
