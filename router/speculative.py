"""The router's own speculative and approximate cache entries: keys it routed, counted as
cached on their engine until they expire (see :mod:`router.cluster` for the TTLs and why), and
the expiry queue they are kept in."""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable

from router.keytree import KeyNode, KeyTree

MAX_LANES = 8  # distinct durations given a lane; more go to the heap


class _ExpiryQueue:
    """``(expiry, handle)`` records, earliest first. Every record comes with its duration
    (expiry = now + duration) and the router's durations are a few constants with a clock that
    never goes back, so the records of one duration arrive in expiry order: each duration is a
    FIFO lane, pushed and popped in O(1), where a heap paid ~26 tuple comparisons per record at
    the benchmark's ~10,000 records. A record that would break its lane's order (a clock that
    went back) goes to a heap. Equal expiries pop by handle."""

    __slots__ = ("_heap", "_lanes", "_order", "_size")

    def __init__(self) -> None:
        self._lanes: dict[float, deque[tuple[float, int]]] = {}  # duration -> its lane
        self._order: list[deque[tuple[float, int]]] = []  # the lanes, for a typed scan
        self._heap: list[tuple[float, int]] = []
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, expires: float, handle: int, duration: float) -> None:
        lane = self._lanes.get(duration)
        if lane is None and len(self._lanes) < MAX_LANES:
            lane = self._lanes[duration] = deque()
            self._order.append(lane)
        if lane is None or (lane and lane[-1][0] > expires):
            heapq.heappush(self._heap, (expires, handle))
        else:
            lane.append((expires, handle))
        self._size += 1

    def _first(self) -> deque[tuple[float, int]] | None:
        """The lane holding the earliest record (None: the heap does, or nothing is held);
        compares the expiries as floats, the handles only on a tie."""
        best: deque[tuple[float, int]] | None = None
        best_t = math.inf
        best_h = 0
        for lane in self._order:
            if lane:
                t, h = lane[0]
                if best is None or t < best_t or (t == best_t and h < best_h):
                    best, best_t, best_h = lane, t, h
        heap = self._heap
        if heap:
            t, h = heap[0]
            if best is None or t < best_t or (t == best_t and h < best_h):
                return None
        return best

    def first_expiry(self) -> float:
        """The earliest expiry held (infinity when empty)."""
        if not self._size:
            return math.inf
        lane = self._first()
        return lane[0][0] if lane is not None else self._heap[0][0]

    def pop_due(self, now: float) -> tuple[float, int] | None:
        """Remove and return the earliest record if it expires at or before ``now`` (one scan
        of the lanes, not one to look and one to pop)."""
        if not self._size:
            return None
        lane = self._first()
        if lane is not None:
            if lane[0][0] > now:
                return None
            self._size -= 1
            return lane.popleft()
        if self._heap[0][0] > now:
            return None
        self._size -= 1
        return heapq.heappop(self._heap)

    def pop(self) -> tuple[float, int]:
        """Remove and return the earliest record (the queue must not be empty)."""
        record = self.pop_due(math.inf)
        if record is None:
            raise IndexError("pop from an empty expiry queue")
        return record

    def keep(self, wanted: Callable[[float, int], bool]) -> None:
        """Drop every record for which ``wanted(expiry, handle)`` is false."""
        for duration, lane in list(self._lanes.items()):
            self._lanes[duration] = deque(r for r in lane if wanted(r[0], r[1]))
        self._order = list(self._lanes.values())
        self._heap = [r for r in self._heap if wanted(r[0], r[1])]
        heapq.heapify(self._heap)
        self._size = len(self._heap) + sum(len(lane) for lane in self._lanes.values())


class Speculative:
    """Keys the router routed, counted as cached on their engine until they expire.

    A :class:`KeyTree` (whole keys, reference-counted), the live entries and a queue of
    expiries; bounded by ``max_entries`` (the earliest-expiring go first). An entry's expiry
    can be brought forward (:meth:`settle`: its request ended, so the engine's own KV events
    take over); the queue then holds a superseded record, skipped when it comes up."""

    def __init__(self, max_entries: int) -> None:
        self.tree = KeyTree()
        self._queue = _ExpiryQueue()  # (expiry, handle), superseded ones included
        # handle -> (expiry, engine, key, the node the key ends at)
        self._live: dict[int, tuple[float, str, bytes, KeyNode | None]] = {}
        self._stale = 0  # superseded records in the queue
        self._seq = 0
        self.max_entries = max_entries

    def __len__(self) -> int:
        return len(self._live)

    def add(self, engine: str, key: bytes, ttl: float, now: float) -> int:
        """Count ``key`` as cached on ``engine`` for ``ttl`` seconds; returns the entry's handle
        (0: nothing added)."""
        if not key:
            return 0
        end = self.tree.add(engine, key)
        self._seq += 1
        expires = now + ttl
        self._live[self._seq] = (expires, engine, key, end)
        self._queue.push(expires, self._seq, ttl)
        while len(self._live) > self.max_entries:
            self._pop()
        return self._seq

    def key_of(self, handle: int) -> bytes | None:
        """The key of live entry ``handle`` (None: expired or never added)."""
        entry = self._live.get(handle)
        return entry[2] if entry is not None else None

    def settle(self, handle: int, grace: float, now: float) -> None:
        """Bring entry ``handle``'s expiry forward to ``now + grace`` (never later)."""
        entry = self._live.get(handle)
        expires = now + grace
        if entry is None or expires >= entry[0]:
            return
        self._live[handle] = (expires, entry[1], entry[2], entry[3])
        self._queue.push(expires, handle, grace)
        self._stale += 1  # the record with the old expiry
        if self._stale > 1024 and self._stale > 2 * len(self._live):  # amortised O(1)
            self._queue.keep(self._current)
            self._stale = 0

    def _current(self, expires: float, handle: int) -> bool:
        entry = self._live.get(handle)
        return entry is not None and entry[0] == expires

    def _pop(self, now: float = math.inf) -> bool:
        """Remove the queue's first record if it expires by ``now`` (False: none does); drop
        its entry if the record is the current one."""
        record = self._queue.pop_due(now)
        if record is None:
            return False
        expires, handle = record
        entry = self._live.get(handle)
        if entry is not None and entry[0] == expires:
            del self._live[handle]
            self.tree.drop(entry[1], entry[2], entry[3])
        elif self._stale:
            self._stale -= 1
        return True

    def expire(self, now: float) -> None:
        while self._pop(now):
            pass

    def clear_engine(self, engine: str) -> None:
        for handle in [h for h, entry in self._live.items() if entry[1] == engine]:
            _, _, key, end = self._live.pop(handle)
            self.tree.drop(engine, key, end)
        self._queue.keep(self._current)
        self._stale = 0
