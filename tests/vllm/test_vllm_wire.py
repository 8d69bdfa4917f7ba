"""Decoding vLLM's KV event messages: every captured message, both encodings, bad input."""

from __future__ import annotations

import msgspec
import pytest

from engine_reporter.vllm.wire import (
    END_OF_REPLAY,
    REMOVED_FIELDS,
    STORED_FIELDS,
    VllmAllCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    WireError,
    batch_from_obj,
    decode_message,
    decode_payload,
    decode_replay_frames,
)

enc = msgspec.msgpack.Encoder()


def frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), payload]


def as_array_event(ev: dict) -> list:
    """The same event as vLLM encodes it with ``array_like=True``: tag first, fields in order,
    trailing defaults omitted."""
    names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(ev["type"], ())
    values = [ev.get(n) for n in names]
    while values and values[-1] is None:
        values.pop()
    return [ev["type"], *values]


def test_every_captured_message_decodes(captures: dict[str, list[dict]]) -> None:
    kinds = {"BlockStored": VllmBlockStored, "BlockRemoved": VllmBlockRemoved}
    total = 0
    for name, records in captures.items():
        for rec in records:
            payload = enc.encode(rec["raw"])
            # Re-encoding the decoded batch the way vLLM does gives vLLM's exact payload size.
            assert len(payload) == rec["payload_bytes"], name
            msg = decode_message(frames(rec["topic"], rec["seq"], payload))
            assert msg.seq == rec["seq"] and msg.topic == rec["topic"].encode()
            ts, raw_events, dp_rank = rec["raw"]
            assert msg.batch.ts == ts and msg.batch.dp_rank == dp_rank
            assert msg.batch.skipped == 0
            assert len(msg.batch.events) == len(raw_events)
            for got, raw in zip(msg.batch.events, raw_events, strict=True):
                assert isinstance(got, kinds.get(raw["type"], VllmAllCleared))
                if raw["type"] != "AllBlocksCleared":
                    assert list(got.block_hashes) == raw["block_hashes"]
                if raw["type"] == "BlockStored":
                    assert list(got.token_ids) == raw["token_ids"]
                    assert got.parent_block_hash == raw["parent_block_hash"]
                    assert got.block_size == raw["block_size"]
                    assert got.medium == raw["medium"]
                    assert got.kv_cache_spec_kind == raw["kv_cache_spec_kind"]
            total += 1
    assert total > 3000


def test_array_and_map_encodings_decode_alike(captures: dict[str, list[dict]]) -> None:
    for records in captures.values():
        for rec in records[:200]:
            ts, raw_events, dp_rank = rec["raw"]
            as_map = decode_payload(enc.encode(rec["raw"]))
            arrays = [ts, [as_array_event(e) for e in raw_events], dp_rank]
            as_arrays = decode_payload(enc.encode(arrays))
            batch_map = {"ts": ts, "events": [as_array_event(e) for e in raw_events]}
            as_batch_map = decode_payload(enc.encode(batch_map))
            assert as_arrays == as_map
            assert as_batch_map.events == as_map.events and as_batch_map.dp_rank is None


def test_old_vllm_array_events_without_medium() -> None:
    payload = enc.encode(
        [1.5, [["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None], ["BlockRemoved", [7]]]]
    )
    batch = decode_payload(payload)
    stored, removed = batch.events
    assert stored == VllmBlockStored((7, 8), None, (1, 2, 3, 4), 2)
    assert removed == VllmBlockRemoved((7,))


def test_bytes_hashes_are_kept_as_bytes() -> None:
    h1, h2 = bytes(range(32)), bytes(range(1, 33))
    payload = enc.encode(
        [
            0.0,
            [
                {"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": None,
                 "token_ids": [5, 6], "block_size": 1, "lora_id": None, "medium": "GPU"},
                {"type": "BlockRemoved", "block_hashes": [h2], "medium": "GPU"},
            ],
            0,
        ]
    )  # fmt: skip
    stored, removed = decode_payload(payload).events
    assert stored.block_hashes == (h1, h2) and removed.block_hashes == (h2,)


@pytest.mark.parametrize(
    "bad_frames",
    [
        [b"kv", b"\x00" * 8],  # too few frames
        [b"kv", b"\x00" * 7, enc.encode([0.0, []])],  # short sequence number
        [b"kv", b"\x00" * 8, b"\xc1not msgpack"],
        [b"kv", b"\x00" * 8, enc.encode({"nope": 1})],
        [b"kv", b"\x00" * 8, enc.encode([0.0, "not a list"])],
        [b"kv", b"\x00" * 8, enc.encode(["ts", []])],
        [b"kv", b"\x00" * 8, enc.encode(12)],
        [b"kv", b"\x00" * 8, b"\x91" * 5000],  # arrays 5,000 deep: RecursionError escaped
    ],
)
def test_malformed_messages_raise_wire_error(bad_frames: list[bytes]) -> None:
    with pytest.raises(WireError):
        decode_message(bad_frames)


def test_bad_events_are_skipped_and_counted_not_fatal() -> None:
    good = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
    bad = [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [1, 2, 3], "block_size": 2},  # 3 tokens for one block of 2
        {"type": "BlockStored", "block_hashes": [], "parent_block_hash": None,
         "token_ids": [], "block_size": 2},
        {"type": "BlockStored", "block_hashes": [1.5], "parent_block_hash": None,
         "token_ids": [1, 2], "block_size": 2},
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [1, -2], "block_size": 2},
        {"type": "BlockRemoved", "block_hashes": [True]},
        {"type": "SomethingNew", "x": 1},
        ["BlockRemoved", [1], "GPU", 0, "extra", "fields", "too", "many"],
        "not an event",
        {"no": "type"},
    ]  # fmt: skip
    batch = batch_from_obj([2.0, [good, *bad, good]])
    assert batch.skipped == len(bad)
    assert batch.events == (VllmBlockRemoved((1,), "GPU"), VllmBlockRemoved((1,), "GPU"))


def test_replay_frames_both_formats_and_end_marker() -> None:
    payload = enc.encode([3.0, [{"type": "AllBlocksCleared"}], 0])
    old = decode_replay_frames([b"", (5).to_bytes(8, "big"), payload])
    new = decode_replay_frames([b"", b"kv", (5).to_bytes(8, "big"), payload])
    assert old is not None and new is not None
    assert old.seq == new.seq == 5 and new.topic == b"kv"
    assert old.batch.events == (VllmAllCleared(),)
    assert decode_replay_frames([b"", b"", END_OF_REPLAY, b""]) is None
    assert decode_replay_frames([b"", END_OF_REPLAY, b""]) is None
    with pytest.raises(WireError):
        decode_replay_frames([b"x", (5).to_bytes(8, "big"), payload])
    with pytest.raises(WireError):
        decode_replay_frames([b"", payload])
