"""The embedded in-process broker: Redis Streams semantics without Redis.

The default when every part of kvgate runs in one process (the demo, the simulator's live mode,
tests). It keeps the same contract as :class:`broker.redis_broker.RedisBroker`: ordered ids per
stream, approximate ``MAXLEN`` trimming (at least ``maxlen`` entries stay), snapshots, a registry
whose entries expire, and readers that block until an append wakes them.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from broker.base import (
    START_ID,
    BadPosition,
    BrokerStats,
    BrokerUnavailable,
    Fields,
    ReadResult,
    StreamEntries,
    parse_id,
    refused_positions,
)


@dataclass(slots=True)
class _Stream:
    ids: list[tuple[int, int]] = field(default_factory=list)
    entries: list[tuple[str, Fields]] = field(default_factory=list)
    next_ms: int = 1


class MemoryBroker:
    """An in-process broker for one asyncio event loop (not thread-safe, like asyncio itself)."""

    def __init__(self, *, prefix: str = "kvgate:", clock: Callable[[], float] = time.monotonic):
        self.prefix = prefix
        self.stats = BrokerStats()
        self._clock = clock
        self._streams: dict[str, _Stream] = {}
        self._snapshots: dict[str, bytes] = {}
        self._alive_until: dict[str, float] = {}
        self._snapshot_requests: set[str] = set()
        self._changed = asyncio.Condition()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerUnavailable("memory broker is closed")

    async def append(
        self, engine_id: str, entries: Sequence[Fields], *, maxlen: int | None = None
    ) -> list[str]:
        self._check_open()
        stream = self._streams.setdefault(engine_id, _Stream())
        out = []
        for fields in entries:
            key = (stream.next_ms, 0)
            stream.next_ms += 1
            entry_id = f"{key[0]}-{key[1]}"
            stream.ids.append(key)
            stream.entries.append((entry_id, fields))
            out.append(entry_id)
            self.stats.appended_bytes += sum(len(v) for v in fields.values())
        self.stats.appended_entries += len(out)
        if maxlen is not None and maxlen > 0:
            # Like MAXLEN ~: trim in chunks once the stream is an eighth over, never below maxlen.
            excess = len(stream.ids) - maxlen
            if excess > max(1, maxlen // 8):
                del stream.ids[:excess]
                del stream.entries[:excess]
        async with self._changed:
            self._changed.notify_all()
        return out

    def _collect(self, positions: Mapping[str, str], count: int) -> ReadResult:
        result: ReadResult = []
        for engine_id, position in positions.items():
            stream = self._streams.get(engine_id)
            if stream is None or not stream.ids:
                continue
            start = bisect_right(stream.ids, parse_id(position))
            if start < len(stream.ids):
                batch: StreamEntries = stream.entries[start : start + count]
                result.append((engine_id, batch))
        return result

    async def read(
        self, positions: Mapping[str, str], *, count: int = 1000, block_ms: int | None = None
    ) -> ReadResult:
        self._check_open()
        self.stats.read_calls += 1
        bad = refused_positions(positions)
        if bad:  # as Redis refuses such a read ("Invalid stream ID")
            raise BadPosition(bad)
        result = self._collect(positions, count)
        if not result and block_ms and block_ms > 0:
            try:
                async with self._changed:
                    await asyncio.wait_for(
                        self._changed.wait_for(
                            lambda: self._closed or bool(self._collect(positions, 1))
                        ),
                        block_ms / 1000,
                    )
            except TimeoutError:
                pass
            self._check_open()
            result = self._collect(positions, count)
        self.stats.read_entries += sum(len(e) for _, e in result)
        return result

    async def last_id(self, engine_id: str) -> str:
        self._check_open()
        stream = self._streams.get(engine_id)
        return stream.entries[-1][0] if stream and stream.entries else START_ID

    async def register(self, engine_id: str, ttl_s: float) -> bool:
        self._check_open()
        self._alive_until[engine_id] = self._clock() + ttl_s
        wanted = engine_id in self._snapshot_requests or engine_id not in self._snapshots
        self._snapshot_requests.discard(engine_id)
        return wanted

    async def unregister(self, engine_id: str) -> None:
        self._check_open()
        self._alive_until.pop(engine_id, None)

    async def engines(self) -> list[str]:
        self._check_open()
        now = self._clock()
        for engine_id in [e for e, t in self._alive_until.items() if t <= now]:
            del self._alive_until[engine_id]
        return sorted(self._alive_until)

    async def put_snapshot(self, engine_id: str, data: bytes) -> None:
        self._check_open()
        self._snapshots[engine_id] = data

    async def get_snapshot(self, engine_id: str) -> bytes | None:
        self._check_open()
        return self._snapshots.get(engine_id)

    async def request_snapshot(self, engine_id: str) -> None:
        self._check_open()
        self._snapshot_requests.add(engine_id)

    async def ping(self) -> None:
        self._check_open()

    async def close(self) -> None:
        self._closed = True
        async with self._changed:
            self._changed.notify_all()

    # Test and inspection helpers (not part of the Broker protocol).

    def stream_length(self, engine_id: str) -> int:
        stream = self._streams.get(engine_id)
        return len(stream.ids) if stream else 0

    def trim(self, engine_id: str, keep: int) -> None:
        """Drop all but the newest ``keep`` entries, as an aggressive MAXLEN would."""
        stream = self._streams.get(engine_id)
        if stream and len(stream.ids) > keep:
            cut = len(stream.ids) - keep
            del stream.ids[:cut]
            del stream.entries[:cut]
