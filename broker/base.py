"""The broker interface every transport implements (Redis Streams, the embedded in-process one).

A broker moves opaque stream entries (the field dicts of :mod:`broker.codec`) and snapshot blobs;
it knows nothing about events. Keys, for a prefix ``P`` (default ``kvgate:``):

* ``P s:<engine>``: the engine's stream; one entry = one encoded batch of its events;
* ``P snap:<engine>``: the engine's latest snapshot (:func:`broker.codec.encode_snapshot`);
* ``P engines``: the set of engine ids that ever registered; ``P alive:<engine>`` a key with a
  TTL that the engine refreshes (registry with heartbeat expiry);
* ``P snapreq:<engine>``: a consumer's request for a fresh snapshot (short TTL).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

Fields = Mapping[bytes, bytes]
StreamEntries = list[tuple[str, Fields]]  # (entry id, fields), oldest first
ReadResult = list[tuple[str, StreamEntries]]  # (engine id, entries)

START_ID = "0-0"  # read a stream from its beginning


class BrokerError(RuntimeError):
    """A broker operation failed for a reason other than the broker being unreachable."""


class BrokerUnavailable(BrokerError):
    """The broker cannot be reached right now (down, restarting, failing over): retry later."""


class BadStream(BrokerError):
    """Some stream keys hold something that is not a stream; reading them is pointless."""

    def __init__(self, engine_ids: Sequence[str]) -> None:
        super().__init__(f"not a stream: {', '.join(engine_ids)}")
        self.engine_ids = tuple(engine_ids)


class BadPosition(BrokerError):
    """The broker refused to read some streams from the positions given: those positions are
    unusable (the other streams are fine and are read without them)."""

    def __init__(self, engine_ids: Sequence[str]) -> None:
        super().__init__(f"unreadable position on stream: {', '.join(engine_ids)}")
        self.engine_ids = tuple(engine_ids)


MAX_ID_PART = (1 << 64) - 1  # Redis stream ids are two unsigned 64-bit integers


def _id_part(text: str) -> int:
    # ASCII digits only: int() also takes "_", spaces, signs and other scripts' digits, which
    # Redis refuses (one such position made every multi-stream XREAD fail)
    if not (0 < len(text) <= 20 and text.isascii() and text.isdigit()):
        raise ValueError(f"not a stream id part: {text!r}")
    value = int(text)
    if value > MAX_ID_PART:
        raise ValueError(f"stream id part over 64 bits: {text!r}")
    return value


def parse_id(entry_id: str) -> tuple[int, int]:
    """A stream id ``"<ms>-<n>"`` (or ``"<ms>"``) as a comparable pair; raises ValueError unless
    it is one Redis accepts: ASCII digits, each part within 64 bits."""
    if not isinstance(entry_id, str):
        raise ValueError(f"not a stream id: {entry_id!r}")
    ms, sep, n = entry_id.partition("-")
    return _id_part(ms), _id_part(n) if sep else 0


def refused_positions(positions: Mapping[str, str]) -> list[str]:
    """The engines whose read position is not a stream id Redis accepts (:func:`parse_id`)."""
    bad = []
    for engine_id, pos in positions.items():
        try:
            parse_id(pos)
        except ValueError:
            bad.append(engine_id)
    return bad


@dataclass(slots=True)
class BrokerStats:
    """Counters a broker keeps about its own traffic (exported by the processes that use it)."""

    appended_entries: int = 0
    appended_bytes: int = 0
    read_calls: int = 0
    read_entries: int = 0
    errors: int = 0
    # registry members that are not an engine id (not UTF-8, empty, too long): dropped
    bad_registry_members: int = 0


@runtime_checkable
class Broker(Protocol):
    """What the reporter and the consumer need from a transport; both implementations match."""

    prefix: str
    stats: BrokerStats

    async def append(
        self, engine_id: str, entries: Sequence[Fields], *, maxlen: int | None = None
    ) -> list[str]:
        """Append entries to the engine's stream (trimmed to about ``maxlen`` entries; None or 0:
        untrimmed) in one round trip; returns their ids in order."""
        ...

    async def read(
        self, positions: Mapping[str, str], *, count: int = 1000, block_ms: int | None = None
    ) -> ReadResult:
        """Entries after each engine's position (at most ``count`` per stream); waits up to
        ``block_ms`` for the first one when there is none (None: do not wait)."""
        ...

    async def last_id(self, engine_id: str) -> str:
        """The id of the newest entry on the engine's stream, ``START_ID`` if it has none."""
        ...

    async def register(self, engine_id: str, ttl_s: float) -> bool:
        """Mark the engine alive for ``ttl_s`` seconds. Returns True when the engine should
        publish a fresh snapshot: a consumer asked for one, or none is stored (e.g. Redis lost
        its data in a restart)."""
        ...

    async def unregister(self, engine_id: str) -> None:
        """Remove the engine from the registry (a clean shutdown)."""
        ...

    async def engines(self) -> list[str]:
        """Ids of the engines whose registration has not expired."""
        ...

    async def put_snapshot(self, engine_id: str, data: bytes) -> None:
        """Store the engine's encoded snapshot, replacing the previous one."""
        ...

    async def get_snapshot(self, engine_id: str) -> bytes | None:
        """The engine's stored snapshot, or None."""
        ...

    async def request_snapshot(self, engine_id: str) -> None:
        """Ask the engine's reporter to publish a fresh snapshot soon."""
        ...

    async def ping(self) -> None:
        """Raise BrokerUnavailable unless the broker answers."""
        ...

    async def close(self) -> None:
        """Release connections; the broker is unusable afterwards."""
        ...
