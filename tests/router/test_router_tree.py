"""The radix tree against a naive model: random stores, removals, clears and matches agree."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_reporter.hashing import block_hash
from router.block_index import _BlockIndex
from router.tree import RadixTree, lcp_at

ENGINES = ("e0", "e1", "e2")
BLOCK = 3  # fixed-size blocks, as real engines cache


def _lcp(a: bytes, b: bytes) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Naive:
    """The obvious model: per engine a set of held block hashes; matching walks every chain."""

    blocks: dict[int, tuple[int | None, bytes]] = field(default_factory=dict)
    held: dict[str, set[int]] = field(default_factory=lambda: {e: set() for e in ENGINES})

    def stored(self, engine: str, parent: int | None, chain: list[bytes]) -> list[int]:
        if parent is not None and parent not in self.held[engine]:
            return []
        hashes = []
        for b in chain:
            h = block_hash(parent, b)
            self.blocks[h] = (parent, b)
            self.held[engine].add(h)
            hashes.append(h)
            parent = h
        return hashes

    def removed(self, engine: str, h: int) -> None:
        if h not in self.held[engine]:
            return
        drop = {h}
        changed = True
        while changed:
            changed = False
            for x in self.held[engine] - drop:
                if self.blocks[x][0] in drop:
                    drop.add(x)
                    changed = True
        self.held[engine] -= drop

    def match(self, key: bytes, *, whole_blocks: bool = True) -> dict[str, int]:
        """Per engine the longest common prefix of ``key`` with its chains, counting only the
        blocks it covers whole (``whole_blocks=False``: the raw common prefix)."""
        out = {}
        for engine, held in self.held.items():
            best = 0
            frontier = [(None, 0)]
            while frontier:
                parent, pos = frontier.pop()
                for h in held:
                    p, b = self.blocks[h]
                    if p != parent:
                        continue
                    n = _lcp(key[pos:], b)
                    best = max(best, pos + n if n == len(b) or not whole_blocks else pos)
                    if n == len(b):
                        frontier.append((h, pos + n))
            if best:
                out[engine] = best
        return out


block_st = st.binary(min_size=BLOCK, max_size=BLOCK).map(lambda b: bytes(x % 2 + 97 for x in b))
STATS = {"nonempty": 0, "partial": 0}
store_st = st.tuples(
    st.just("store"),
    st.sampled_from(ENGINES),
    st.integers(0, 1000),
    st.lists(block_st, min_size=1, max_size=4),
)
match_st = st.tuples(st.just("match"), st.integers(0, 1000), st.binary(max_size=5))
op_st = st.one_of(
    store_st,
    store_st,
    store_st,
    match_st,
    st.tuples(st.just("remove"), st.sampled_from(ENGINES), st.integers(0, 1000)),
    st.tuples(st.just("clear"), st.sampled_from(ENGINES)),
    match_st,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op_st, max_size=60), st.integers(0, 200))
def test_tree_agrees_with_naive_model(ops: list, budget: int) -> None:
    tree = RadixTree(budget_bytes=budget)
    model = Naive()
    chains: list[tuple[int | None, bytes]] = [(None, b"")]  # (last hash, text) seen so far
    for now, op in enumerate(ops):
        kind = op[0]
        if kind == "store":
            _, engine, pick, blocks = op
            parent, text = chains[pick % len(chains)]
            # sometimes continue an engine's own chain, sometimes another engine's or the root
            hashes = model.stored(engine, parent, blocks)
            ok = tree.apply_stored(engine, parent, _chain(parent, blocks), blocks, float(now))
            assert ok == bool(hashes)
            if hashes:
                for i, h in enumerate(hashes):
                    chains.append((h, text + b"".join(blocks[: i + 1])))
        elif kind == "remove":
            _, engine, pick = op
            h, _text = chains[pick % len(chains)]
            if h is None:
                continue
            model.removed(engine, h)
            tree.apply_removed(engine, [h], float(now))
        elif kind == "clear":
            model.held[op[1]].clear()
            tree.clear_engine(op[1])
        else:
            _, pick, tail = op
            _, text = chains[pick % len(chains)]
            key = text + bytes(x % 3 + 97 for x in tail)
            expected = model.match(key)
            assert tree.match(key).per_engine == expected, key
            STATS["nonempty"] += bool(expected)
            raw = model.match(key, whole_blocks=False)
            STATS["partial"] += any(v % BLOCK for v in raw.values())
        _check_prefix_closed(tree)
    # held bytes bookkeeping: never negative
    assert all(v >= 0 for v in tree.held_bytes.values())
    for _, text in chains:
        assert tree.match(text).per_engine == model.match(text)


def _check_prefix_closed(tree: RadixTree) -> None:
    """What ``match`` relies on (no set intersections): an engine holding any of a node holds
    all of its parent, i.e. a child's ``full`` and ``partial`` engines are in the parent's
    ``full`` (below the root), and no engine is both full and partial on one node."""
    stack = [tree.root]
    while stack:
        node = stack.pop()
        for child in (node.children or {}).values():
            if node is not tree.root:
                above = node.full or set()
                assert set(child.full or ()) <= above, "full engine not holding the parent"
                assert set(child.partial or ()) <= above, "partial engine not holding the parent"
            assert not set(child.full or ()) & set(child.partial or ())
            stack.append(child)


def _chain(parent: int | None, blocks: list[bytes]) -> list[int]:
    out = []
    for b in blocks:
        parent = block_hash(parent, b)
        out.append(parent)
    return out


def test_property_test_exercises_matches() -> None:
    """Guard against a vacuous property test: it must see real matches, and keys that leave a
    block in its middle (which must be credited only up to that block's start)."""
    test_tree_agrees_with_naive_model()
    assert STATS["nonempty"] > 30
    assert STATS["partial"] > 10


def test_match_credits_whole_blocks_of_any_length() -> None:
    """Blocks of varying byte length (a BPE engine's blocks of 32 tokens): a key diverging
    inside a block is credited up to that block's start, even when the divergence is past a
    split of the tree, and a key inside the first block credits nothing."""
    tree = RadixTree()
    doc_a = [b"Document A: alpha beta", b" gamma delta eps", b"ilon zeta"]
    doc_b = [b"Document B: bravo charlie", b" delta echo"]
    tree.apply_stored("e0", None, _chain(None, doc_a), doc_a, 0.0)
    tree.apply_stored("e1", None, _chain(None, doc_b), doc_b, 0.0)
    # shares the 9 bytes "Document " with both, inside their first blocks: nothing reusable
    assert tree.match(b"Document C: and more").per_engine == {}
    # all of doc A's first block, then diverging inside its second one
    key = b"Document A: alpha beta gamma DELTA"
    assert tree.match(key).per_engine == {"e0": len(doc_a[0])}
    # the whole of doc A and more: every block counts
    full = b"".join(doc_a)
    assert tree.match(full + b" and a question").per_engine == {"e0": len(full)}
    # a third engine that stored doc A's first block only, splitting nothing new
    tree.apply_stored("e2", None, _chain(None, doc_a[:1]), doc_a[:1], 1.0)
    assert tree.match(key).per_engine == {"e0": len(doc_a[0]), "e2": len(doc_a[0])}


def test_an_engine_announcing_anothers_hashes_for_other_bytes_changes_nothing_for_it() -> None:
    """A hash names content, so a second engine's announcement of the same hashes for other
    bytes is wrong (a bug, a forgery). It took the block index over: the first engine's next
    chain, whose parent is one of those blocks, was dropped as an orphan, and its evictions of
    them were ignored, so the router kept sending it requests for blocks it no longer held."""
    tree = RadixTree()
    doc = [bytes([65 + i]) * 8 for i in range(6)]
    hashes = _chain(None, doc)
    tree.apply_stored("good", None, hashes, doc, 0.0)
    forged = [bytes([97 + i]) * 8 for i in range(6)]
    tree.apply_stored("bad", None, hashes, forged, 1.0)
    assert tree.hash_conflicts == 6
    more = [b"Z" * 8]
    assert tree.apply_stored("good", hashes[-1], _chain(hashes[-1], more), more, 2.0)
    key = b"".join(doc + more)
    assert tree.match(key).per_engine == {"good": len(key)}
    assert tree.apply_removed("good", hashes[3:], 3.0) == 1  # (the rest went with it)
    assert tree.match(key).per_engine == {"good": 24}
    # the same chain again from another engine is no conflict
    tree.apply_stored("twin", None, hashes, doc, 4.0)
    assert tree.hash_conflicts == 6
    assert tree.match(key).per_engine == {"good": 24, "twin": 48}


def test_block_index_agrees_with_a_dict_under_collisions() -> None:
    import random

    rng = random.Random(5)
    index = _BlockIndex(bits=4)  # tiny: long probe runs, many rebuilds
    ref: dict[int, tuple[int, int, int]] = {}
    keys = [rng.randrange(1 << 64) for _ in range(300)] + [0, 16, 32, 48]  # same home slot
    for step in range(5000):
        h = keys[rng.randrange(len(keys))]
        r = rng.random()
        if r < 0.4:
            v = (rng.randrange(1 << 20), rng.randrange(1 << 30), rng.randrange(1 << 13))
            index.put(h, *v)
            ref[h] = v
        elif r < 0.6:  # claim: inserts where absent or the same, else answers what is there
            v = ref.get(h) if rng.random() < 0.3 and h in ref else None
            v = v or (rng.randrange(1 << 20), rng.randrange(1 << 30), rng.randrange(1 << 13))
            got = index.claim(h, *v)
            assert got == (ref[h] if h in ref and ref[h] != v else None)
            ref.setdefault(h, v)
        else:
            index.delete(h)
            ref.pop(h, None)
        if step % 97 == 0:
            assert all(index.get(k) == ref.get(k) for k in keys)
    assert len(index) == len(ref)
    assert sorted((h, *v) for h, v in ref.items()) == sorted(index.items())


def test_lcp_at() -> None:
    a = b"abcdefgh" * 100
    b = a[:333] + b"X" + a[334:]
    assert lcp_at(a, 0, b, 0, len(a)) == 333
    assert lcp_at(a, 8, a, 0, 792) == 792
    assert lcp_at(a, 1, b, 0, 10) == 0
    assert lcp_at(memoryview(a), 0, b, 0, len(a)) == 333  # a borrowed label (router.keytree)
    assert lcp_at(memoryview(a)[8:], 0, a, 0, 792) == 792
