"""What a router runs to follow every engine's stream: the async shell around :mod:`broker.tracker`.

Each router replica runs its own Consumer and reads every engine stream with plain multi-stream
reads (no consumer groups: every replica needs every event). Engines are discovered through the
registry and picked up while running. Per engine:

1. on discovery, load its snapshot (if any) into the sink and read the stream after the
   snapshot's id; without one, read from the start of the stream;
2. decode each entry (:mod:`broker.codec`); a malformed one is counted, logged once per engine
   and skipped;
3. apply events in (epoch, seq) order, each at most once: duplicates are skipped, a new epoch
   from seq 0 resets the engine, AllCleared resets it before it is applied; entries of an epoch
   left behind are counted (``stale``) and logged (at most every few minutes per engine), and
   such an epoch that still publishes after its successor has been silent for
   ``epoch_reclaim_s`` is taken back (``epochs_reclaimed``; a forged restart);
4. on a gap (seq jump, trimmed stream, lost events) reset the engine and wait for a snapshot that
   covers the gap, asking the engine's reporter for one; then load it and replay after its id.

A broker outage is ridden out with exponential backoff; positions live in memory, so reading
continues exactly where it stopped and nothing is lost or applied twice.

**Caught up** (:attr:`Consumer.caught_up`, what a router's readiness rests on): the registry
has been read, every live engine's snapshot is loaded (or it has none), and one read of the
streams returned no full batch, so the replay reached the end of every stream. It stays true
after that (a later gap is a resync, not a restart). An engine whose snapshot never comes does
not hold it back for ever: after ``catch_up_timeout_s`` the consumer counts as caught up with
what it has and logs the engines still pending.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from broker.base import (
    BadPosition,
    BadStream,
    Broker,
    BrokerError,
    BrokerUnavailable,
    parse_id,
)
from broker.codec import CodecError, decode_batch, decode_snapshot
from broker.events import AllCleared, BlockStored, Envelope, Snapshot
from broker.tracker import RECLAIM_AFTER_MS, Cursor, State, Verdict
from kvgate.aio import stop_tasks
from kvgate.logs import LogOnce

log = logging.getLogger("kvgate.consumer")

# close() waits this long at most for the task (a round is bounded by the broker's timeouts; a
# cancel() that a Redis call swallowed is repeated, see kvgate.aio).
CLOSE_TIMEOUT_S = 5.0
INGEST_SLICE_S = 0.005  # the event loop runs at least this often while entries are applied


class Sink(Protocol):
    """What the consumer feeds (the router). Optionally ``load_snapshot(snap, now)``: if present
    it is called (after ``reset_engine``) instead of applying the snapshot's chains one by one."""

    def apply(self, env: Envelope, now: float) -> None: ...

    def reset_engine(self, engine_id: str, now: float) -> None: ...


@dataclass(slots=True)
class ConsumerStats:
    """Counters a router exports as metrics; ``lag_s`` is the worst per-engine lag."""

    entries: int = 0
    events: int = 0
    blocks: int = 0  # blocks announced by applied BlockStored events
    malformed: int = 0
    duplicates: int = 0
    stale: int = 0
    resyncs: int = 0
    snapshots_loaded: int = 0
    new_epochs: int = 0
    epochs_reclaimed: int = 0  # retired epochs taken back from a silent current one
    reconnects: int = 0
    sink_errors: int = 0
    loop_errors: int = 0  # unexpected errors of a whole round (logged; retried with backoff)
    malformed_by_engine: dict[str, int] = field(default_factory=dict)
    lag_by_engine: dict[str, float] = field(default_factory=dict)

    @property
    def lag_s(self) -> float:
        """Seconds between an event's engine timestamp and its application (latest, worst)."""
        return max(self.lag_by_engine.values(), default=0.0)


class Consumer:
    """Follows every registered engine's stream and folds it into ``sink``."""

    def __init__(
        self,
        broker: Broker,
        sink: Sink,
        *,
        count: int = 1000,
        block_ms: int = 200,
        discover_interval_s: float = 1.0,
        snapshot_poll_s: float = 0.1,
        snapshot_request_s: float = 1.0,
        quarantine_s: float = 30.0,
        backoff_s: tuple[float, float] = (0.05, 2.0),
        catch_up_timeout_s: float = 10.0,
        epoch_reclaim_s: float = RECLAIM_AFTER_MS / 1000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.broker = broker
        self.sink = sink
        self.count = count
        self.block_ms = block_ms
        self.discover_interval_s = discover_interval_s
        self.snapshot_poll_s = snapshot_poll_s
        self.snapshot_request_s = snapshot_request_s
        self.quarantine_s = quarantine_s
        self.catch_up_timeout_s = catch_up_timeout_s
        self.epoch_reclaim_s = epoch_reclaim_s
        self.caught_up = False
        self._discovered = False
        self._catch_up_deadline: float | None = None  # set by the first round
        self._backoff = backoff_s
        self._clock = clock
        self.stats = ConsumerStats()
        self.cursors: dict[str, Cursor] = {}
        self._live: set[str] = set()
        self._quarantined: dict[str, float] = {}
        self._next_discover = 0.0
        self._next_snapshot_poll = 0.0
        self._next_snapshot_request: dict[str, float] = {}
        self._bad_snapshots: dict[str, int] = {}  # engine -> hash of its bad snapshot
        self._task: asyncio.Task | None = None
        self._closing = False
        self._down = False
        # when the broker last answered one of its reads (monotonic; None: not yet): proof it
        # is up that a health ping timing out on a busy event loop does not outweigh
        self.answered_at: float | None = None
        # when a round (discovery, snapshots, one read of every stream) last completed, and when
        # the consumer started (monotonic): a consumer whose rounds all fail (a broker error
        # that is not an outage) is connected yet reads nothing; health checks look at this
        self.round_at: float | None = None
        self.started_at: float | None = None
        self._log_once = LogOnce(log)
        self._load_snapshot = getattr(sink, "load_snapshot", None)

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start following streams in the background (a broker that is down is waited for)."""
        if self._task is None:
            self.started_at = time.monotonic()
            self._task = asyncio.create_task(self._run(), name="kvgate-consumer")

    async def close(self, *, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop following streams; bounded even while the broker is down or restarting."""
        self._closing = True
        if self._task is not None:
            task, self._task = self._task, None
            await stop_tasks([task], timeout_s, what="consumer")

    @property
    def connected(self) -> bool:
        return not self._down

    def stalled_s(self, bound_s: float) -> float | None:
        """Seconds since the last completed round (or since start, before the first) when that
        is over ``bound_s``, else None: reads that keep failing, whatever the reason."""
        last = self.round_at if self.round_at is not None else self.started_at
        if last is None:
            return None
        idle = time.monotonic() - last
        return idle if idle > bound_s else None

    def engines_in(self, state: State) -> list[str]:
        return sorted(e for e, c in self.cursors.items() if c.state is state)

    async def _run(self) -> None:
        delay = self._backoff[0]
        while not self._closing:
            try:
                await self.poll_once(self.block_ms)
            except BrokerUnavailable as exc:
                if not self._down:
                    self._down = True
                    log.warning("consumer: broker unavailable (%s); retrying", exc)
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, self._backoff[1])
                continue
            except BrokerError as exc:
                self._log_once.warning("broker-error", "consumer: broker error: %s", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._backoff[1])
                continue
            except Exception:  # never let a bug stop the router's event feed
                self.stats.loop_errors += 1
                log.exception("consumer: unexpected error (retrying in %.2f s)", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._backoff[1])  # (not a tight loop of the same error)
                continue
            if self._down:
                self._down = False
                self.stats.reconnects += 1
                log.info("consumer: broker reachable again; continuing from stored positions")
            delay = self._backoff[0]

    # ----------------------------------------------------------------- one round

    async def poll_once(self, block_ms: int | None = None) -> int:
        """Discover engines and load snapshots when due, then read and apply one round of
        entries (waiting up to ``block_ms`` for some). Returns the number of entries read."""
        now = time.monotonic()
        if self._catch_up_deadline is None:
            self._catch_up_deadline = now + self.catch_up_timeout_s
        deadline = self._catch_up_deadline
        if now >= self._next_discover:
            await self.discover()
            self._next_discover = now + self.discover_interval_s
        if now >= self._next_snapshot_poll:
            await self._load_pending_snapshots()
            self._next_snapshot_poll = now + self.snapshot_poll_s
        positions = {
            e: c.position
            for e, c in self.cursors.items()
            if c.state is State.ACTIVE and e in self._live and e not in self._quarantined
        }
        pending = not self.caught_up and self._pending_engines()
        if not self.caught_up and self._discovered:
            if not pending and not positions:
                self._set_caught_up()  # no engine to replay
            elif pending and now >= deadline:
                self._set_caught_up()  # snapshots that do not come do not hold it back
        if not positions:
            wait = min((block_ms or 0) / 1000, max(0.0, self._next_discover - time.monotonic()))
            if any(c.state is not State.ACTIVE for c in self.cursors.values()):
                wait = min(wait, self.snapshot_poll_s)
            await asyncio.sleep(wait)
            self.round_at = time.monotonic()
            return 0
        try:
            result = await self.broker.read(positions, count=self.count, block_ms=block_ms)
        except BadStream as exc:
            self._quarantine(exc.engine_ids)
            self.round_at = time.monotonic()
            return 0
        except BadPosition as exc:
            self._restart(exc.engine_ids, positions)
            self.round_at = time.monotonic()
            return 0
        self.answered_at = time.monotonic()
        entries = 0
        gaps = False
        full = False
        for engine_id, batch in result:
            entries += len(batch)
            full |= len(batch) >= self.count
            gaps |= await self._ingest(engine_id, batch)
        if gaps:
            await self._load_pending_snapshots()
        if not self.caught_up:
            if not pending and not full and not gaps:
                self._set_caught_up()  # this read reached the end of every stream
            elif time.monotonic() >= deadline:
                self._set_caught_up()
        self.round_at = time.monotonic()
        return entries

    def _pending_engines(self) -> list[str]:
        """Live engines whose snapshot is not loaded yet (nothing to read for them)."""
        return sorted(
            e
            for e, c in self.cursors.items()
            if c.state is not State.ACTIVE and e in self._live and e not in self._quarantined
        )

    def _set_caught_up(self) -> None:
        self.caught_up = True
        pending = self._pending_engines()
        if pending:
            log.warning(
                "consumer: caught up after %.0f s without the snapshots of %s",
                self.catch_up_timeout_s,
                ", ".join(pending),
            )
        else:
            log.info(
                "consumer: caught up with %d engine streams (%d entries replayed)",
                len(self.cursors),
                self.stats.entries,
            )

    async def discover(self) -> None:
        """Refresh the set of live engines and start following new ones."""
        self._live = set(await self.broker.engines())
        self._discovered = True
        now = self.answered_at = time.monotonic()
        for engine_id, until in list(self._quarantined.items()):
            if now >= until:
                del self._quarantined[engine_id]
        for engine_id in self._live:
            if engine_id not in self.cursors:
                self.cursors[engine_id] = Cursor(
                    engine_id, reclaim_after_ms=int(self.epoch_reclaim_s * 1000)
                )
        await self._load_pending_snapshots()

    def _quarantine(self, engine_ids: tuple[str, ...]) -> None:
        until = time.monotonic() + self.quarantine_s
        for engine_id in engine_ids:
            self._quarantined[engine_id] = until
            self._count_malformed(engine_id, "its stream key holds another Redis type")

    def _restart(self, engine_ids: tuple[str, ...], positions: dict[str, str]) -> None:
        """The broker refused these streams' positions: each is counted, its engine reset and
        its cursor started over from a snapshot, so the other streams keep being read."""
        now = self._clock()
        for engine_id in engine_ids:
            cursor = self.cursors.get(engine_id)
            if cursor is None:
                continue
            self._count_malformed(
                engine_id, f"the broker refused position {positions.get(engine_id)!r}"
            )
            self.stats.resyncs += 1
            self._reset(engine_id, now)
            cursor.restart()

    # ----------------------------------------------------------------- snapshots

    async def _load_pending_snapshots(self) -> None:
        for engine_id, cursor in list(self.cursors.items()):
            if cursor.state is State.ACTIVE or engine_id not in self._live:
                continue
            snap = await self._fetch_snapshot(engine_id)
            if snap is not None and cursor.covered_by(snap):
                self._apply_snapshot(cursor, snap)
            elif cursor.state is State.NEW and snap is None:
                cursor.start_without_snapshot()
            else:
                await self._ask_for_snapshot(engine_id)

    async def _fetch_snapshot(self, engine_id: str) -> Snapshot | None:
        data = await self.broker.get_snapshot(engine_id)
        if data is None:
            return None
        data = bytes(data)
        try:
            snap = decode_snapshot(data)
            if snap.engine_id != engine_id:
                raise CodecError(f"snapshot of engine {snap.engine_id!r} under {engine_id!r}")
            parse_id(snap.stream_id)  # strict: a position Redis refuses would fail every read
        except (CodecError, ValueError) as exc:
            # polled again until replaced: the same bad snapshot is counted once
            key = hash(data)
            if self._bad_snapshots.get(engine_id) != key:
                self._bad_snapshots[engine_id] = key
                self._count_malformed(engine_id, f"bad snapshot: {exc}")
            return None
        self._bad_snapshots.pop(engine_id, None)
        return snap

    async def _ask_for_snapshot(self, engine_id: str) -> None:
        now = time.monotonic()
        if now >= self._next_snapshot_request.get(engine_id, 0.0):
            self._next_snapshot_request[engine_id] = now + self.snapshot_request_s
            await self.broker.request_snapshot(engine_id)

    def _apply_snapshot(self, cursor: Cursor, snap: Snapshot) -> None:
        now = self._clock()
        engine_id = cursor.engine_id
        self._reset(engine_id, now)
        try:
            if self._load_snapshot is not None:
                self._load_snapshot(snap, now)
            else:
                seq = max(snap.seq, 0)
                for chain in snap.blocks:
                    self.sink.apply(Envelope(engine_id, snap.epoch, seq, now, chain), now)
                if snap.heartbeat is not None:
                    self.sink.apply(Envelope(engine_id, snap.epoch, seq, now, snap.heartbeat), now)
        except Exception as exc:
            self._sink_failed(engine_id, exc)
        cursor.load(snap)
        self._next_snapshot_request.pop(engine_id, None)
        self.stats.snapshots_loaded += 1

    # ----------------------------------------------------------------- entries

    async def _ingest(self, engine_id: str, batch: list) -> bool:
        """Apply one engine's entries in order; True if a gap stopped it (snapshot needed).
        Every ``INGEST_SLICE_S`` of work it lets the event loop run (routing decisions wait
        on it: a read of heavy entries took it for seconds)."""
        cursor = self.cursors.get(engine_id)
        if cursor is None or cursor.state is not State.ACTIVE:
            return False
        stats = self.stats
        now = self._clock()
        slice_end = time.perf_counter() + INGEST_SLICE_S
        for entry_id, fields in batch:
            if time.perf_counter() > slice_end:
                await asyncio.sleep(0)
                slice_end = time.perf_counter() + INGEST_SLICE_S
                now = self._clock()
            stats.entries += 1
            try:
                envs = decode_batch(fields)
                if envs[0].engine_id != engine_id:
                    raise CodecError(f"entry of engine {envs[0].engine_id!r} on this stream")
            except CodecError as exc:
                self._count_malformed(engine_id, f"entry {entry_id}: {exc}")
                cursor.position = entry_id
                continue
            verdict, skip = cursor.classify(envs, entry_id)
            if verdict is Verdict.DUPLICATE:
                stats.duplicates += len(envs)
                cursor.position = entry_id
                continue
            if verdict is Verdict.STALE:
                stats.stale += len(envs)
                cursor.position = entry_id
                self._log_once.warning(
                    f"stale:{engine_id}",
                    "consumer: skipping entries of engine %s's retired epoch %s (a zombie "
                    "publisher, unless its current epoch %s is not the engine's: that is taken "
                    "back from it after %.0f s of silence)",
                    engine_id,
                    envs[0].epoch,
                    cursor.epoch,
                    cursor.reclaim_after_ms / 1000,
                )
                continue
            if verdict is Verdict.RECLAIM:
                stats.resyncs += 1
                stats.epochs_reclaimed += 1
                log.warning(
                    "consumer: engine %s's retired epoch %s still publishes (at %s) while its "
                    "current epoch %s has been silent for %.0f s: taking it back, resyncing "
                    "from its snapshot",
                    engine_id,
                    envs[0].epoch,
                    entry_id,
                    cursor.epoch,
                    cursor.reclaim_after_ms / 1000,
                )
                cursor.reclaim(entry_id, envs[0])
                self._reset(engine_id, now)
                return True
            if verdict is Verdict.GAP:
                stats.resyncs += 1
                gap = cursor.open_gap(entry_id, envs[0])
                log.info(
                    "consumer: engine %s gap at %s (epoch %s, seq %d); resyncing from snapshot",
                    engine_id,
                    entry_id,
                    gap.epoch,
                    gap.seq + 1,
                )
                self._reset(engine_id, now)
                return True
            if verdict is Verdict.NEW_EPOCH:
                stats.new_epochs += 1
                self._reset(engine_id, now)
            elif skip:
                stats.duplicates += skip
            self._apply(engine_id, envs, skip, now)
            cursor.advance(entry_id, envs[-1])
        return False

    def _apply(self, engine_id: str, envs: list[Envelope], skip: int, now: float) -> None:
        stats = self.stats
        apply = self.sink.apply
        for i in range(skip, len(envs)):
            env = envs[i]
            ev = env.event
            kind = type(ev)
            if kind is BlockStored:
                stats.blocks += len(ev.hashes)
            elif kind is AllCleared:
                self._reset(engine_id, now)
            try:
                apply(env, now)
            except Exception as exc:
                self._sink_failed(engine_id, exc)
        stats.events += len(envs) - skip
        stats.lag_by_engine[engine_id] = max(0.0, now - envs[-1].ts)

    def _reset(self, engine_id: str, now: float) -> None:
        try:
            self.sink.reset_engine(engine_id, now)
        except Exception as exc:
            self._sink_failed(engine_id, exc)

    def _sink_failed(self, engine_id: str, exc: Exception) -> None:
        self.stats.sink_errors += 1
        self._log_once.warning(
            f"sink:{engine_id}", "consumer: sink failed on engine %s: %r", engine_id, exc
        )

    def _count_malformed(self, engine_id: str, why: str) -> None:
        self.stats.malformed += 1
        by = self.stats.malformed_by_engine
        by[engine_id] = by.get(engine_id, 0) + 1
        self._log_once.warning(
            f"malformed:{engine_id}",
            "consumer: skipping malformed data of engine %s: %s",
            engine_id,
            why,
        )
