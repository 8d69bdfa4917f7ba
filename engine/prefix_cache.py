"""The engine's KV memory: a byte-block prefix cache plus per-request private blocks.

Blocks are ``profile.block_bytes`` bytes of the routing key, named by their chain hash
(:mod:`engine_reporter.hashing`), so a block's hash names its whole prefix: the set of cached
hashes is a radix tree over blocks (each node knows its parent and how many children it has).

Memory model (``capacity`` = ``profile.kv_blocks``): a request that starts its prefill
:meth:`reserve` s KV for its whole life at once: the key blocks already cached are pinned, and
room is reserved for its uncached key blocks plus its *private* blocks (output tokens and any
tail that is not a full key block). Reserving everything up front is conservative (vLLM allocates
lazily and preempts when memory runs out) but means a decoding request is never evicted.
When its prefill completes the request :meth:`commit` s its key blocks into the cache (a
:class:`~broker.events.BlockStored` for the newly stored chain; under a scheduler that caches
chunks, each chunk's blocks as it completes, as vLLM and SGLang do); on finish it :meth:`release` s
them: they stay cached, unpinned, until LRU eviction (a :class:`~broker.events.BlockRemoved`)
makes room. A finished request first :meth:`extend` s its key with its output's whole blocks
(vLLM and SGLang cache every full block, output tokens included): the answer a conversation's
next turn resends, or bytes of its own that no key shares (:func:`engine.core.output_filler`).
Only unpinned leaves are evicted, so a cached block's parent is always cached.

Pure: ``now`` comes from the caller; nothing here reads a clock.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from broker.events import Event, removed_events, stored_events
from engine_reporter.hashing import chain_hashes, split_blocks


class KvError(RuntimeError):
    """A caller broke the cache's protocol (e.g. committed a request it never reserved)."""


@dataclass(slots=True)
class _Node:
    parent: int | None
    children: int = 0
    pins: int = 0
    last_access: float = 0.0


@dataclass(slots=True)
class _Alloc:
    """What one request holds: pinned cached blocks and reserved-but-unused blocks."""

    hashes: list[int]  # the request's full key chain
    pinned: int  # how many leading blocks of ``hashes`` this request pins
    reserved: int  # blocks reserved and not yet turned into cache nodes
    private: int  # of ``reserved``, the blocks past the key (cache nodes only by ``extend``)
    matched: int = 0  # leading key blocks that were cached when it reserved
    key: bytes = b""  # the key it committed (b"": none yet; ``extend`` checks against it)


@dataclass(slots=True)
class PrefixCache:
    """LRU prefix cache over byte blocks with pinning and reservations (see module docstring)."""

    capacity: int
    block_bytes: int
    _nodes: dict[int, _Node] = field(default_factory=dict)
    _allocs: dict[str, _Alloc] = field(default_factory=dict)
    _reserved: int = 0
    _pinned_nodes: int = 0
    _heap: list[tuple[float, int, int]] = field(default_factory=list)
    _heap_seq: int = 0
    _events: list[Event] = field(default_factory=list)
    # block hash -> reservations that will store it (reserved, their prefill not committed)
    _computing: dict[int, int] = field(default_factory=dict)
    hits_bytes: int = 0
    lookups_bytes: int = 0

    # ------------------------------------------------------------------ queries

    def key_hashes(self, key: bytes) -> list[int]:
        """The chain hashes of ``key``'s full blocks."""
        return chain_hashes(None, split_blocks(key, self.block_bytes))

    def match(self, hashes: list[int]) -> int:
        """How many leading blocks of ``hashes`` are cached (no side effects)."""
        n = 0
        nodes = self._nodes
        for h in hashes:
            if h not in nodes:
                break
            n += 1
        return n

    def computing(self, hashes: list[int]) -> int:
        """How many blocks of ``hashes`` past its cached prefix a reservation is computing now
        (they are stored when its prefill commits)."""
        i = self.match(hashes)
        n = 0
        while i + n < len(hashes) and hashes[i + n] in self._computing:
            n += 1
        return n

    @property
    def cached_blocks(self) -> int:
        return len(self._nodes)

    @property
    def used_blocks(self) -> int:
        """Cache nodes plus reservations: what is not free."""
        return len(self._nodes) + self._reserved

    @property
    def held_blocks(self) -> int:
        """Blocks the requests admitted hold: their pinned cached prefixes and their
        reservations (what vLLM's KV usage counts; the rest is free or evictable cache)."""
        return self._pinned_nodes + self._reserved

    @property
    def free_blocks(self) -> int:
        return self.capacity - self.used_blocks

    @property
    def evictable_blocks(self) -> int:
        """Cached blocks no running request pins (all of them can be evicted, leaves first)."""
        return len(self._nodes) - self._pinned_nodes

    def can_fit(self, hashes: list[int], private_blocks: int) -> bool:
        """Whether :meth:`reserve` would succeed now (no side effects)."""
        need = len(hashes) - self.match(hashes) + private_blocks
        return need <= self.free_blocks + self.evictable_blocks - self._matched_unpinned(hashes)

    def blocks_needed(self, hashes: list[int], private_blocks: int) -> int:
        return len(hashes) + private_blocks

    # ------------------------------------------------------------------ request lifecycle

    def reserve(
        self, request_id: str, hashes: list[int], private_blocks: int, now: float
    ) -> int | None:
        """Pin the cached prefix and reserve the rest; the matched block count, or None if the
        memory cannot be found even after evicting every unpinned block (nothing changes then)."""
        if request_id in self._allocs:
            raise KvError(f"request {request_id} already holds KV")
        matched = self.match(hashes)
        need = len(hashes) - matched + private_blocks
        if need > self.free_blocks + self.evictable_blocks - self._matched_unpinned(hashes):
            return None
        for h in hashes[:matched]:
            self._pin(h, now)
        self._evict_until(need)
        self._reserved += need
        self._allocs[request_id] = _Alloc(hashes, matched, need, private_blocks, matched)
        self._track(hashes[matched:], 1)
        self.lookups_bytes += len(hashes) * self.block_bytes
        self.hits_bytes += matched * self.block_bytes
        return matched

    def commit(self, request_id: str, key: bytes, now: float, upto: int | None = None) -> None:
        """Store the request's key blocks (its prefill computed them), or only its first
        ``upto`` (a chunk of its prefill computed them: the rest follow); emits BlockStored."""
        alloc = self._alloc(request_id)
        alloc.key = key
        hashes = alloc.hashes
        end = len(hashes) if upto is None else min(max(upto, alloc.pinned), len(hashes))
        self._track(hashes[alloc.pinned : end], -1)
        parent = hashes[alloc.pinned - 1] if alloc.pinned else None
        new_hashes: list[int] = []
        new_blocks: list[bytes] = []
        chain_parent = parent
        for i in range(alloc.pinned, end):
            h = hashes[i]
            node = self._nodes.get(h)
            if node is None:
                self._nodes[h] = _Node(parent)
                if parent is not None:
                    self._nodes[parent].children += 1
                block = key[i * self.block_bytes : (i + 1) * self.block_bytes]
                if not new_hashes:
                    chain_parent = parent
                new_hashes.append(h)
                new_blocks.append(block)
            else:
                if new_hashes:  # a chain must be contiguous: flush the one before this node
                    self._events += stored_events(chain_parent, new_hashes, new_blocks)
                    new_hashes, new_blocks = [], []
            # Either way the reserved slot is consumed (new node) or freed (already cached).
            alloc.reserved -= 1
            self._reserved -= 1
            self._pin(h, now)
            parent = h
        alloc.pinned = end
        if new_hashes:
            self._events += stored_events(chain_parent, new_hashes, new_blocks)

    def release(self, request_id: str, now: float) -> None:
        """The request is done: unpin its blocks, free its reservations (blocks stay cached)."""
        alloc = self._allocs.pop(request_id, None)
        if alloc is None:
            return
        self._track(alloc.hashes[alloc.pinned :], -1)  # (none once committed)
        self._reserved -= alloc.reserved
        for h in reversed(alloc.hashes[: alloc.pinned]):
            node = self._nodes[h]
            node.pins -= 1
            node.last_access = now
            if node.pins == 0:
                self._pinned_nodes -= 1
                if node.children == 0:
                    self._push(h, node)

    def extend(self, request_id: str, key: bytes, now: float) -> None:
        """Store the whole blocks of ``key`` (the request's committed key and what followed it,
        its answer) past its key blocks, into the private blocks it reserved (as many as those
        hold); emits BlockStored. A finished answer's KV stays cached as vLLM and SGLang keep
        it, so the conversation's next turn, which resends it, finds its history cached."""
        alloc = self._alloc(request_id)
        if alloc.pinned < len(alloc.hashes):
            raise KvError(f"request {request_id} extends a key it has not committed")
        n = len(alloc.hashes)
        head = n * self.block_bytes
        # its key's blocks are hashed already: compare the bytes (or, never committed, as its
        # whole prompt was cached, the hashes) and hash only what follows
        if alloc.key:
            same = key.startswith(alloc.key[:head])
        else:
            same = self.key_hashes(key[:head]) == alloc.hashes
        if not same:
            raise KvError(f"request {request_id} extends its key with another key")
        tail = key[head : head + alloc.reserved * self.block_bytes]
        extra = chain_hashes(alloc.hashes[-1] if n else None, split_blocks(tail, self.block_bytes))
        if not extra:
            return
        alloc.hashes = alloc.hashes + extra
        self._track(extra, 1)
        self.commit(request_id, key, now)

    def matched_blocks(self, request_id: str) -> int:
        """Key blocks that were cached when the request reserved."""
        return self._alloc(request_id).matched

    def holds(self, request_id: str) -> bool:
        return request_id in self._allocs

    def drain_events(self) -> list[Event]:
        out, self._events = self._events, []
        return out

    # ------------------------------------------------------------------ internals

    def _track(self, hashes: list[int], delta: int) -> None:
        computing = self._computing
        for h in hashes:
            n = computing.get(h, 0) + delta
            if n > 0:
                computing[h] = n
            else:
                computing.pop(h, None)

    def _alloc(self, request_id: str) -> _Alloc:
        try:
            return self._allocs[request_id]
        except KeyError:
            raise KvError(f"request {request_id} holds no KV") from None

    def _matched_unpinned(self, hashes: list[int]) -> int:
        """Blocks of the matched prefix that are evictable now but would be pinned by a reserve."""
        n = 0
        for h in hashes:
            node = self._nodes.get(h)
            if node is None:
                break
            if node.pins == 0:
                n += 1
        return n

    def _pin(self, h: int, now: float) -> None:
        node = self._nodes[h]
        if node.pins == 0:
            self._pinned_nodes += 1
        node.pins += 1
        node.last_access = now

    def _push(self, h: int, node: _Node) -> None:
        self._heap_seq += 1
        heapq.heappush(self._heap, (node.last_access, self._heap_seq, h))
        if len(self._heap) > 4 * len(self._nodes) + 64:
            self._compact_heap()

    def _compact_heap(self) -> None:
        self._heap = [
            e
            for e in self._heap
            if (n := self._nodes.get(e[2])) is not None
            and n.pins == 0
            and n.children == 0
            and n.last_access == e[0]
        ]
        heapq.heapify(self._heap)

    def _evict_until(self, need: int) -> None:
        """Evict least recently used unpinned leaves until ``need`` blocks are free."""
        removed: list[int] = []
        while self.free_blocks < need and self._heap:
            last, _, h = heapq.heappop(self._heap)
            node = self._nodes.get(h)
            if node is None or node.pins or node.children or node.last_access != last:
                continue  # stale entry
            del self._nodes[h]
            removed.append(h)
            if node.parent is not None:
                parent = self._nodes[node.parent]
                parent.children -= 1
                if parent.children == 0 and parent.pins == 0:
                    self._push(node.parent, parent)
        if removed:
            self._events += removed_events(removed)
