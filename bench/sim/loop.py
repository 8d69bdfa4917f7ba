"""The simulator's clock: a heap of ``(time, priority, seq, payload)`` and a dispatch table.

Events at the same virtual time run in a fixed, documented order (their kind's priority, see
:class:`Kind`), and events of the same time and kind run in the order they were scheduled
(``seq``, a counter of this loop, never shared between loops). So a run is a pure function of its
inputs: no tie ever falls through to comparing payloads, and no wall clock is read.

Pure: no asyncio, no time, no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from enum import IntEnum
from typing import Any

Handler = Callable[[Any, float], None]


class Kind(IntEnum):
    """Event kinds; the value is the priority among events at the same time (lower first).

    An engine's step ends before anything else at that instant (its outputs and events exist
    before anyone could observe them); its events reach the router next; then heartbeats; then
    new client requests are routed (seeing everything that happened at that instant); then
    routed requests reach their engines; then bookkeeping ticks.
    """

    ENGINE_WAKE = 0
    DELIVER = 1
    HEARTBEAT = 2
    ARRIVAL = 3
    SUBMIT = 4
    TICK = 5
    TRANSFER = 6  # a prompt's KV reaches its decode engine (prefill/decode disaggregation)
    OUTAGE = 7  # an engine goes down (its process dies) or comes back cold (restarted)
    PROBE = 8  # the gateway's health probes of every engine


class SimulationError(RuntimeError):
    """The simulation broke an invariant (time went backwards, no handler for a kind)."""


class EventLoop:
    """A discrete-event loop on a virtual clock (seconds)."""

    __slots__ = ("_handlers", "_heap", "_seq", "now", "processed")

    def __init__(self, start: float = 0.0) -> None:
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._handlers: list[Handler | None] = [None] * len(Kind)
        self.now = start
        self.processed = 0

    def on(self, kind: Kind, handler: Handler) -> None:
        """Register the one handler of ``kind``: ``handler(payload, now)``."""
        self._handlers[kind] = handler

    def schedule(self, time: float, kind: Kind, payload: Any = None) -> None:
        """Run ``kind``'s handler with ``payload`` at virtual ``time`` (not before now)."""
        if time < self.now:
            raise SimulationError(f"cannot schedule {kind.name} at {time} before now={self.now}")
        self._seq += 1
        heapq.heappush(self._heap, (time, kind, self._seq, payload))

    def __len__(self) -> int:
        return len(self._heap)

    def peek_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def run(self, until: float | None = None, max_events: int | None = None) -> int:
        """Process events in order until the heap is empty, the next event is after ``until``,
        or ``max_events`` were processed; returns how many ran."""
        heap = self._heap
        handlers = self._handlers
        pop = heapq.heappop
        limit = float("inf") if until is None else until
        budget = -1 if max_events is None else max_events
        ran = 0
        while heap and heap[0][0] <= limit and ran != budget:
            time, kind, _, payload = pop(heap)
            self.now = time
            handler = handlers[kind]
            if handler is None:
                raise SimulationError(f"no handler for {Kind(kind).name}")
            handler(payload, time)
            ran += 1
        self.processed += ran
        if until is not None and heap and heap[0][0] > until and until > self.now:
            self.now = until  # stopped by the bound: the clock stands at it
        return ran
