"""The reporter a synchronous engine loop embeds (engine_reporter.threaded): a hand-off that never
blocks the engine, publishing on a thread of its own, riding out a stopped Redis (drop, count,
resync with a snapshot) and resetting the cache view when the hand-off itself overflows."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from broker.codec import decode_batch, decode_snapshot
from broker.events import AllCleared, BlockStored, Envelope, LoadHeartbeat, RequestStarted
from broker.redis_broker import connect_redis
from engine_reporter.hashing import block_hash
from engine_reporter.threaded import ThreadedReporter

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]


def heartbeat(waiting: int) -> LoadHeartbeat:
    return LoadHeartbeat(waiting, 0, 0, 0, 100, 0.0, "p", "http://e:1", ("m",))


def stored(i: int) -> BlockStored:
    data = f"block {i}".encode()
    return BlockStored(None, (block_hash(None, data),), (data,))


async def read_all(url: str, prefix: str, engine: str) -> tuple[list[Envelope], bytes | None]:
    broker = connect_redis(url, prefix=prefix)
    try:
        res = await broker.read({engine: "0-0"}, count=1_000_000)
        envs = [env for _, entries in res for _, f in entries for env in decode_batch(f)]
        return envs, await broker.get_snapshot(engine)
    finally:
        await broker.close()


def wait_for(cond, timeout_s: float = 15.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.02)


def test_events_and_heartbeats_reach_the_stream_from_another_thread(redis_url, redis_prefix):
    rep = ThreadedReporter(lambda: connect_redis(redis_url, prefix=redis_prefix), "eng")
    rep.start()
    try:
        rep.submit([RequestStarted("r1"), RequestStarted("r2")])
        rep.heartbeat(heartbeat(3))
        rep.submit([RequestStarted("r3")])
        wait_for(lambda: rep.counters().get("reporter_published", 0) >= 4)
    finally:
        rep.close()
    envs, snap = asyncio.run(read_all(redis_url, redis_prefix, "eng"))
    started = [e.event.request_id for e in envs if isinstance(e.event, RequestStarted)]
    assert started == ["r1", "r2", "r3"]
    assert [e.seq for e in envs] == sorted(e.seq for e in envs)
    assert any(isinstance(e.event, LoadHeartbeat) and e.event.waiting == 3 for e in envs)
    assert snap is not None and not rep.alive


def test_a_stopped_redis_never_blocks_the_engine_and_resyncs(private_redis, redis_prefix):
    """The engine hands over events all through an outage; the reporter drops what its buffer
    cannot hold (counted) and, once Redis is back, publishes a snapshot that covers the loss."""
    url = private_redis.url
    rep = ThreadedReporter(
        lambda: connect_redis(url, prefix=redis_prefix),
        "eng",
        reporter_options={"buffer_size": 200, "backoff_s": (0.05, 0.2)},
    )
    rep.start()
    try:
        rep.submit([stored(0)])
        wait_for(lambda: rep.counters().get("reporter_published", 0) >= 1)
        private_redis.stop()
        handed = threading.Event()

        def engine_loop() -> None:  # what the engine does while Redis is down
            for i in range(1, 2001):
                rep.submit([stored(i)])
            handed.set()

        t = threading.Thread(target=engine_loop)
        t.start()
        t.join(30)
        assert handed.is_set(), "the engine thread blocked on the reporter"
        wait_for(lambda: not rep.counters()["broker_connected"])
        wait_for(lambda: rep.counters()["reporter_dropped"] > 0)
        private_redis.start()
        wait_for(lambda: rep.counters()["broker_connected"] == 1)
        rep.submit([stored(2001)])
        wait_for(lambda: rep.counters()["reporter_pending"] == 0, 30)
    finally:
        rep.close()
    counters = rep.counters()
    assert counters["submitted"] == 2002 and counters["dropped"] == 0  # the hand-off kept all
    # the 2,000 events of the outage all passed through a buffer of 200: at least 1,800 dropped
    assert counters["reporter_dropped"] >= 2000 - 200  # the reporter's buffer did not keep all
    envs, raw = asyncio.run(read_all(url, redis_prefix, "eng"))
    assert raw is not None
    snap = decode_snapshot(raw)
    # Redis restarted empty: the snapshot holds every block (dropped ones included), and the
    # stream after it continues where the snapshot stops
    blocks = {h for chain in snap.blocks for h in chain.hashes}
    blocks |= {h for e in envs if isinstance(e.event, BlockStored) for h in e.event.hashes}
    assert blocks == {stored(i).hashes[0] for i in range(2002)}
    assert all(e.seq > snap.seq for e in envs)


def test_an_overflowing_hand_off_drops_counts_and_starts_over(redis_url, redis_prefix):
    lost = []
    rep = ThreadedReporter(
        lambda: connect_redis(redis_url, prefix=redis_prefix),
        "eng",
        max_batches=3,
        on_lost=lambda: lost.append(True),
    )
    for i in range(10):  # the thread is not running yet: nothing drains
        rep.submit([RequestStarted(f"r{i}")])
    assert rep.stats.dropped == 7
    rep.start()
    try:
        wait_for(lambda: rep.stats.losses == 1)
        rep.submit([RequestStarted("after")])
        wait_for(lambda: rep.counters().get("reporter_published", 0) >= 2)
    finally:
        rep.close()
    envs, _ = asyncio.run(read_all(redis_url, redis_prefix, "eng"))
    kinds = [type(e.event).__name__ for e in envs]
    assert lost == [True] and rep.stats.losses == 1 and rep.stats.discarded == 3
    assert kinds[0] == "AllCleared" and isinstance(envs[0].event, AllCleared)
    assert [e.event.request_id for e in envs if isinstance(e.event, RequestStarted)] == ["after"]


def test_a_translate_error_skips_the_batch_only(redis_url, redis_prefix):
    def translate(batch):
        if batch == "bad":
            raise ValueError("not a batch")
        return [RequestStarted(batch)]

    rep = ThreadedReporter(
        lambda: connect_redis(redis_url, prefix=redis_prefix), "eng", translate=translate
    )
    rep.start()
    try:
        for raw in ("a", "bad", "b"):
            rep.submit_raw(raw)
        wait_for(lambda: rep.counters().get("reporter_published", 0) >= 2)
    finally:
        rep.close()
    envs, _ = asyncio.run(read_all(redis_url, redis_prefix, "eng"))
    assert [e.event.request_id for e in envs] == ["a", "b"]
    assert rep.stats.translate_errors == 1
