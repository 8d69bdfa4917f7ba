"""Byte-level radix tree of what every engine caches, fed by block events.

Why it looks like this: matching a 32 KB key must cost a few C-level comparisons per tree node,
never a Python step per byte or per block, and the tree must fit in about 1.5x the cached text.

* Edges are compressed: a node's ``label`` holds the bytes of many blocks; a key is matched with
  ``bytes.startswith(label, pos)`` and, at the one node where it diverges, a binary search of
  ``memcmp`` slice comparisons (:func:`lcp_at`). Nodes split at branch points only.
* Engines hold prefix-closed sets of chains, so an engine's coverage of a node is one number:
  ``full`` (the set of engines holding the whole label) or ``partial[engine]`` (how many leading
  bytes of the label it holds). Matching intersects the ``full`` sets node by node (C speed).
* Removals name block hashes, so a compact open-addressing table (:mod:`router.block_index`,
  16 bytes per slot) maps a hash to (node, end depth, length). Splits keep the old node object
  as the lower half, so a stored node reference is the node holding the block's last byte or one
  of its descendants' ancestors: resolving walks up ``parent`` pointers.
* Nodes no engine holds stay (for re-stores and statistics) until the byte budget or the idle
  time-to-live drops them, least recently used first.

Semantics (the property tests check these against a naive model): an engine's cache is the set
of strings spelled by chains of blocks it holds from the root. A stored chain whose parent block
the engine does not hold is ignored (it could never be matched); removing a block also drops the
engine's blocks below it. ``match(key)`` gives, per engine, the longest common prefix of ``key``
with any of its strings, *floored to a block boundary*: an engine reuses only whole blocks, so a
key that diverges inside a block (two documents opening with the same word) is credited up to
the end of the last whole block, not the matching bytes of the partial one. Block boundaries are
the end depths of the blocks stored along the key's path (``Node.ends``: every engine's, one
sorted array per node); in a fleet of one block size they are every engine's own boundaries
(engines of different block sizes on the same text: a boundary may be another engine's).
Limitation: when one block's bytes are a strict byte-prefix of a sibling block's bytes (never
with fixed-size blocks), removing the shorter one drops the longer one too.

The node and the match result are :mod:`router.tree_node`. The router's own speculative and
approximate entries (whole keys, reference-counted) live in :class:`router.keytree.KeyTree`, not
here.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from router.block_index import _BlockIndex
from router.tree_node import Match, Node

_EMPTY: frozenset[str] = frozenset()


def lcp_at(a: bytes | memoryview, ai: int, b: bytes, bi: int, n: int) -> int:
    """Length of the common prefix of ``a[ai:ai+n]`` and ``b[bi:bi+n]`` (both at least n long).

    Galloping: test growing windows (64, 256, 1024, ... bytes) with ``b.startswith(window of
    a, offset)`` (C ``memcmp``, no copy of ``b``; a zero-copy slice when ``a`` is a memoryview)
    until one differs, then binary-search inside it; cost O(answer) bytes in O(log) Python steps.
    (``int.from_bytes`` XOR and memoryview equality are both an order of magnitude slower.)"""
    lo, step = 0, 64
    while True:
        hi = lo + step if lo + step < n else n
        if not b.startswith(a[ai + lo : ai + hi], bi + lo):
            break
        if hi == n:
            return n
        lo, step = hi, step << 2
    hi -= 1  # the answer is in [lo, hi)
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if b.startswith(a[ai + lo : ai + mid], bi + lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class TreeStats:
    nodes: int
    bytes: int
    unheld_bytes: int
    index_entries: int
    index_bytes: int
    engines: int
    dropped_nodes: int
    orphan_chains: int
    hash_conflicts: int


def _drop_zeros(out: dict[str, int]) -> dict[str, int]:
    """``out`` without engines credited 0 bytes (a match inside their first block); usually
    there are none and ``out`` itself is returned."""
    if 0 in out.values():
        return {e: v for e, v in out.items() if v}
    return out


class RadixTree:
    """The cluster's cache map. Pure: every method that ages data takes ``now``."""

    def __init__(
        self, budget_bytes: int = 1 << 30, idle_ttl_s: float = 180.0, hit_tau_s: float = 180.0
    ) -> None:
        self.budget_bytes = budget_bytes
        self.idle_ttl_s = idle_ttl_s
        self.hit_tau_s = hit_tau_s
        self._nodes: list[Node | None] = []
        self._free_ids: list[int] = []
        self._dead = 0
        self.root = self._new_node(b"", None, 0, 0.0)
        self._index = _BlockIndex()
        self._unheld: OrderedDict[Node, None] = OrderedDict()  # unheld leaves, oldest first
        self._lru: dict[str, OrderedDict[Node, None]] = {}  # per engine, nodes it covers
        self.held_bytes: dict[str, int] = {}
        self.total_bytes = 0
        self.dropped_nodes = 0
        self.orphan_chains = 0
        self.hash_conflicts = 0  # blocks announced under a hash another place holds (skipped)

    # ------------------------------------------------------------------ node bookkeeping

    def _new_node(self, label: bytes, parent: Node | None, start: int, now: float) -> Node:
        if self._free_ids:
            nid = self._free_ids.pop()
            node = Node(label, parent, start, nid, now)
            self._nodes[nid] = node
        else:
            node = Node(label, parent, start, len(self._nodes), now)
            self._nodes.append(node)
        return node

    def _new_leaf(self, parent: Node, data: bytes, now: float) -> Node:
        leaf = self._new_node(data, parent, parent.end, now)
        if parent.children is None:
            parent.children = {}
        parent.children[data[0]] = leaf
        self.total_bytes += len(data)
        self._unheld.pop(parent, None)  # no longer a leaf
        return leaf

    def _split(self, node: Node, at: int, now: float) -> Node:
        """Cut ``node`` at ``at`` bytes into a new upper node and itself as the lower part (so
        block references to ``node`` stay valid: the upper part is found by walking up)."""
        label = node.label
        upper = self._new_node(label[:at], node.parent, node.start, now)
        upper.last_access = node.last_access
        upper.hits, upper.hits_t = node.hits, node.hits_t
        parent = node.parent
        assert parent is not None and parent.children is not None
        parent.children[label[0]] = upper
        node.label = label[at:]
        node.start += at
        node.parent = upper
        upper.children = {node.label[0]: node}
        ends = node.ends
        if ends:  # block ends up to the cut belong to the upper part
            k = bisect_right(ends, upper.end)
            if k:
                upper.ends = ends[:k]
                node.ends = ends[k:] if k < len(ends) else None
        if node.full:
            upper.full = set(node.full)
        if node.partial:
            lower_partial = {}
            for engine, cov in node.partial.items():
                if cov >= at:
                    if upper.full is None:
                        upper.full = set()
                    upper.full.add(engine)
                    if cov > at:
                        lower_partial[engine] = cov - at
                else:
                    if upper.partial is None:
                        upper.partial = {}
                    upper.partial[engine] = cov
            node.partial = lower_partial or None
        for engine in self._holders(upper):
            lru = self._lru.get(engine)
            if lru is not None:
                lru[upper] = None
        return upper

    @staticmethod
    def _holders(node: Node) -> Iterable[str]:
        if node.full:
            yield from node.full
        if node.partial:
            yield from node.partial

    def _drop_node(self, node: Node) -> None:
        """Delete an unheld leaf; its parent may become an unheld leaf in turn."""
        parent = node.parent
        assert parent is not None and parent.children is not None
        del parent.children[node.label[0]]
        if not parent.children:
            parent.children = None
            if parent is not self.root and not parent.held():
                self._unheld[parent] = None
        self._unheld.pop(node, None)
        self.total_bytes -= len(node.label)
        node.label = b""
        node.children = None
        node.dead = True
        self._dead += 1
        self.dropped_nodes += 1
        if self._dead > max(4096, (len(self._nodes) - self._dead) // 2):
            self._sweep_index()

    def _sweep_index(self) -> None:
        """Re-point or drop index entries that reference dead nodes, then recycle their ids."""
        for h, nid, end, length in self._index.items():
            node = self._nodes[nid]
            live = self._locate(node, end - 1) if node is not None else None
            if live is None:
                self._index.delete(h)
            elif live is not node:
                self._index.put(h, live.nid, end, length)
        for nid, node in enumerate(self._nodes):
            if node is not None and node.dead:
                self._nodes[nid] = None
                self._free_ids.append(nid)
        self._dead = 0

    @staticmethod
    def _locate(node: Node, depth: int) -> Node | None:
        """The live node holding key depth ``depth``, from a node at or below it; None if gone."""
        while node.start > depth:
            parent = node.parent
            if parent is None:
                return None
            node = parent
        return None if node.dead else node

    def _set_cov(self, node: Node, engine: str, cov: int, now: float) -> None:
        """Raise ``engine``'s coverage of ``node`` to ``cov`` bytes (never lowers it)."""
        size = len(node.label)
        old = node.coverage(engine)
        if cov <= old:
            return
        if cov >= size:
            if node.partial is not None:
                node.partial.pop(engine, None)
                if not node.partial:
                    node.partial = None
            if node.full is None:
                node.full = set()
            node.full.add(engine)
            cov = size
        else:
            if node.partial is None:
                node.partial = {}
            node.partial[engine] = cov
        self.held_bytes[engine] = self.held_bytes.get(engine, 0) + cov - old
        if old == 0:
            self._unheld.pop(node, None)
        lru = self._lru.get(engine)
        if lru is None:
            lru = self._lru[engine] = OrderedDict()
        lru[node] = None
        lru.move_to_end(node)
        node.last_access = now

    def _truncate(self, node: Node, engine: str, keep: int) -> None:
        """Lower ``engine``'s coverage of ``node`` to ``keep`` bytes and drop it from every node
        below (an engine's cache is prefix-closed)."""
        stack = [(node, keep)]
        while stack:
            n, k = stack.pop()
            old = n.coverage(engine)
            if old <= k:
                continue
            was_full = old == len(n.label)
            if was_full:
                n.full.discard(engine)  # type: ignore[union-attr]
                if not n.full:
                    n.full = None
            elif n.partial is not None:
                del n.partial[engine]
                if not n.partial:
                    n.partial = None
            if k > 0:
                if n.partial is None:
                    n.partial = {}
                n.partial[engine] = k
            else:
                lru = self._lru.get(engine)
                if lru is not None:
                    lru.pop(n, None)
                if n.children is None and not n.held() and n is not self.root:
                    self._unheld[n] = None
            self.held_bytes[engine] -= old - k
            if was_full and n.children:
                stack.extend((c, 0) for c in n.children.values())

    # ------------------------------------------------------------------ structure

    def _ensure(self, node: Node, off: int, data: bytes, now: float) -> tuple[list[Node], int]:
        """Make ``data`` present right after byte ``off`` of ``node``; return the nodes that now
        hold its bytes (in order) and how many bytes of the last one it reaches."""
        path: list[Node] = []
        i, n = 0, len(data)
        while True:
            label = node.label
            rem = len(label) - off
            if rem > 0:
                take = rem if rem < n - i else n - i
                if off == 0 and take == rem:
                    k = take if data.startswith(label, i) else lcp_at(label, 0, data, i, take)
                else:
                    k = lcp_at(label, off, data, i, take)
                if k < take:  # diverges inside the label: split and branch
                    upper = self._split(node, off + k, now)
                    if k > 0:
                        path.append(upper)
                    leaf = self._new_leaf(upper, data[i + k :], now)
                    path.append(leaf)
                    return path, len(leaf.label)
                path.append(node)
                i += k
                if i == n:
                    return path, off + k
            if i == n:
                return path, len(label)
            child = node.children.get(data[i]) if node.children else None
            if child is None:
                leaf = self._new_leaf(node, data[i:], now)
                path.append(leaf)
                return path, len(leaf.label)
            node, off = child, 0

    # ------------------------------------------------------------------ block events

    def apply_stored(
        self,
        engine: str,
        parent_hash: int | None,
        hashes: Sequence[int],
        blocks: Sequence[bytes],
        now: float,
    ) -> bool:
        """``engine`` cached the chain ``blocks`` after block ``parent_hash``; False when ignored
        (the engine does not hold the parent)."""
        if parent_hash is None:
            node, off = self.root, 0
        else:
            ref = self._index.get(parent_hash)
            node_ref = self._nodes[ref[0]] if ref is not None else None
            loc = self._locate(node_ref, ref[1] - 1) if node_ref is not None else None  # type: ignore[index]
            if loc is None or loc.coverage(engine) < ref[1] - loc.start:  # type: ignore[index]
                self.orphan_chains += 1
                return False
            node, off = loc, ref[1] - loc.start  # type: ignore[index]
        data = blocks[0] if len(blocks) == 1 else b"".join(blocks)
        depth = node.start + off
        path, last_off = self._ensure(node, off, data, now)
        self._set_cov(path[-1], engine, last_off, now)
        for p in reversed(path[:-1]):  # leaf first: ancestors end up newer in the LRU
            self._set_cov(p, engine, len(p.label), now)
        # index every block under the node holding its last byte
        index = self._index
        at = 0
        end = depth
        for h, b in zip(hashes, blocks, strict=True):
            end += len(b)
            while path[at].end < end:
                at += 1
            node = path[at]
            node.add_end(end)
            old = index.claim(h, node.nid, end, len(b))
            if old is not None:  # indexed at another place
                if self._held_elsewhere(old, node, end):
                    # the hash of other bytes another engine holds: a hash is content, so this
                    # engine's announcement is wrong (a bug, a forgery) and must not take the
                    # index from the engines whose later events name that block
                    self.hash_conflicts += 1
                    continue
                index.put(h, node.nid, end, len(b))
        if self.total_bytes > self.budget_bytes:
            self.gc(now)
        return True

    def _held_elsewhere(self, ref: tuple[int, int, int], node: Node, end: int) -> bool:
        """Whether index entry ``ref`` names a block some engine still holds at another place
        than the one ending at ``end`` in ``node``."""
        nid, ref_end, _ = ref
        ref_node = self._nodes[nid] if nid < len(self._nodes) else None
        loc = self._locate(ref_node, ref_end - 1) if ref_node is not None else None
        if loc is None or (loc is node and ref_end == end):
            return False
        need = ref_end - loc.start
        holders = (*(loc.full or ()), *(loc.partial or ()))
        return any(loc.coverage(e) >= need for e in holders)

    def apply_removed(self, engine: str, hashes: Iterable[int], now: float) -> int:
        """``engine`` evicted these blocks (and so, for matching, everything below them);
        returns how many it was known to hold."""
        removed = 0
        for h in hashes:
            ref = self._index.get(h)
            if ref is None:
                continue
            nid, end, length = ref
            ref_node = self._nodes[nid]
            last = self._locate(ref_node, end - 1) if ref_node is not None else None
            if last is None or last.coverage(engine) < end - last.start:
                continue
            start = end - length
            removed += 1
            node = last
            # drop the block's bytes, walking up while no other branch of this engine shares them
            self._truncate(node, engine, max(start - node.start, 0))
            while node.start > start:
                parent = node.parent
                assert parent is not None
                if parent.children and any(c.coverage(engine) for c in parent.children.values()):
                    break
                node = parent
                self._truncate(node, engine, max(start - node.start, 0))
        if self.total_bytes > self.budget_bytes:
            self.gc(now)
        return removed

    def clear_engine(self, engine: str) -> None:
        """Forget everything ``engine`` holds (AllCleared, a new epoch, a reset)."""
        lru = self._lru.pop(engine, None)
        self.held_bytes.pop(engine, None)
        if not lru:
            return
        for node in lru:
            if node.dead:
                continue
            if node.full is not None:
                node.full.discard(engine)
                if not node.full:
                    node.full = None
            if node.partial is not None:
                node.partial.pop(engine, None)
                if not node.partial:
                    node.partial = None
            if node.children is None and not node.held() and node is not self.root:
                self._unheld[node] = None

    # ------------------------------------------------------------------ queries

    def match(self, key: bytes) -> Match:
        """Per engine, how many leading bytes of ``key`` it holds in whole blocks (engines
        holding none are absent); cost: one C comparison and a few C set/dict operations per
        node walked.

        Caches are prefix-closed, so an engine holding any of a node holds all of its parent:
        below the first node the engines still matching are exactly the current node's
        ``full`` set (no intersections), and the ones that stop are the parent's ``full`` minus
        it (``partial`` ones inside the node). The result dict is filled from those sets with
        ``dict.fromkeys`` (sized once, at C speed) rather than one insertion per engine.
        Where engines stop, the position is floored to the last block end at or before it
        (an engine's partial coverage already ends at one of its block ends); ``last`` is the
        last block end of the nodes passed so far."""
        out: dict[str, int] = {}
        path: list[Node] = []
        node = self.root
        pos, n = 0, len(key)
        last = 0  # the greatest block end at or before pos
        alive: set[str] | frozenset[str] | None = None  # None: the root, which everyone holds
        while pos < n:
            child = node.children.get(key[pos]) if node.children else None
            if child is None:
                break
            label = child.label
            size = len(label)
            if key.startswith(label, pos):
                m = size
            else:
                m = lcp_at(label, 0, key, pos, min(size, n - pos))
            path.append(child)
            full = child.full or _EMPTY
            partial = child.partial
            if alive is not None and len(full) != len(alive):
                stopped = alive - full
                if stopped:  # they stop here ...
                    out.update(dict.fromkeys(stopped, last))
            if partial:  # ... or inside the label (their coverage ends at a block end)
                for e, cov in partial.items():
                    if cov <= m:
                        out[e] = pos + cov
                    else:  # the key leaves the label inside e's coverage
                        f = child.floor_end(pos + m)
                        out[e] = f if f >= 0 else last
            if m < size:
                if full:
                    f = child.floor_end(pos + m)
                    out.update(dict.fromkeys(full, f if f >= 0 else last))
                return Match(_drop_zeros(out), path, pos + m)
            pos += size
            if child.ends:
                last = child.ends[-1]
            alive = full
            node = child
            if not alive:
                break
        if alive:
            out.update(dict.fromkeys(alive, last))
        return Match(_drop_zeros(out), path, pos)

    def touch(self, match: Match, engine: str | None, upto: int, now: float) -> None:
        """Record a request's use of the first ``upto`` matched bytes (last access, hit counts)
        and, for ``engine``, refresh its LRU order (leaf first, so ancestors stay newer)."""
        tau = self.hit_tau_s
        lru = self._lru.get(engine) if engine is not None else None
        used = [p for p in match.path if p.start < upto and not p.dead]
        for node in used:
            node.hits = node.hit_count(now, tau) + 1.0
            node.hits_t = now
            node.last_access = now
            if node in self._unheld:
                self._unheld.move_to_end(node)
        if lru is not None:
            for node in reversed(used):
                if node in lru:
                    lru.move_to_end(node)

    def lru_nodes(self, engine: str) -> Iterable[Node]:
        """Nodes ``engine`` holds by block coverage, least recently used first (its likely
        eviction order; key coverage is not tracked)."""
        return iter(self._lru.get(engine, ()))

    def engines(self) -> list[str]:
        return [e for e, b in self.held_bytes.items() if b > 0]

    def gc(self, now: float) -> int:
        """Drop unheld leaves, oldest first, while over budget or idle past the TTL."""
        dropped = 0
        horizon = now - self.idle_ttl_s
        while self._unheld:
            node = next(iter(self._unheld))
            if self.total_bytes <= self.budget_bytes and node.last_access > horizon:
                break
            self._unheld.pop(node)
            if node.dead or node.children or node.held():
                continue
            self._drop_node(node)
            dropped += 1
        return dropped

    def stats(self) -> TreeStats:
        unheld = sum(len(n.label) for n in self._unheld)
        return TreeStats(
            nodes=len(self._nodes) - self._dead - len(self._free_ids),
            bytes=self.total_bytes,
            unheld_bytes=unheld,
            index_entries=len(self._index),
            index_bytes=self._index.nbytes(),
            engines=len(self.engines()),
            dropped_nodes=self.dropped_nodes,
            orphan_chains=self.orphan_chains,
            hash_conflicts=self.hash_conflicts,
        )
