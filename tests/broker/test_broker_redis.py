"""The event path against a real Redis: restarts, trimming, outages, garbage, epochs."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from broker_testkit import FoldingSink, Workload, wait_until

import broker
from broker.base import BrokerUnavailable
from broker.codec import encode_batch, encode_snapshot
from broker.consumer import Consumer
from broker.events import Envelope, RequestStarted, Snapshot
from broker.redis_broker import RedisBroker
from broker.tracker import State
from engine_reporter import Reporter

pytestmark = pytest.mark.redis

FAST = {
    "discover_interval_s": 0.05,
    "block_ms": 50,
    "snapshot_poll_s": 0.05,
    "snapshot_request_s": 0.1,
    "backoff_s": (0.02, 0.2),
}


def reporter(b, engine_id="e1", **kw) -> Reporter:
    kw.setdefault("registry_ttl_s", 1.0)
    return Reporter(b, engine_id, flush_interval_s=0.002, backoff_s=(0.02, 0.2), **kw)


@pytest.fixture
async def shared(redis_url, redis_prefix):
    """A broker on the shared Redis under a unique prefix, and a raw client; keys removed after."""
    b = await broker.connect(redis_url, prefix=redis_prefix)
    raw = aioredis.Redis.from_url(redis_url)
    yield b, raw
    keys = [k async for k in raw.scan_iter(match=f"{redis_prefix}*", count=1000)]
    if keys:
        await raw.delete(*keys)
    await raw.aclose()
    await b.close()


async def run_workload(
    rep: Reporter, work: Workload, n: int, *, yield_every: int = 50, flush: bool = True
) -> None:
    for i in range(n):
        rep.emit(work.next_event())
        if i % yield_every == 0:
            await asyncio.sleep(0)
    if flush:
        await rep.flush()


async def converged(sink: FoldingSink, rep: Reporter, timeout_s: float = 15.0) -> bool:
    return await wait_until(
        lambda: sink.state(rep.engine_id) == rep.builder.cached_hashes(), timeout_s
    )


async def test_connect_picks_redis_and_rejects_unknown_schemes(shared) -> None:
    b, _ = shared
    assert isinstance(b, RedisBroker)
    await b.ping()
    with pytest.raises(ValueError):
        await broker.connect("http://127.0.0.1:6379")


async def test_restarted_consumer_ends_with_the_state_of_one_that_never_stopped(shared) -> None:
    b, _ = shared
    rep = reporter(b, maxlen=200)
    await rep.start()
    steady_sink, restarted_sink = FoldingSink(), FoldingSink()
    steady = Consumer(b, steady_sink, **FAST)
    first = Consumer(b, restarted_sink, **FAST)
    await steady.start()
    await first.start()
    work = Workload(11, clear_every=301)
    await run_workload(rep, work, 400)
    assert await wait_until(lambda: first.stats.events >= 200)
    await first.close()  # killed mid-stream
    await run_workload(rep, work, 400)
    second_sink = FoldingSink()
    second = Consumer(b, second_sink, **FAST)  # a fresh process: snapshot + replay
    await second.start()
    await run_workload(rep, work, 200)
    assert await converged(steady_sink, rep)
    assert await converged(second_sink, rep)
    assert second_sink.state("e1") == steady_sink.state("e1") == set(work.cached)
    assert not steady_sink.violations and not second_sink.violations
    assert steady.stats.resyncs == 0
    for c in (steady, second):
        await c.close()
    await rep.close()


async def test_stream_trimmed_below_consumer_position_recovers_through_snapshot(shared) -> None:
    b, raw = shared
    rep = reporter(b, snapshot_interval_s=3600, maxlen=0, registry_ttl_s=0.3)
    await rep.start()
    sink = FoldingSink()
    consumer = Consumer(b, sink, **FAST)
    await consumer.poll_once()
    work = Workload(12)
    await run_workload(rep, work, 60, yield_every=3)
    while await consumer.poll_once():
        pass
    assert sink.state("e1") == rep.builder.cached_hashes()
    await run_workload(rep, work, 300, yield_every=3)
    await raw.xtrim(f"{b.prefix}s:e1", maxlen=1, approximate=False)
    await consumer.poll_once()
    assert consumer.cursors["e1"].state is State.WAITING
    for _ in range(200):
        await consumer.poll_once(block_ms=20)
        if consumer.cursors["e1"].state is State.ACTIVE:
            break
    await consumer.poll_once()
    assert sink.state("e1") == set(work.cached)
    assert consumer.stats.resyncs == 1 and consumer.stats.snapshots_loaded == 2
    await rep.close()


async def test_garbage_written_raw_is_skipped_and_counted(shared) -> None:
    b, raw = shared
    rep = reporter(b)
    await rep.start()
    sink = FoldingSink()
    consumer = Consumer(b, sink, **FAST)
    await consumer.start()
    work = Workload(13)
    await run_workload(rep, work, 50)
    assert await converged(sink, rep)
    key = f"{b.prefix}s:e1"
    await raw.xadd(key, {"hello": "world"})
    await raw.xadd(key, {"v": "1", "h": b"\x00\xff garbage", "b": ""})
    await raw.xadd(key, {"v": "9", "h": "[]", "b": ""})
    await run_workload(rep, work, 50)
    assert await converged(sink, rep)
    assert consumer.stats.malformed == 3
    assert consumer.stats.resyncs == 0
    # a key of the wrong type under the stream name quarantines that engine, not the consumer
    await raw.set(f"{b.prefix}s:bad", "not a stream")
    await raw.set(f"{b.prefix}alive:bad", "1", ex=30)
    await raw.sadd(f"{b.prefix}engines", "bad")
    await wait_until(lambda: consumer.stats.malformed_by_engine.get("bad", 0) >= 1)
    await run_workload(rep, work, 50)
    assert await converged(sink, rep)
    assert consumer.stats.malformed_by_engine.get("bad", 0) >= 1
    # a registry member that is no engine id (not UTF-8) made every discovery raise, and the
    # consumer read nothing more: dropped and counted, the engines' events still flow
    await raw.sadd(f"{b.prefix}engines", b"\xff\xfe-bad", b"")
    await raw.set(f"{b.prefix}alive:".encode() + b"\xff\xfe-bad", "1", ex=30)
    assert await wait_until(lambda: b.stats.bad_registry_members >= 2)
    assert not await raw.sismember(f"{b.prefix}engines", b"\xff\xfe-bad")
    await run_workload(rep, work, 50)
    assert await converged(sink, rep)
    assert consumer.stats.loop_errors == 0
    await consumer.close()
    await rep.close()


async def test_engine_restarted_with_new_epoch(shared) -> None:
    b, _ = shared
    old = reporter(b)
    await old.start()
    sink = FoldingSink()
    consumer = Consumer(b, sink, **FAST)
    await consumer.start()
    await run_workload(old, Workload(14), 300)
    assert await converged(sink, old)
    await old.close(unregister=False)
    new = reporter(b)
    await new.start()
    work = Workload(15)
    await run_workload(new, work, 150)
    assert await converged(sink, new)
    assert sink.state("e1") == set(work.cached)
    assert consumer.stats.new_epochs == 1 and consumer.stats.resyncs == 0
    late_sink = FoldingSink()
    late = Consumer(b, late_sink, **FAST)  # starts from the new epoch's snapshot
    await late.start()
    assert await converged(late_sink, new)
    for c in (consumer, late):
        await c.close()
    await new.close()


async def test_redis_restart_mid_run_loses_nothing(private_redis, redis_prefix) -> None:
    b = await broker.connect(private_redis.url, prefix=redis_prefix)
    rep = reporter(b, registry_ttl_s=0.6)
    await rep.start()
    sink = FoldingSink()
    consumer = Consumer(b, sink, **FAST)
    await consumer.start()
    work = Workload(16, clear_every=500)
    await run_workload(rep, work, 300)
    assert await converged(sink, rep)
    private_redis.stop()  # all data lost: streams, snapshots, registry
    await run_workload(rep, work, 300, flush=False)  # the engine goes on while Redis is down
    await asyncio.sleep(0.3)
    assert not rep.connected and not consumer.connected
    private_redis.start()
    await run_workload(rep, work, 100)
    assert await converged(sink, rep, 20)
    assert sink.state("e1") == set(work.cached)
    assert not sink.violations
    assert consumer.stats.reconnects >= 1 and rep.stats.reconnects >= 1
    await consumer.close()
    await rep.close()
    await b.close()


async def test_reporter_facing_dead_redis_keeps_engine_running_then_resyncs(
    private_redis, redis_prefix
) -> None:
    b = await broker.connect(private_redis.url, prefix=redis_prefix)
    rep = reporter(b, buffer_size=1000)
    await rep.start()
    sink = FoldingSink()
    consumer = Consumer(b, sink, **FAST)
    await consumer.start()
    work = Workload(17)
    await run_workload(rep, work, 100)
    assert await converged(sink, rep)
    private_redis.stop()
    started = time.monotonic()
    for i in range(20_000):  # the engine's hot loop: emit must return at once every time
        rep.emit(work.next_event())
        if i % 1000 == 0:
            await asyncio.sleep(0.001)
    elapsed = time.monotonic() - started
    assert rep.pending <= 1000 and rep.dropped >= 19_000
    assert rep.stats.publish_errors >= 1
    private_redis.start()
    await run_workload(rep, work, 50)
    assert await converged(sink, rep, 20)
    assert sink.state("e1") == set(work.cached)
    assert consumer.stats.resyncs >= 1
    assert elapsed < 60  # sanity bound only (the loop is sync); not a performance assertion
    await consumer.close()
    await rep.close()
    await b.close()


async def test_broker_down_is_reported_as_unavailable(private_redis) -> None:
    b = await broker.connect(private_redis.url)
    private_redis.stop()
    with pytest.raises(BrokerUnavailable):
        await b.append("e", [{b"a": b"b"}])
    with pytest.raises(BrokerUnavailable):
        await b.read({"e": "0-0"}, block_ms=10)
    await b.close()


async def _closed_within(what: str, close, limit_s: float) -> float:
    started = time.monotonic()
    await asyncio.wait_for(close(), limit_s + 5)  # a hang fails here, not at the suite's timeout
    elapsed = time.monotonic() - started
    assert elapsed < limit_s, f"{what} took {elapsed:.1f} s to close"
    return elapsed


@pytest.mark.parametrize("when", ["down", "restarting"])
async def test_closing_while_redis_is_down_or_restarting_is_bounded(
    private_redis, redis_prefix, when
) -> None:
    """Shutdown (consumer, reporter, broker) never waits on a Redis that is away or coming
    back; each component ends within a few seconds."""
    eb = await broker.connect(private_redis.url, prefix=redis_prefix)
    rb = await broker.connect(private_redis.url, prefix=redis_prefix)
    rep = reporter(eb)
    await rep.start()
    sink = FoldingSink()
    consumer = Consumer(rb, sink, **FAST)
    await consumer.start()
    work = Workload(18)
    await run_workload(rep, work, 100)
    assert await converged(sink, rep)
    private_redis.stop()
    await run_workload(rep, work, 50, flush=False)
    assert await wait_until(lambda: not rep.connected and not consumer.connected, 10)
    restart = None
    if when == "restarting":
        restart = asyncio.create_task(asyncio.to_thread(private_redis.start))
        await asyncio.sleep(0.01)  # the server is starting while everything closes
    await _closed_within("consumer", consumer.close, 6)
    await _closed_within("reporter", rep.close, 8)
    await _closed_within("router's broker", rb.close, 6)
    await _closed_within("engine's broker", eb.close, 6)
    if restart is not None:
        await restart


async def _two_engines(b):
    reps = [reporter(b, "e1"), reporter(b, "e2")]
    for rep in reps:
        await rep.start()
    sink = FoldingSink()
    consumer = Consumer(b, sink, **FAST)
    await consumer.start()
    works = [Workload(21), Workload(22)]
    for rep, work in zip(reps, works, strict=True):
        await run_workload(rep, work, 60)
        assert await converged(sink, rep)
    return reps, works, sink, consumer


@pytest.mark.parametrize("bad_id", ["18446744073709551616-0", "1_000-0"])
async def test_forged_snapshot_id_is_skipped_and_no_stream_is_wedged(shared, bad_id) -> None:
    """A snapshot whose stream id Redis refuses, then a gap on its stream: before, the cursor
    took that id as its position and every multi-stream XREAD failed from then on, so every
    engine went dead in the router. Now the snapshot is malformed and skipped."""
    b, raw = shared
    (e1, e2), (w1, w2), sink, consumer = await _two_engines(b)
    seq = e1.builder.next_seq
    forged = Snapshot("e1", e1.epoch, seq, bad_id, ())
    await raw.set(f"{b.prefix}snap:e1", encode_snapshot(forged))
    gap = Envelope("e1", e1.epoch, seq + 1, time.time(), RequestStarted("forged"))
    await raw.xadd(f"{b.prefix}s:e1", encode_batch([gap]))
    assert await wait_until(lambda: consumer.stats.malformed_by_engine.get("e1", 0) >= 1)
    await run_workload(e2, w2, 60)
    assert await converged(sink, e2)
    await run_workload(e1, w1, 60)  # the engine moves past the gap; its own snapshot covers it
    assert await converged(sink, e1)
    assert consumer.stats.malformed_by_engine == {"e1": 1}
    for c in (consumer, e1, e2):
        await c.close()


async def test_a_position_redis_refuses_stops_only_its_own_stream(shared) -> None:
    """However a position Redis refuses came about, that stream alone starts over (counted)
    while the others are read on."""
    b, _ = shared
    (e1, e2), (w1, w2), sink, consumer = await _two_engines(b)
    consumer.cursors["e1"].position = "1_000-0"
    await run_workload(e2, w2, 60)
    assert await converged(sink, e2)
    await run_workload(e1, w1, 60)
    assert await converged(sink, e1)
    assert consumer.stats.malformed_by_engine.get("e1", 0) == 1
    assert "e2" not in consumer.stats.malformed_by_engine
    for c in (consumer, e1, e2):
        await c.close()
