"""The reporter for an engine whose loop is synchronous (e.g. vLLM's engine core, which runs
kvgate's scheduler plug-in): a :class:`Reporter` on a thread and event loop of its own, fed
through a hand-off that never blocks and never raises.

The engine thread calls :meth:`ThreadedReporter.submit` (ready events), :meth:`submit_raw`
(engine-native batches that the reporter's thread turns into events with ``translate``, e.g.
vLLM's KV batches, so the translation costs the engine nothing) and :meth:`heartbeat` (its
latest load: published when it changed, and repeated every ``heartbeat_repeat_s`` while the
engine sits idle and reports nothing). Each is an append to a deque.

Broker outages are the :class:`Reporter`'s business: its bounded buffer drops the oldest events
(counted), and once the broker answers again it publishes a snapshot before the next batch, so
consumers resync; nothing here waits for the broker. If the hand-off itself overflows (the
reporter thread starved for ``max_batches`` submissions), what it refused and what it held are
dropped and counted, and the thread starts over (``on_lost``, then an AllCleared): the router
forgets this engine's cached blocks rather than believe a wrong set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

from broker.base import Broker
from broker.events import AllCleared, Event, LoadHeartbeat
from engine_reporter.reporter import Reporter
from kvgate.logs import LogOnce

log = logging.getLogger("kvgate.reporter")

Translate = Callable[[Any], Iterable[Event]]


@dataclass(slots=True)
class HandoffStats:
    """What the hand-off saw (the Reporter's own counters are in ``reporter_stats``)."""

    submitted: int = 0  # events and raw batches handed over by the engine
    dropped: int = 0  # handed over while the hand-off was full: never published
    discarded: int = 0  # still in the hand-off when it overflowed: thrown away with the epoch
    losses: int = 0  # overflows (each starts over with an AllCleared)
    translate_errors: int = 0  # raw batches ``translate`` failed on (skipped)
    heartbeats: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class ThreadedReporter:
    """A :class:`Reporter` on its own thread; see the module docstring."""

    def __init__(
        self,
        broker_factory: Callable[[], Broker],
        engine_id: str,
        *,
        translate: Translate | None = None,
        on_lost: Callable[[], None] | None = None,
        max_batches: int = 100_000,
        poll_s: float = 0.01,
        heartbeat_repeat_s: float = 1.0,
        reporter_options: dict[str, Any] | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.stats = HandoffStats()
        self._broker_factory = broker_factory
        self._translate = translate
        self._on_lost = on_lost
        self._max_batches = max(1, max_batches)
        self._poll_s = poll_s
        self._heartbeat_repeat_s = heartbeat_repeat_s
        self._reporter_options = reporter_options or {}
        self._queue: deque[tuple[bool, Any]] = deque()  # (raw?, events or raw batch)
        self._lost = False
        self._hb: LoadHeartbeat | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log_once = LogOnce(log)
        self.reporter: Reporter | None = None  # set on the reporter's thread once it runs

    # ----------------------------------------------------------------- engine thread

    def submit(self, events: list[Event]) -> None:
        """Hand over events to publish, in order. Never blocks, never raises."""
        if events:
            self._put(False, events, len(events))

    def submit_raw(self, batch: Any) -> None:
        """Hand over an engine-native batch for ``translate``. Never blocks, never raises."""
        self._put(True, batch, 1)

    def heartbeat(self, hb: LoadHeartbeat) -> None:
        """The engine's load now (the newest replaces any not yet published)."""
        self._hb = hb

    def _put(self, raw: bool, item: Any, n: int) -> None:
        self.stats.submitted += n
        if len(self._queue) >= self._max_batches:
            self.stats.dropped += n
            self._lost = True
            return
        self._queue.append((raw, item))

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._main, name=f"kvgate-reporter:{self.engine_id}", daemon=True
            )
            self._thread.start()

    def close(self, timeout_s: float = 3.0) -> None:
        """Publish what is handed over (for up to ``timeout_s``) and stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def counters(self) -> dict[str, int]:
        """Hand-off and reporter counters together (for logs and tests)."""
        out = self.stats.as_dict()
        rep = self.reporter
        if rep is not None:
            out.update({f"reporter_{k}": v for k, v in _fields(rep.stats).items()})
            out["reporter_dropped"] = rep.dropped
            out["reporter_pending"] = rep.pending
            out["broker_connected"] = int(rep.connected)
        return out

    # ----------------------------------------------------------------- reporter thread

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except Exception:  # the engine must keep serving whatever happens here
            log.exception("reporter %s: stopped", self.engine_id)

    async def _run(self) -> None:
        broker = self._broker_factory()
        reporter = Reporter(broker, self.engine_id, **self._reporter_options)
        self.reporter = reporter
        await reporter.start()
        last_hb: LoadHeartbeat | None = None
        last_hb_at = -1e18
        while True:
            stopping = self._stop.is_set()
            self._drain(reporter)
            hb = self._hb
            now = time.monotonic()
            due = now - last_hb_at >= self._heartbeat_repeat_s
            if hb is not None and (hb is not last_hb or due):
                reporter.emit(hb)
                self.stats.heartbeats += 1
                last_hb, last_hb_at = hb, now
            if stopping:
                break
            await asyncio.sleep(self._poll_s)
        with contextlib.suppress(Exception):
            await reporter.close(timeout_s=2.0)
        with contextlib.suppress(Exception):
            await broker.close()

    def _drain(self, reporter: Reporter) -> None:
        queue = self._queue
        if self._lost:
            self._lost = False
            for _ in range(len(queue)):  # the backlog from before the loss (only we pop)
                raw, item = queue.popleft()
                self.stats.discarded += 1 if raw else len(item)
            self.stats.losses += 1
            log.warning(
                "reporter %s: hand-off overflowed (%d events dropped, %d discarded in all): "
                "the router forgets this engine's cache",
                self.engine_id,
                self.stats.dropped,
                self.stats.discarded,
            )
            if self._on_lost is not None:
                with contextlib.suppress(Exception):
                    self._on_lost()
            reporter.emit(AllCleared())
        while queue:
            raw, item = queue.popleft()
            if not raw:
                for ev in item:
                    reporter.emit(ev)
                continue
            try:
                events = list(self._translate(item)) if self._translate is not None else []
            except Exception as exc:
                self.stats.translate_errors += 1
                self._log_once.warning(
                    "translate", "reporter %s: skipping a batch: %r", self.engine_id, exc
                )
                continue
            for ev in events:
                reporter.emit(ev)


def _fields(obj: Any) -> dict[str, int]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}
