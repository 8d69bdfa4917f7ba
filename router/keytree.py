"""Radix tree of whole keys, reference-counted per engine: the router's own speculative and
approximate cache entries (``router.speculative.Speculative``).

Why a tree of its own (block events go to :class:`router.tree.RadixTree`): an entry covers its
whole key, so a node is held by an engine or not (no partial coverage, no LRU, no block index),
and its bytes need not be copied. A node's label is a ``memoryview`` slice of the key that
created it, and a key is kept alive by its entry anyway; copying the label (the part of a 32 KiB
key no other live key shares) was half the cost of adding an entry, and freeing it most of the
cost of expiring one, measured in ``bench/bench_router.py``'s steady state. A view keeps its
key's buffer alive while the node lives; a node lives only while a key through it does, so the
memory held stays within twice the live keys' bytes (plus the last key matched, kept until
the next change as a hint for its insertion).

Semantics (a property test checks them against a naive model): ``match(key)`` gives, per
engine, the longest common prefix of ``key`` with any key it holds a reference to.
"""

from __future__ import annotations

from router.tree import lcp_at


class KeyNode:
    """One compressed edge: ``label`` spans key depths ``[start, end)``; ``counts``: engine ->
    live references through this node (never empty outside the root)."""

    __slots__ = ("children", "counts", "dead", "end", "label", "parent", "start")

    def __init__(self, label: memoryview, parent: KeyNode | None, start: int) -> None:
        self.label = label
        self.parent = parent
        self.start = start
        self.end = start + len(label)
        self.children: dict[int, KeyNode] | None = None
        self.counts: dict[str, int] = {}
        self.dead = False


class KeyTree:
    """See the module docstring. Pure: no clock needed (the entries' owner times them out)."""

    def __init__(self) -> None:
        self.root = KeyNode(memoryview(b""), None, 0)
        self.nodes = 1
        self.total_bytes = 0
        self.held_bytes: dict[str, int] = {}  # engine -> bytes of the nodes it holds
        # where the last match stopped: (key, node, depth, child diverged in or None, bytes of
        # it matched); every change clears it. The router matches a key and then adds it, so
        # the add starts there instead of comparing the key from the root again
        self._hint: tuple[bytes, KeyNode, int, KeyNode | None, int] | None = None

    def add(self, engine: str, key: bytes) -> KeyNode | None:
        """One more reference from ``engine`` to ``key``; returns the node the key ends at
        (None for an empty key), for :meth:`drop`. Keys end on node boundaries (a key ending
        inside a label splits it), and a split keeps the lower part's object, so the returned
        node stays the key's last node while the reference lives."""
        n = len(key)
        if not n:
            return None
        hint = self._hint
        self._hint = None
        view: memoryview | None = None
        path: list[KeyNode] = []
        node = self.root
        i = 0
        if hint is not None and hint[0] is key:
            _, node, i, inside, k = hint
            up: KeyNode | None = node
            while up is not None and up is not self.root:  # the nodes above, top down
                path.append(up)
                up = up.parent
            path.reverse()
            if inside is not None:  # the key ends or diverges inside it, after k bytes
                upper = self._split(inside, k)
                path.append(upper)
                if i + k < n:
                    path.append(self._new_leaf(upper, memoryview(key)[i + k :]))
                i = n
        while i < n:
            child = node.children.get(key[i]) if node.children is not None else None
            if child is None:
                if view is None:
                    view = memoryview(key)
                path.append(self._new_leaf(node, view[i:]))
                break
            label = child.label
            size = len(label)
            take = size if size < n - i else n - i
            if take == size and key.startswith(label, i):
                k = size
            else:
                k = lcp_at(label, 0, key, i, take)
            if k < size:  # the key ends or diverges inside the label: split there
                upper = self._split(child, k)
                path.append(upper)
                if i + k < n:
                    if view is None:
                        view = memoryview(key)
                    path.append(self._new_leaf(upper, view[i + k :]))
                break
            path.append(child)
            i += size
            node = child
        held = self.held_bytes
        for node in path:
            counts = node.counts
            c = counts.get(engine, 0)
            counts[engine] = c + 1
            if c == 0:
                held[engine] = held.get(engine, 0) + len(node.label)
        return path[-1]

    def drop(self, engine: str, key: bytes, end: KeyNode | None = None) -> None:
        """Release one :meth:`add` reference (``end``: what it returned; without it the path is
        found by comparing the key's bytes again). Nodes nobody references are deleted."""
        self._hint = None
        path: list[KeyNode] = []
        if end is not None and not end.dead and end.end == len(key):
            up: KeyNode | None = end
            root = self.root
            while up is not None and up is not root:
                path.append(up)
                up = up.parent
        else:  # the nodes spelling ``key`` from the root, deepest first
            node = self.root
            pos = 0
            while pos < len(key):
                child = node.children.get(key[pos]) if node.children is not None else None
                if child is None or not key.startswith(child.label, pos):
                    break
                path.append(child)
                pos += len(child.label)
                node = child
            path.reverse()
        held = self.held_bytes
        for node in path:  # deepest first: a node is a leaf by the time nobody holds it
            counts = node.counts
            c = counts.get(engine, 0)
            if c > 1:
                counts[engine] = c - 1
            elif c == 1:
                del counts[engine]
                held[engine] -= len(node.label)
                if not held[engine]:
                    del held[engine]
                if not counts and node.children is None:
                    self._drop_leaf(node)

    def match(self, key: bytes) -> dict[str, int]:
        """Per engine, how many leading bytes of ``key`` it holds (engines holding none are
        absent): one C comparison per node walked. An engine holding a node holds its parent
        (a key through one passes through the other), so a node's holders are its ``counts``'
        keys and the engines missing from them stop at its start: no set intersections, and
        the result is filled by ``dict.fromkeys`` (C speed), as in ``RadixTree.match``."""
        out: dict[str, int] = {}
        node = self.root
        pos = 0
        n = len(key)
        alive: dict[str, int] | None = None  # None: the root, which everyone holds
        while pos < n:
            child = node.children.get(key[pos]) if node.children is not None else None
            if child is None:
                break
            label = child.label
            size = len(label)
            if size <= n - pos and key.startswith(label, pos):
                m = size
            else:
                m = lcp_at(label, 0, key, pos, size if size < n - pos else n - pos)
            counts = child.counts
            if alive is not None and len(counts) != len(alive):  # their keys end at ``pos``
                out.update(dict.fromkeys(alive.keys() - counts.keys(), pos))
            if m < size:
                out.update(dict.fromkeys(counts, pos + m))
                self._hint = (key, node, pos, child, m)
                return out
            pos += size
            alive = counts
            node = child
        if alive is not None:
            out.update(dict.fromkeys(alive, pos))
        self._hint = (key, node, pos, None, 0)
        return out

    def _new_leaf(self, parent: KeyNode, label: memoryview) -> KeyNode:
        leaf = KeyNode(label, parent, parent.end)
        if parent.children is None:
            parent.children = {}
        parent.children[label[0]] = leaf
        self.nodes += 1
        self.total_bytes += len(label)
        return leaf

    def _split(self, node: KeyNode, at: int) -> KeyNode:
        """Cut ``node`` at ``at`` bytes into a new upper node (same holders) and itself as the
        lower part; returns the upper one."""
        label = node.label
        parent = node.parent
        assert parent is not None and parent.children is not None
        upper = KeyNode(label[:at], parent, node.start)
        parent.children[label[0]] = upper
        lower = label[at:]
        node.label = lower
        node.start += at
        node.parent = upper
        upper.children = {lower[0]: node}
        upper.counts = dict(node.counts)
        self.nodes += 1
        return upper

    def _drop_leaf(self, node: KeyNode) -> None:
        parent = node.parent
        assert parent is not None and parent.children is not None
        del parent.children[node.label[0]]
        if not parent.children:
            parent.children = None
        self.total_bytes -= len(node.label)
        self.nodes -= 1
        node.dead = True
        node.parent = None
        node.label = memoryview(b"")
