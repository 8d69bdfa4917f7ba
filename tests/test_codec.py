"""Round trips and rejections of the stream-entry and snapshot codecs."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.codec import CodecError, decode_batch, decode_snapshot, encode_batch, encode_snapshot
from broker.events import (
    MAX_BLOCKS_PER_EVENT,
    REJECT_CAUSES,
    AllCleared,
    BlockRemoved,
    BlockStored,
    Envelope,
    EventError,
    FirstToken,
    LoadHeartbeat,
    RequestEnqueued,
    RequestFinished,
    RequestPreempted,
    RequestRejected,
    RequestStarted,
    Snapshot,
    removed_events,
    stored_events,
)

U64 = st.integers(0, 2**64 - 1)
ID = st.text(min_size=1, max_size=20)
MS = st.floats(0, 1e7, allow_nan=False)
COUNT = st.integers(0, 10**9)

block_stored = st.integers(1, 5).flatmap(
    lambda n: st.builds(
        BlockStored,
        st.none() | U64,
        st.lists(U64, min_size=n, max_size=n).map(tuple),
        st.lists(st.binary(min_size=1, max_size=40), min_size=n, max_size=n).map(tuple),
    )
)
heartbeat = st.builds(
    lambda counts, vbs, prof, url, models, decode, role, prefill, order, held, tokens: (
        LoadHeartbeat(
            *counts,
            vbs,
            prof,
            url,
            models,
            *(decode or (None, None, None)),
            role,
            *(prefill or (None, None)),
            order,
            held,
            tokens,
        )
    ),
    st.tuples(COUNT, COUNT, COUNT, COUNT, COUNT),
    MS,
    ID,
    ID,
    st.lists(ID, max_size=3).map(tuple),
    st.none() | st.tuples(MS, MS, MS),  # optional decode-step figures (SpeedFit)
    st.sampled_from(("both", "prefill", "decode")),
    st.none() | st.tuples(MS, MS),  # optional prefill-work figures (SpeedFit)
    st.sampled_from(("deadline", "arrival")),  # the order its prefill queue is served in
    st.none() | COUNT,  # optional: the KV blocks its requests hold
    st.none() | COUNT,  # optional: the tokens its decode steps gave
)
first_token = st.one_of(
    st.builds(FirstToken, ID, MS),
    st.builds(FirstToken, ID, MS, MS, COUNT, st.none() | COUNT),  # with prefill figures
)
enqueued = st.builds(
    lambda rid, k, c, i, m, t1, t2: RequestEnqueued(rid, k + c, c, i, m, t1, t2),
    ID,
    COUNT,
    COUNT,
    COUNT,
    COUNT,
    st.none() | MS,
    st.none() | MS,
)
events = st.one_of(
    block_stored,
    st.builds(BlockRemoved, st.lists(U64, min_size=1, max_size=5).map(tuple)),
    st.just(AllCleared()),
    enqueued,
    st.builds(RequestStarted, ID),
    first_token,
    st.builds(RequestFinished, ID, COUNT, MS, MS),
    st.builds(RequestFinished, ID, COUNT, MS, MS, COUNT),  # with the cap it was given
    st.builds(RequestRejected, ID, ID),
    st.builds(RequestRejected, ID, ID, st.sampled_from(REJECT_CAUSES), MS, COUNT),  # for routers
    st.builds(RequestPreempted, ID),
    heartbeat,
)


@given(st.lists(events, min_size=1, max_size=20), ID, ID, st.integers(0, 10**12), MS)
@settings(max_examples=200, deadline=None)
def test_batch_round_trips_exactly(evs, engine, epoch, seq0, ts) -> None:
    envs = [Envelope(engine, epoch, seq0 + i, ts, e) for i, e in enumerate(evs)]
    fields = encode_batch(envs)
    assert decode_batch(fields) == envs
    # str keys, as some clients return them, decode the same
    assert decode_batch({k.decode(): v for k, v in fields.items()}) == envs


@given(st.dictionaries(st.binary(max_size=3), st.binary(max_size=60), max_size=4))
@settings(max_examples=300, deadline=None)
def test_garbage_entries_are_rejected_not_crashing(fields) -> None:
    try:
        out = decode_batch(fields)
    except CodecError:
        return
    assert all(isinstance(e, Envelope) for e in out)


@given(st.lists(events, min_size=1, max_size=5), st.data())
@settings(max_examples=200, deadline=None)
def test_mutated_header_decodes_exactly_or_is_rejected(evs, data) -> None:
    envs = [Envelope("e1", "ep", i, 1.0, e) for i, e in enumerate(evs)]
    fields = encode_batch(envs)
    head = bytearray(fields[b"h"])
    pos = data.draw(st.integers(0, len(head) - 1))
    head[pos] = data.draw(st.integers(0, 255))
    try:
        out = decode_batch({b"v": b"1", b"h": bytes(head), b"b": fields[b"b"]})
    except CodecError:
        return
    # A mutation that still decodes must give valid, self-consistent envelopes.
    assert decode_batch(encode_batch(out)) == out


@pytest.mark.parametrize(
    "fields, why",
    [
        ({}, "missing field"),
        ({b"v": b"2", b"h": b"[]", b"b": b""}, "version"),
        ({b"v": b"1", b"h": b"not json", b"b": b""}, "line 1"),
        ({b"v": b"1", b"h": b'["e","p",0,[]]', b"b": b""}, "non-empty"),
        ({b"v": b"1", b"h": b'["e","p",0,[["zz",1.0]]]', b"b": b""}, "unknown event kind"),
        ({b"v": b"1", b"h": b'["e","p",0,[["bs",1.0,null,[1],[5]]]]', b"b": b"abc"}, "blob"),
        ({b"v": b"1", b"h": b'["e","p",0,[["br",1.0,[-1]]]]', b"b": b""}, "unsigned"),
        ({b"v": b"1", b"h": b'["e","p",0,[["ac",1.0]]]', b"b": b"x"}, "trailing"),
        ({b"v": b"1", b"h": b'["","p",0,[["ac",1.0]]]', b"b": b""}, "engine_id"),
    ],
)
def test_malformed_entries_name_the_problem(fields, why) -> None:
    with pytest.raises(CodecError, match=why):
        decode_batch(fields)


def test_records_of_other_versions_decode_or_name_their_arity() -> None:
    """Fields added later are optional trailing items: an older engine's records (without
    them) decode with None, and too many items are an error that says how many are known."""
    head = orjson.dumps(["e1", "ep", 0, [["ft", 1.0, "r1", 12.5]]])
    (env,) = decode_batch({b"v": b"1", b"h": head, b"b": b""})
    assert env.event == FirstToken("r1", 12.5)
    assert env.event.prefill_ms is None
    hb = ["hb", 1.0, 0, 1, 2, 3, 4, 0.5, "p", "http://e", ["m"]]
    (env,) = decode_batch({b"v": b"1", b"h": orjson.dumps(["e1", "ep", 0, [hb]]), b"b": b""})
    assert env.event.decode_step_ms is None and env.event.running == 1
    roled = [*hb, 20.0, 4.0, 900.0, "decode"]  # P/D disaggregation's role, added last
    (env,) = decode_batch({b"v": b"1", b"h": orjson.dumps(["e1", "ep", 0, [roled]]), b"b": b""})
    assert env.event.role == "decode" and env.event.decode_batch == 4.0
    timed = [*roled, 300.0, 150.0]  # the prefill work's time and plan (speed fit), added last
    (env,) = decode_batch({b"v": b"1", b"h": orjson.dumps(["e1", "ep", 0, [timed]]), b"b": b""})
    assert (env.event.prefill_ms, env.event.prefill_plan_ms) == (300.0, 150.0)
    assert env.event.role == "decode" and env.event.queue_order == "deadline"
    ordered = [*timed, "arrival"]  # the order its prefill queue is served in, added last
    (env,) = decode_batch({b"v": b"1", b"h": orjson.dumps(["e1", "ep", 0, [ordered]]), b"b": b""})
    assert env.event.queue_order == "arrival" and env.event.prefill_ms == 300.0
    bad = orjson.dumps(["e1", "ep", 0, [[*timed, "random"]]])
    with pytest.raises(ValueError, match="queue_order must be one of deadline, arrival"):
        decode_batch({b"v": b"1", b"h": bad, b"b": b""})
    assert env.event.kv_blocks_held is None  # (unknown: the router keeps its own count)
    held = [*ordered, 70]  # the KV blocks its requests hold, added last
    (env,) = decode_batch({b"v": b"1", b"h": orjson.dumps(["e1", "ep", 0, [held]]), b"b": b""})
    assert env.event.kv_blocks_held == 70 and env.event.queue_order == "arrival"
    for wrong in (-1, 2.5, "70"):
        bad = orjson.dumps(["e1", "ep", 0, [[*ordered, wrong]]])
        with pytest.raises(ValueError, match="kv_blocks_held"):
            decode_batch({b"v": b"1", b"h": bad, b"b": b""})
    assert env.event.decode_tokens is None
    tokens = [*held, 40]  # the tokens its decode steps gave in the interval, added last
    (env,) = decode_batch({b"v": b"1", b"h": orjson.dumps(["e1", "ep", 0, [tokens]]), b"b": b""})
    assert env.event.decode_tokens == 40 and env.event.kv_blocks_held == 70
    for wrong in (-1, 2.5, "40"):
        bad = orjson.dumps(["e1", "ep", 0, [[*held, wrong]]])
        with pytest.raises(ValueError, match="decode_tokens"):
            decode_batch({b"v": b"1", b"h": bad, b"b": b""})
    assert env.event.prefill_chunk_tokens is None  # (whole prompts, or not known)
    chunked = [*tokens, 8192]  # the most prompt tokens it prefills in one piece, added last
    (env,) = decode_batch({b"v": b"1", b"h": orjson.dumps(["e1", "ep", 0, [chunked]]), b"b": b""})
    assert env.event.prefill_chunk_tokens == 8192 and env.event.decode_tokens == 40
    for wrong in (0, -1, 2.5, "8192"):
        bad = orjson.dumps(["e1", "ep", 0, [[*tokens, wrong]]])
        with pytest.raises(ValueError, match="prefill_chunk_tokens"):
            decode_batch({b"v": b"1", b"h": bad, b"b": b""})
    newer = orjson.dumps(["e1", "ep", 0, [[*chunked, "extra"]]])
    with pytest.raises(CodecError, match="11 to 21 items"):
        decode_batch({b"v": b"1", b"h": newer, b"b": b""})
    # a finished request's cap (what routers learn answers' lengths against) came later too
    old_fi = orjson.dumps(["e1", "ep", 0, [["fi", 1.0, "r1", 120, 50.0, 20.0]]])
    (env,) = decode_batch({b"v": b"1", b"h": old_fi, b"b": b""})
    assert env.event == RequestFinished("r1", 120, 50.0, 20.0) and env.event.max_tokens is None
    capped = orjson.dumps(["e1", "ep", 0, [["fi", 1.0, "r1", 120, 50.0, 20.0, 4096]]])
    (env,) = decode_batch({b"v": b"1", b"h": capped, b"b": b""})
    assert env.event.max_tokens == 4096
    bad_fi = orjson.dumps(["e1", "ep", 0, [["fi", 1.0, "r1", 120, 50.0, 20.0, -1]]])
    with pytest.raises(ValueError, match="max_tokens"):
        decode_batch({b"v": b"1", b"h": bad_fi, b"b": b""})
    # a refusal's cause and the engine's own estimate came later too
    old_rj = orjson.dumps(["e1", "ep", 0, [["rj", 1.0, "r1", "too slow"]]])
    (env,) = decode_batch({b"v": b"1", b"h": old_rj, b"b": b""})
    assert env.event == RequestRejected("r1", "too slow", "", 0.0, 0)
    new_rj = orjson.dumps(["e1", "ep", 0, [["rj", 1.0, "r1", "too slow", "tpot", 116.0, 900]]])
    (env,) = decode_batch({b"v": b"1", b"h": new_rj, b"b": b""})
    assert (env.event.cause, env.event.estimate_ms, env.event.estimate_tokens) == (
        "tpot",
        116.0,
        900,
    )
    for bad_rj, why in (
        (["rj", 1.0, "r1", "x", "slow"], "cause must be one of"),
        (["rj", 1.0, "r1", "x", "tpot", -1.0], "estimate_ms must be a finite non-negative"),
        (["rj", 1.0, "r1", "x", "tpot", 1.0, 2.5], "estimate_tokens must be a non-negative int"),
        (["rj", 1.0, "r1", "x", "tpot", 1.0, 2, 3], "4 to 7 items"),
    ):
        with pytest.raises(ValueError, match=why):
            decode_batch({b"v": b"1", b"h": orjson.dumps(["e1", "ep", 0, [bad_rj]]), b"b": b""})


def test_batch_must_be_consecutive_and_one_engine() -> None:
    a = Envelope("e", "p", 0, 0.0, AllCleared())
    with pytest.raises(CodecError, match="consecutive"):
        encode_batch([a, Envelope("e", "p", 2, 0.0, AllCleared())])
    with pytest.raises(CodecError, match="one engine"):
        encode_batch([a, Envelope("f", "p", 1, 0.0, AllCleared())])


def test_events_validate_on_construction() -> None:
    with pytest.raises(EventError):
        BlockStored(None, (1, 2), (b"a",))
    with pytest.raises(EventError):
        BlockStored(None, (True,), (b"a",))
    with pytest.raises(EventError):
        RequestEnqueued("r", 5, 6, 1, 1)
    with pytest.raises(EventError):
        FirstToken("r", float("nan"))


def test_an_event_names_a_bounded_number_of_blocks_and_producers_split_longer_runs() -> None:
    """300,000 blocks in one event took a router's event loop for 0.4 s: an event names at
    most ``MAX_BLOCKS_PER_EVENT``, and a longer chain or eviction goes out in pieces."""
    n = MAX_BLOCKS_PER_EVENT
    with pytest.raises(EventError, match="blocks in one event"):
        BlockStored(None, tuple(range(1, n + 2)), (b"b",) * (n + 1))
    with pytest.raises(EventError, match="blocks in one event"):
        BlockRemoved(tuple(range(1, n + 2)))
    hashes = list(range(1, 2 * n + 11))
    pieces = stored_events(7, hashes, [b"b"] * len(hashes))
    assert [len(p.hashes) for p in pieces] == [n, n, 10]
    assert [p.parent_hash for p in pieces] == [7, n, 2 * n]  # each chained to the one before
    assert [h for p in pieces for h in p.hashes] == hashes
    assert [len(p.hashes) for p in removed_events(hashes)] == [n, n, 10]
    assert stored_events(None, [], []) == [] and removed_events([]) == []


@given(st.lists(block_stored, max_size=6), st.none() | heartbeat, st.integers(-1, 10**9))
@settings(max_examples=100, deadline=None)
def test_snapshot_round_trips(blocks, hb, seq) -> None:
    snap = Snapshot("eng", "epoch", seq, "12-0", tuple(blocks), hb)
    assert decode_snapshot(encode_snapshot(snap)) == snap


@given(st.binary(max_size=100))
def test_garbage_snapshot_rejected(data) -> None:
    try:
        decode_snapshot(data)
    except CodecError:
        pass


def test_snapshot_header_length_checked() -> None:
    head = orjson.dumps([1, "e", "p", 0, "0-0", [], None])
    with pytest.raises(CodecError):
        decode_snapshot((len(head) + 5).to_bytes(8, "big") + head)
