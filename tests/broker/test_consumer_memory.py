"""Reporter -> embedded broker -> Consumer: ordering, resyncs and bad data, in one process."""

from __future__ import annotations

import asyncio

import pytest
from broker_testkit import FoldingSink, PlainSink, Workload, wait_until

from broker.codec import encode_batch
from broker.consumer import Consumer
from broker.events import BlockStored, Envelope, RequestStarted
from broker.memory import MemoryBroker
from broker.tracker import State
from engine_reporter import Reporter

FAST = {
    "discover_interval_s": 0.02,
    "block_ms": 20,
    "snapshot_poll_s": 0.02,
    "snapshot_request_s": 0.05,
}


def reporter(b, engine_id="e1", **kw) -> Reporter:
    return Reporter(b, engine_id, flush_interval_s=0.002, registry_ttl_s=0.3, **kw)


async def run_workload(rep: Reporter, work: Workload, n: int, *, yield_every: int = 50) -> None:
    for i in range(n):
        rep.emit(work.next_event())
        if i % yield_every == 0:
            await asyncio.sleep(0)
    assert await rep.flush()


async def converged(sink: FoldingSink, rep: Reporter, timeout_s: float = 10.0) -> bool:
    return await wait_until(
        lambda: sink.state(rep.engine_id) == rep.builder.cached_hashes(), timeout_s
    )


@pytest.mark.parametrize("sink_type", [FoldingSink, PlainSink])
async def test_consumer_follows_reporter_exactly_in_order(sink_type) -> None:
    b = MemoryBroker()
    rep = reporter(b)
    await rep.start()
    sink = sink_type()
    consumer = Consumer(b, sink, **FAST)
    await consumer.start()
    work = Workload(1, clear_every=97)
    await run_workload(rep, work, 600)
    assert await converged(sink, rep)
    assert sink.state("e1") == set(work.cached)
    assert not sink.violations
    assert consumer.stats.resyncs == 0 and consumer.stats.malformed == 0
    assert consumer.stats.events == 600
    assert consumer.stats.lag_s >= 0
    await consumer.close()
    await rep.close()


async def test_overflow_drops_are_counted_and_consumer_resyncs_from_snapshot() -> None:
    b = MemoryBroker()
    rep = reporter(b, buffer_size=16)
    await rep.start()
    sink = FoldingSink()
    consumer = Consumer(b, sink, **FAST)
    await consumer.start()
    work = Workload(2)
    await run_workload(rep, work, 50, yield_every=5)
    assert await converged(sink, rep)
    for _ in range(500):  # no yield: the flusher cannot run, the buffer overflows
        rep.emit(work.next_event())
    assert rep.dropped > 0 and rep.pending == 16
    await run_workload(rep, work, 20, yield_every=5)
    assert await converged(sink, rep)
    assert sink.state("e1") == set(work.cached)
    assert consumer.stats.resyncs >= 1 and consumer.stats.snapshots_loaded >= 2
    assert not sink.violations
    await consumer.close()
    await rep.close()


async def test_engine_restart_with_new_epoch_resets_and_ignores_the_old_epoch() -> None:
    b = MemoryBroker()
    old = reporter(b)
    await old.start()
    sink = FoldingSink()
    consumer = Consumer(b, sink, **FAST)
    await consumer.start()
    await run_workload(old, Workload(3), 200)
    assert await converged(sink, old)
    await old.close(unregister=False)
    new = reporter(b)
    await new.start()
    work = Workload(4)
    await run_workload(new, work, 100)
    assert await converged(sink, new)
    assert sink.state("e1") == set(work.cached)
    # a zombie of the old epoch writing late is ignored
    zombie = Envelope("e1", old.epoch, old.builder.next_seq, 1.0, RequestStarted("z"))
    await b.append("e1", [encode_batch([zombie])])
    await run_workload(new, work, 10)
    assert await converged(sink, new)
    assert await wait_until(lambda: consumer.stats.stale == 1)
    assert consumer.stats.new_epochs == 1
    await consumer.close()
    await new.close()


async def test_garbage_and_duplicate_entries_are_skipped_and_counted() -> None:
    b = MemoryBroker()
    rep = reporter(b)
    await rep.start()
    sink = FoldingSink()
    consumer = Consumer(b, sink, **FAST)
    await consumer.start()
    work = Workload(5)
    await run_workload(rep, work, 30)
    assert await converged(sink, rep)
    garbage = [
        {b"v": b"1", b"h": b"\xff\xfe", b"b": b""},
        {b"x": b"y"},
        {b"v": b"1", b"h": b'["other",  "ep", 0, [["ac", 1.0]]]', b"b": b""},
    ]
    await b.append("e1", garbage)
    first = (await b.read({"e1": "0-0"}, count=100))[0][1][0]
    await b.append("e1", [first[1]])  # a re-sent batch
    await run_workload(rep, work, 30)
    assert await converged(sink, rep)
    assert consumer.stats.malformed == 3
    assert consumer.stats.malformed_by_engine == {"e1": 3}
    assert consumer.stats.duplicates > 0
    assert consumer.stats.resyncs == 0
    assert not sink.violations
    await consumer.close()
    await rep.close()


async def test_stream_trimmed_below_position_recovers_through_requested_snapshot() -> None:
    b = MemoryBroker()
    rep = reporter(b, snapshot_interval_s=3600, maxlen=0)
    await rep.start()
    sink = FoldingSink()
    consumer = Consumer(b, sink, **FAST)
    await consumer.poll_once()
    work = Workload(6)
    await run_workload(rep, work, 40, yield_every=2)
    while await consumer.poll_once():
        pass
    assert sink.state("e1") == rep.builder.cached_hashes()
    await run_workload(rep, work, 200, yield_every=2)
    b.trim("e1", 1)  # far below the consumer's position, beyond the latest snapshot
    await consumer.poll_once()
    assert consumer.cursors["e1"].state is State.WAITING
    assert sink.state("e1") == set()  # reset: nothing known is trusted
    assert await wait_until(lambda: rep.stats.snapshots >= 2, 5)  # it asked the reporter
    for _ in range(50):
        await consumer.poll_once(block_ms=10)
        if consumer.cursors["e1"].state is State.ACTIVE:
            break
    assert sink.state("e1") == set(work.cached)
    assert consumer.stats.resyncs == 1
    await rep.close()


async def test_a_failing_sink_never_stops_the_consumer() -> None:
    class Flaky(FoldingSink):
        def apply(self, env, now):
            if type(env.event) is BlockStored and len(env.event.hashes) == 7:
                raise RuntimeError("router bug")
            super().apply(env, now)

    b = MemoryBroker()
    rep = reporter(b)
    await rep.start()
    sink = Flaky()
    consumer = Consumer(b, sink, **FAST)
    await consumer.start()
    await run_workload(rep, Workload(7), 300)
    assert await wait_until(lambda: consumer.stats.events == 300)
    assert consumer.stats.sink_errors > 0
    await consumer.close()
    await rep.close()


async def test_an_unexpected_error_is_counted_and_retried_with_backoff() -> None:
    """A round that fails for a reason nobody foresaw (a bug, a registry member that is no
    engine id) was logged every 50 ms with no backoff and counted nowhere."""
    b = MemoryBroker()
    rep = reporter(b)
    await rep.start()
    failures = 0
    real = b.engines

    async def engines() -> list[str]:
        nonlocal failures
        if failures < 4:
            failures += 1
            raise RuntimeError("a bug")
        return await real()

    b.engines = engines  # type: ignore[method-assign]
    sink = FoldingSink()
    consumer = Consumer(b, sink, **FAST, backoff_s=(0.02, 0.5))
    t0 = asyncio.get_running_loop().time()
    await consumer.start()
    await run_workload(rep, Workload(8), 100)
    assert await converged(sink, rep)
    assert consumer.stats.loop_errors == 4
    # four retries, each wait doubling from 0.02 s: 0.3 s at least before the first read
    assert asyncio.get_running_loop().time() - t0 >= 0.02 * (1 + 2 + 4 + 8) * 0.8
    await consumer.close()
    await rep.close()


async def test_a_long_read_lets_the_event_loop_run(monkeypatch) -> None:
    """Applying a read's entries lets the loop run every ``INGEST_SLICE_S`` (routing
    decisions wait on it): eight entries of 300,000 blocks each held a router's loop for 3 s."""
    import broker.consumer as consumer_module

    monkeypatch.setattr(consumer_module, "INGEST_SLICE_S", 0.0)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    seen: list[int] = []

    class Watching(FoldingSink):
        def apply(self, env, now):
            seen.append(ticks)
            super().apply(env, now)

    b = MemoryBroker()
    rep = reporter(b)
    await rep.start()
    work = Workload(9)
    for _ in range(200):  # an entry each
        rep.emit(work.next_event())
        assert await rep.flush()
    consumer = Consumer(b, Watching(), **FAST)
    task = asyncio.create_task(ticker())
    try:
        await consumer.poll_once(0)
        await consumer.poll_once(0)
    finally:
        task.cancel()
    assert len(seen) >= 100
    assert len(set(seen)) > len(seen) // 2  # the ticker ran between entries of one read
    await consumer.close()
    await rep.close()


async def test_consumer_started_late_loads_snapshot_then_replays() -> None:
    b = MemoryBroker()
    rep = reporter(b, snapshot_interval_s=0.05)
    await rep.start()
    work = Workload(8, clear_every=170)
    await run_workload(rep, work, 400)
    await asyncio.sleep(0.1)
    await run_workload(rep, work, 50)
    sink = FoldingSink()
    consumer = Consumer(b, sink, **FAST)
    await consumer.start()
    assert rep.builder.cached_blocks > 0
    assert await converged(sink, rep)
    assert consumer.stats.snapshots_loaded == 1
    assert consumer.stats.events < 450  # it did not replay the whole history
    await consumer.close()
    await rep.close()


async def test_reporter_counts_invalid_events_and_never_raises() -> None:
    b = MemoryBroker()
    rep = reporter(b)
    rep.emit("garbage")  # type: ignore[arg-type]
    rep.emit(None)  # type: ignore[arg-type]
    assert rep.stats.invalid == 2 and rep.stats.emitted == 0
    await rep.start()
    await rep.close()
    assert await b.engines() == []  # clean close leaves the registry


async def test_caught_up_only_once_the_replay_reached_the_end_of_the_stream() -> None:
    """A router's readiness rests on this: caught_up turns true on the first read that returns
    no full batch, and by then every event of the backlog has been applied."""
    b = MemoryBroker()
    rep = reporter(b, snapshot_interval_s=3600)
    await rep.start()
    work = Workload(9)
    for _ in range(40):  # a backlog of many small entries: the flusher runs between
        for _ in range(5):
            rep.emit(work.next_event())
        await asyncio.sleep(0.005)
    assert await rep.flush()
    assert b.stream_length("e1") > 20
    sink = FoldingSink()
    consumer = Consumer(b, sink, count=4, **FAST)
    rounds = []
    while not consumer.caught_up and len(rounds) < 500:
        rounds.append(await consumer.poll_once(block_ms=10))
    assert consumer.caught_up and len(rounds) > 3
    assert rounds[-1] < 4  # the read that reached the end
    assert sink.state("e1") == rep.builder.cached_hashes() == set(work.cached)
    await run_workload(rep, work, 50, yield_every=3)
    await consumer.poll_once(block_ms=10)
    assert consumer.caught_up  # latched
    await rep.close()


async def test_no_engine_means_caught_up_after_the_first_look() -> None:
    consumer = Consumer(MemoryBroker(), FoldingSink(), **FAST)
    assert not consumer.caught_up
    await consumer.poll_once(block_ms=10)
    assert consumer.caught_up


async def test_a_snapshot_that_never_comes_holds_catch_up_back_only_until_its_timeout() -> None:
    """An engine whose stream starts past seq 0 and that answers no snapshot request (its
    reporter is gone) stays pending; the consumer still counts as caught up after the bound."""
    b = MemoryBroker()
    await b.register("ghost", 60.0)
    env = Envelope("ghost", "ep1", 5, 1.0, RequestStarted("r1"))
    await b.append("ghost", [encode_batch([env])])
    consumer = Consumer(b, FoldingSink(), catch_up_timeout_s=0.3, **FAST)
    await consumer.start()
    await asyncio.sleep(0.15)
    assert consumer.cursors["ghost"].state is State.WAITING and not consumer.caught_up
    assert await wait_until(lambda: consumer.caught_up, 3.0)
    assert consumer.cursors["ghost"].state is State.WAITING
    await consumer.close()


async def test_answered_at_follows_the_broker_s_answers() -> None:
    """The consumer records when the broker last answered it (the gateway's health check takes
    that as proof the broker is up): set by the first look, moved on by later reads."""
    b = MemoryBroker()
    rep = reporter(b)
    await rep.start()
    consumer = Consumer(b, PlainSink(), **FAST)
    assert consumer.answered_at is None
    await consumer.poll_once(0)
    first = consumer.answered_at
    assert first is not None
    rep.emit(BlockStored(None, (1,), (b"x" * 64,)))
    assert await rep.flush()
    await asyncio.sleep(0.01)
    await consumer.poll_once(0)
    assert consumer.answered_at is not None and consumer.answered_at > first
    await rep.close()


async def test_an_entry_far_ahead_in_the_epoch_does_not_stop_the_engine_for_good() -> None:
    """A well-formed entry of the engine's own epoch at seq 2**63 opens a gap no snapshot of
    the real engine ever covered by seq: its stream stayed unread. Now the engine's next
    snapshot, taken after that entry, ends the gap and its events flow again."""
    b = MemoryBroker()
    rep = reporter(b)
    await rep.start()
    sink = FoldingSink()
    consumer = Consumer(b, sink, **FAST)
    await consumer.start()
    work = Workload(31)
    await run_workload(rep, work, 50)
    assert await converged(sink, rep)
    forged = Envelope("e1", rep.epoch, 2**63, 1.0, RequestStarted("forged"))
    await b.append("e1", [encode_batch([forged])])
    assert await wait_until(lambda: consumer.stats.resyncs == 1)
    for _ in range(10):  # the engine goes on working; a snapshot after the entry ends the gap
        await run_workload(rep, work, 20)
        if await wait_until(lambda: consumer.cursors["e1"].state is State.ACTIVE, 0.5):
            break
    assert await converged(sink, rep)
    assert sink.state("e1") == set(work.cached)
    assert not sink.violations
    await consumer.close()
    await rep.close()


async def test_a_forged_restart_is_counted_logged_and_the_real_epoch_taken_back(caplog) -> None:
    """An entry of a made-up epoch at seq 0 looked like a restart: the real epoch was retired
    and its every entry skipped silently for as long as the engine ran. Now those skips are
    counted and logged, and once the real epoch has gone on publishing while the made-up one
    stayed silent (``epoch_reclaim_s`` of stream time; the embedded broker's ids count
    entries), it is taken back and rebuilt from the engine's snapshot."""
    b = MemoryBroker()
    rep = reporter(b)
    await rep.start()
    sink = FoldingSink()
    consumer = Consumer(b, sink, **FAST, epoch_reclaim_s=0.02)  # 20 entries here
    await consumer.start()
    work = Workload(32)
    await run_workload(rep, work, 50)
    assert await converged(sink, rep)
    forged = Envelope("e1", "forged", 0, 1.0, RequestStarted("forged"))
    await b.append("e1", [encode_batch([forged])])
    assert await wait_until(lambda: consumer.stats.new_epochs == 1)
    for _ in range(20):  # entries of the real engine, one at a time
        await run_workload(rep, work, 1)
        await asyncio.sleep(0.005)
    assert await wait_until(lambda: consumer.stats.stale >= 1)
    assert "retired epoch" in caplog.text
    for _ in range(20):
        await run_workload(rep, work, 5)
        if await wait_until(lambda: consumer.stats.epochs_reclaimed == 1, 0.2):
            break
    await run_workload(rep, work, 20)
    assert await converged(sink, rep)
    assert sink.state("e1") == set(work.cached)
    assert consumer.cursors["e1"].epoch == rep.epoch
    assert consumer.stats.epochs_reclaimed == 1
    await consumer.close()
    await rep.close()
