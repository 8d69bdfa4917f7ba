"""Opt-in busy polling (``kvgate gateway --busy-poll``): keep the event loop awake, polling the
sockets with a zero timeout instead of sleeping in epoll, while any request is open.

Why: a proxy that sleeps between two packets of one request pays a wake-up at each hop, and on
virtual machines (and CPUs with deep idle states) a wake-up is slow: the idle vCPU is handed
back to the hypervisor and must be scheduled again. Measured on the 2-vCPU benchmark VM
(``bench/bench_gateway.py``, streams of 8 events 1 ms apart): the latency kvgate adds to a
streamed answer went from +0.55-0.72 ms to +0.08-0.15 ms (p50, against going direct).
HAProxy's ``busy-polling`` makes the same trade. The cost: while a request is open, the worker's
core runs at 100% (one core per worker at low load; at high load the loop is busy anyway).
Nothing spins while no request is open.
"""

from __future__ import annotations

import asyncio


class BusyPoll:
    """Counts open requests; while there is one, a task yields to the loop at every turn (a
    ready task makes the loop poll without blocking)."""

    __slots__ = ("_open", "_task", "turns")

    def __init__(self) -> None:
        self._open = 0
        self._task: asyncio.Task[None] | None = None
        self.turns = 0  # loop turns spent polling (tests and curiosity)

    @property
    def spinning(self) -> bool:
        return self._task is not None

    def enter(self) -> None:
        """A request opened (call from the event loop)."""
        self._open += 1
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._spin())

    def leave(self) -> None:
        """A request closed; the spinning stops at the loop's next turn if it was the last."""
        self._open -= 1

    async def _spin(self) -> None:
        try:
            while self._open > 0:
                self.turns += 1
                await asyncio.sleep(0)
        finally:
            self._task = None

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
