"""The reporter an engine embeds: the I/O shell around :class:`ReportBuilder`.

``emit(event)`` is synchronous, O(1), never blocks and never raises: it numbers the event and
buffers it. A background task flushes the buffer every few milliseconds (sooner when it fills),
as pipelined ``XADD``s of batched entries, refreshes the engine's registry entry, and publishes
snapshots:

* at start (an empty cache valid from the stream's current end);
* after anything that may have lost events (buffer overflow, a failed publish, a reconnect),
  *before* the next batch, so a consumer that sees the gap finds a snapshot that covers it;
* when a consumer asks for one, or the broker lost it (Redis restarted without persistence);
* periodically: every ``snapshot_interval_s`` if the stream moved, and every ``maxlen // 2``
  entries, so trimming never outruns the latest snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from broker.base import Broker, BrokerError
from broker.codec import encode_batch, encode_snapshot
from broker.events import Event
from engine_reporter.builder import ReportBuilder
from kvgate.aio import stop_tasks
from kvgate.logs import LogOnce

log = logging.getLogger("kvgate.reporter")

# After close()'s flush, the task gets this long to end once cancelled (see kvgate.aio).
STOP_TIMEOUT_S = 2.0


def new_epoch() -> str:
    """A fresh epoch id: time-ordered hex plus randomness, unique per engine start."""
    return f"{time.time_ns():x}-{os.urandom(4).hex()}"


@dataclass(slots=True)
class ReporterStats:
    """Counters for the engine's metrics endpoint."""

    emitted: int = 0
    published: int = 0
    entries: int = 0
    invalid: int = 0
    publish_errors: int = 0
    snapshots: int = 0
    reconnects: int = 0


class Reporter:
    """Publishes an engine's events to its stream; see the module docstring for the protocol."""

    def __init__(
        self,
        broker: Broker,
        engine_id: str,
        *,
        epoch: str | None = None,
        buffer_size: int = 65536,
        entry_events: int = 256,
        flush_interval_s: float = 0.005,
        max_flush_events: int = 16384,
        maxlen: int = 10_000,
        snapshot_interval_s: float = 30.0,
        registry_ttl_s: float = 10.0,
        backoff_s: tuple[float, float] = (0.05, 2.0),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.broker = broker
        self.engine_id = engine_id
        self.epoch = epoch or new_epoch()
        self._builder = ReportBuilder(engine_id, self.epoch, capacity=buffer_size)
        self.entry_events = max(1, entry_events)
        self.flush_interval_s = flush_interval_s
        self.max_flush_events = max(self.entry_events, max_flush_events)
        self.maxlen = maxlen
        self.snapshot_interval_s = snapshot_interval_s
        self.registry_ttl_s = registry_ttl_s
        self._backoff = backoff_s
        self._clock = clock
        self.stats = ReporterStats()
        self._wake_at = max(1, min(buffer_size // 2, self.max_flush_events // 4))
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.get_ident()
        self._closing = False
        self._down = False
        self._last_id: str | None = None  # newest entry we know reached the stream
        self._snapshot_due = True
        self._entries_since_snapshot = 0
        self._last_snapshot_at = 0.0
        self._next_register_at = 0.0
        self._log_once = LogOnce(log)

    # ----------------------------------------------------------------- engine side

    def emit(self, event: Event) -> None:
        """Queue one event for publishing. Never blocks, never raises (bad input is counted)."""
        try:
            self._builder.emit(event, self._clock())
        except Exception as exc:
            self.stats.invalid += 1
            self._log_once.warning(
                "invalid", "reporter %s: dropping invalid event: %s", self.engine_id, exc
            )
            return
        self.stats.emitted += 1
        if self._builder.pending >= self._wake_at:
            if threading.get_ident() == self._thread:
                self._wake.set()
            elif self._loop is not None:
                self._loop.call_soon_threadsafe(self._wake.set)

    def emit_threadsafe(self, event: Event) -> None:
        """``emit`` from a thread other than the event loop's (e.g. an engine's worker thread)."""
        if self._loop is None or threading.get_ident() == self._thread:
            self.emit(event)
        else:
            self._loop.call_soon_threadsafe(self.emit, event)

    @property
    def dropped(self) -> int:
        """Events that never reached the stream (full buffer, failed publish)."""
        return self._builder.dropped

    @property
    def pending(self) -> int:
        return self._builder.pending

    @property
    def builder(self) -> ReportBuilder:
        return self._builder

    @property
    def connected(self) -> bool:
        return not self._down

    # ----------------------------------------------------------------- lifecycle

    async def start(self, *, timeout_s: float = 2.0) -> None:
        """Register and publish the initial snapshot (trying for up to ``timeout_s``; with the
        broker down the engine starts anyway and the background task keeps trying), then start
        flushing."""
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        try:
            async with asyncio.timeout(timeout_s):
                await self._cycle()
        except (BrokerError, TimeoutError) as exc:
            self._went_down(exc)
        self._task = asyncio.create_task(self._run(), name=f"reporter:{self.engine_id}")

    async def flush(self, *, timeout_s: float = 5.0) -> bool:
        """Wait until everything emitted so far was handed to the broker (or dropped)."""
        deadline = time.monotonic() + timeout_s
        while (self._builder.pending or self._snapshot_due) and time.monotonic() < deadline:
            self._wake.set()
            await asyncio.sleep(self.flush_interval_s / 2 or 0.001)
        return not self._builder.pending

    async def close(self, *, unregister: bool = True, timeout_s: float = 5.0) -> None:
        """Flush what is buffered (for up to ``timeout_s``), stop, and leave the registry.
        Bounded even while the broker is down or restarting."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=timeout_s)  # the task ends by itself
            await stop_tasks([self._task], STOP_TIMEOUT_S, what=f"reporter {self.engine_id}")
        if unregister and not self._down:
            with contextlib.suppress(BrokerError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await self.broker.unregister(self.engine_id)

    # ----------------------------------------------------------------- background task

    async def _run(self) -> None:
        delay = self._backoff[0]
        while True:
            if not self._closing and self._builder.pending < self._wake_at:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow the
                # cancel() that stops this task (kvgate.aio).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.flush_interval_s):
                        await self._wake.wait()
            self._wake.clear()
            try:
                await self._cycle()
            except BrokerError as exc:
                self._went_down(exc)
                if self._closing:
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._backoff[1])
                continue
            except Exception:  # a bug must not silently end publishing: log and carry on
                log.exception("reporter %s: flush failed", self.engine_id)
                self._snapshot_due = True
                if self._closing:
                    return
                await asyncio.sleep(delay)
                continue
            if self._down:
                self._down = False
                self.stats.reconnects += 1
                log.info("reporter %s: broker reachable again", self.engine_id)
            delay = self._backoff[0]
            if self._closing and not self._builder.pending and not self._snapshot_due:
                return

    def _went_down(self, exc: BaseException) -> None:
        self.stats.publish_errors += 1
        self._snapshot_due = True  # whatever happens next, consumers must be able to resync
        if not self._down:
            self._down = True
            self._next_register_at = 0.0  # re-register as soon as it answers (it may be empty)
            log.warning("reporter %s: broker unavailable (%s); buffering", self.engine_id, exc)

    async def _cycle(self) -> None:
        """One round: registry refresh when due, a snapshot when due, then one batch."""
        now = time.monotonic()
        if now >= self._next_register_at:
            wanted = await self.broker.register(self.engine_id, self.registry_ttl_s)
            self._next_register_at = now + min(1.0, self.registry_ttl_s / 3)
            self._snapshot_due |= wanted
        if self._snapshot_due:
            await self._publish_snapshot()
        batch = self._builder.take(self.max_flush_events)
        if batch:
            step = self.entry_events
            entries = [encode_batch(batch[i : i + step]) for i in range(0, len(batch), step)]
            try:
                ids = await self.broker.append(self.engine_id, entries, maxlen=self.maxlen)
            except BaseException:
                self._builder.publish_failed(batch)
                self._snapshot_due = True
                raise
            self._last_id = ids[-1]
            self._entries_since_snapshot += len(ids)
            self.stats.entries += len(ids)
            self.stats.published += len(batch)
        if self._periodic_snapshot_due(time.monotonic()):
            await self._publish_snapshot()

    def _periodic_snapshot_due(self, now: float) -> bool:
        if self.maxlen and self._entries_since_snapshot >= max(1, self.maxlen // 2):
            return True
        moved = self._entries_since_snapshot > 0
        return moved and now - self._last_snapshot_at >= self.snapshot_interval_s

    async def _publish_snapshot(self) -> None:
        if self._last_id is None:
            self._last_id = await self.broker.last_id(self.engine_id)
        snap = self._builder.snapshot(self._last_id)
        await self.broker.put_snapshot(self.engine_id, encode_snapshot(snap))
        self._snapshot_due = False
        self._entries_since_snapshot = 0
        self._last_snapshot_at = time.monotonic()
        self.stats.snapshots += 1
