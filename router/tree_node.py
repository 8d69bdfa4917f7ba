"""The radix tree's node (one compressed edge: which engines hold how much of it, where blocks
end in it, how often it was used) and the result of :meth:`router.tree.RadixTree.match`."""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field


class Node:
    """One compressed edge: ``label`` bytes starting at key depth ``start``."""

    __slots__ = (
        "children",
        "dead",
        "end",
        "ends",
        "full",
        "hits",
        "hits_t",
        "label",
        "last_access",
        "nid",
        "parent",
        "partial",
        "start",
    )

    def __init__(self, label: bytes, parent: Node | None, start: int, nid: int, now: float):
        self.label = label
        self.parent = parent
        self.start = start
        self.end = start + len(label)
        self.nid = nid
        self.children: dict[int, Node] | None = None
        self.full: set[str] | None = None
        self.partial: dict[str, int] | None = None
        self.last_access = now
        self.hits = 0.0
        self.hits_t = now
        self.dead = False
        # end depths (absolute key positions) of the blocks whose last byte is in this label,
        # ascending: where an engine's reusable prefix can end (match floors to them)
        self.ends: array | None = None

    def add_end(self, depth: int) -> None:
        """Record that a block ends at key depth ``depth`` (inside this label)."""
        ends = self.ends
        if ends is None:
            self.ends = array("I", (depth,))
        elif not ends or ends[-1] < depth:
            ends.append(depth)
        else:
            i = bisect_left(ends, depth)
            if ends[i] != depth:
                ends.insert(i, depth)

    def floor_end(self, depth: int) -> int:
        """The greatest block end in this label at or before ``depth`` (-1: none)."""
        ends = self.ends
        if not ends:
            return -1
        if ends[-1] <= depth:
            return ends[-1]
        i = bisect_right(ends, depth)
        return ends[i - 1] if i else -1

    def coverage(self, engine: str) -> int:
        """How many leading bytes of the label ``engine`` holds."""
        if self.full and engine in self.full:
            return len(self.label)
        if self.partial:
            return self.partial.get(engine, 0)
        return 0

    def held(self) -> bool:
        return bool(self.full) or bool(self.partial)

    def hit_count(self, now: float, tau: float) -> float:
        """Requests that used this prefix, decayed with time constant ``tau`` (the window)."""
        return self.hits * math.exp(-max(now - self.hits_t, 0.0) / tau)


@dataclass(slots=True)  # __init__ written out: see router.api's docstring
class Match:
    """Result of :meth:`RadixTree.match`: matched bytes per engine and the nodes walked."""

    per_engine: dict[str, int]
    path: list[Node] = field(default_factory=list)
    depth: int = 0  # bytes of the key present in the tree at all (held or not)

    def __init__(
        self, per_engine: dict[str, int], path: list[Node] | None = None, depth: int = 0
    ) -> None:
        self.per_engine = per_engine
        self.path = [] if path is None else path  # (the field's default_factory)
        self.depth = depth

    def best(self) -> int:
        return max(self.per_engine.values(), default=0)
