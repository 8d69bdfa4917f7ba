"""The reporter's pure core: engine events in, numbered envelopes and exact snapshots out.

No I/O and no clock (the shell passes ``ts``). Events wait in a bounded buffer until the shell
takes them to publish; when the buffer is full the *oldest* event is dropped. Either way an event
*settles* when it leaves the buffer (taken for publishing, or dropped), and only settled events
change the mirror of cached blocks. That one rule makes snapshots exact at any moment between two
publishes:

* the mirror is the engine's cache after ``settled_seq``, the last settled sequence number;
* every event after ``settled_seq`` is still in the buffer, unpublished;
* so ``snapshot(last_published_stream_id)`` says "state after seq S, replay entries after id X",
  and the first entry after X starts at S + 1 or later (a dropped event is a sequence gap that
  sends consumers to the snapshot, which already includes its effect).

A batch whose publish failed also settled when taken: it may or may not have reached the stream,
so the shell must publish a snapshot before the next batch (consumers skip duplicates by seq).
"""

from __future__ import annotations

from collections import deque

from broker.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    Envelope,
    Event,
    LoadHeartbeat,
    Snapshot,
)

MAX_CHAIN = 1024  # blocks per BlockStored chain in a snapshot


class ReportBuilder:
    """Numbers an engine's events, buffers them, and mirrors the engine's cached blocks."""

    def __init__(self, engine_id: str, epoch: str, *, capacity: int = 65536) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.engine_id = engine_id
        self.epoch = epoch
        self.capacity = capacity
        self._buffer: deque[Envelope] = deque()
        self._next_seq = 0
        self.settled_seq = -1
        self.dropped = 0  # events that never reached the stream (full buffer or failed publish)
        self.settled_kv_events = 0  # KV events folded into the mirror so far
        # The mirror is two flat dicts of ints and bytes, not a dict of tuples: the garbage
        # collector then never walks it (with 1e5+ blocks, tuples made full collections dominate).
        self._blocks: dict[int, bytes] = {}
        self._parents: dict[int, int | None] = {}
        self._heartbeat: LoadHeartbeat | None = None

    # ----------------------------------------------------------------- producing

    def emit(self, event: Event, ts: float) -> Envelope:
        """Number ``event`` and buffer it; a full buffer drops its oldest event to make room.
        Raises EventError if ``event`` is not a broker event (nothing is consumed then)."""
        env = Envelope(self.engine_id, self.epoch, self._next_seq, ts, event)
        self._next_seq += 1
        if len(self._buffer) >= self.capacity:
            self._settle(self._buffer.popleft())
            self.dropped += 1
        self._buffer.append(env)
        return env

    @property
    def pending(self) -> int:
        """Events waiting to be published."""
        return len(self._buffer)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def take(self, max_events: int) -> list[Envelope]:
        """Remove up to ``max_events`` oldest events for publishing (they settle now)."""
        n = min(max_events, len(self._buffer))
        batch = [self._buffer.popleft() for _ in range(n)]
        for env in batch:
            self._settle(env)
        return batch

    def publish_failed(self, batch: list[Envelope]) -> None:
        """Count a taken batch that may not have reached the stream as dropped."""
        self.dropped += len(batch)

    # ----------------------------------------------------------------- mirror

    def _settle(self, env: Envelope) -> None:
        self.settled_seq = env.seq
        ev = env.event
        if type(ev) is BlockStored:
            self._blocks.update(zip(ev.hashes, ev.blocks, strict=True))
            parents = self._parents
            parent = ev.parent_hash
            for h in ev.hashes:
                parents[h] = parent
                parent = h
            self.settled_kv_events += 1
        elif type(ev) is BlockRemoved:
            blocks, parents = self._blocks, self._parents
            for h in ev.hashes:
                if blocks.pop(h, None) is not None:
                    del parents[h]
            self.settled_kv_events += 1
        elif type(ev) is AllCleared:
            self._blocks.clear()
            self._parents.clear()
            self.settled_kv_events += 1
        elif type(ev) is LoadHeartbeat:
            self._heartbeat = ev

    @property
    def cached_blocks(self) -> int:
        return len(self._blocks)

    def cached_hashes(self) -> set[int]:
        return set(self._blocks)

    def snapshot(self, stream_id: str) -> Snapshot:
        """The mirror as of ``settled_seq``, to be replayed after stream entry ``stream_id`` (the
        last entry published). Chains list parents before children."""
        return Snapshot(
            self.engine_id,
            self.epoch,
            self.settled_seq,
            stream_id,
            tuple(self._chains()),
            self._heartbeat,
        )

    def _parent_first(self) -> list[int]:
        """Mirror hashes, each after its parent when the parent is cached too."""
        parents = self._parents
        placed: set[int] = set()
        order: list[int] = []
        for h in parents:
            if h in placed:
                continue
            # A parent stored again after its child (evicted then re-cached) comes later in
            # insertion order: place the uncached-so-far ancestors first.
            lineage = [h]
            parent = parents[h]
            while parent is not None and parent in parents and parent not in placed:
                if parent in lineage:  # a hash cycle can only come from a collision: stop
                    break
                lineage.append(parent)
                parent = parents[parent]
            for node in reversed(lineage):
                placed.add(node)
                order.append(node)
        return order

    def _chains(self) -> list[BlockStored]:
        parents, stored = self._parents, self._blocks
        chains: list[BlockStored] = []
        parent: int | None = None
        hashes: list[int] = []
        blocks: list[bytes] = []
        for h in self._parent_first():
            p, block = parents[h], stored[h]
            if hashes and (p != hashes[-1] or len(hashes) >= MAX_CHAIN):
                chains.append(BlockStored(parent, tuple(hashes), tuple(blocks)))
                hashes, blocks = [], []
            if not hashes:
                parent = p
            hashes.append(h)
            blocks.append(block)
        if hashes:
            chains.append(BlockStored(parent, tuple(hashes), tuple(blocks)))
        return chains
