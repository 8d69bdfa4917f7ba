"""The embedded broker keeps the Redis broker's contract."""

from __future__ import annotations

import asyncio

import pytest

import broker
from broker.base import START_ID, BrokerUnavailable
from broker.memory import MemoryBroker


async def test_connect_memory_gives_a_new_embedded_broker() -> None:
    a = await broker.connect("memory://")
    b = await broker.connect("memory://", prefix="x:")
    assert isinstance(a, MemoryBroker) and a is not b and b.prefix == "x:"


async def test_append_read_positions_and_last_id() -> None:
    b = MemoryBroker()
    assert await b.last_id("e") == START_ID
    ids = await b.append("e", [{b"n": b"1"}, {b"n": b"2"}, {b"n": b"3"}])
    assert await b.last_id("e") == ids[-1]
    got = await b.read({"e": START_ID}, count=2)
    assert got == [("e", [(ids[0], {b"n": b"1"}), (ids[1], {b"n": b"2"})])]
    got = await b.read({"e": ids[1], "other": START_ID})
    assert got == [("e", [(ids[2], {b"n": b"3"})])]
    assert await b.read({"e": ids[2]}) == []


async def test_trimming_keeps_at_least_maxlen_newest_entries() -> None:
    b = MemoryBroker()
    for i in range(100):
        await b.append("e", [{b"i": str(i).encode()}], maxlen=20)
    n = b.stream_length("e")
    assert 20 <= n <= 23
    entries = (await b.read({"e": START_ID}, count=1000))[0][1]
    assert entries[-1][1] == {b"i": b"99"}


async def test_blocking_read_wakes_on_append() -> None:
    b = MemoryBroker()
    reader = asyncio.create_task(b.read({"e": START_ID}, block_ms=5000))
    await asyncio.sleep(0.01)
    assert not reader.done()
    await b.append("e", [{b"k": b"v"}])
    got = await asyncio.wait_for(reader, 1)
    assert got[0][1][0][1] == {b"k": b"v"}


async def test_blocking_read_times_out_empty() -> None:
    assert await MemoryBroker().read({"e": START_ID}, block_ms=20) == []


async def test_registry_expires_and_asks_for_missing_or_requested_snapshots() -> None:
    now = [100.0]
    b = MemoryBroker(clock=lambda: now[0])
    assert await b.register("e1", 10) is True  # no snapshot stored yet
    await b.put_snapshot("e1", b"snap")
    assert await b.register("e1", 10) is False
    await b.request_snapshot("e1")
    assert await b.register("e1", 10) is True
    assert await b.register("e1", 10) is False  # the request was consumed
    await b.register("e2", 1)
    assert await b.engines() == ["e1", "e2"]
    now[0] += 5
    assert await b.engines() == ["e1"]
    await b.unregister("e1")
    assert await b.engines() == []
    assert await b.get_snapshot("e1") == b"snap"


async def test_closed_broker_is_unavailable() -> None:
    b = MemoryBroker()
    await b.close()
    with pytest.raises(BrokerUnavailable):
        await b.append("e", [{b"a": b"b"}])
