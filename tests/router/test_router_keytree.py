"""The speculative entries' key tree against a naive model (a list of live keys per engine)."""

from __future__ import annotations

import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from router.keytree import KeyNode, KeyTree

ENGINES = ("e0", "e1", "e2")


def _walk(tree: KeyTree) -> list[KeyNode]:
    out, stack = [], [tree.root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend((node.children or {}).values())
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.sampled_from(ENGINES),
            st.binary(min_size=1, max_size=8).map(lambda b: bytes(x % 2 + 97 for x in b)),
            st.booleans(),
        ),
        max_size=40,
    )
)
def test_key_tree_agrees_with_naive_model(ops: list) -> None:
    """A key stays matched while any reference to it (or to a longer key through it) remains;
    nodes nobody references are freed; the byte and node counts and each engine's held bytes
    equal a recount. Every other drop uses the node ``add`` returned (walking up from it, as
    the router's speculative entries do), through whatever splits later keys made. Adds come
    with and without a match of the same key just before (the add then resumes from it)."""
    tree = KeyTree()
    live: list[tuple[str, bytes, KeyNode | None]] = []
    for add, engine, key, matched_first in ops:
        if add or not live:
            if matched_first:  # as the router does: the add starts where the match stopped
                tree.match(key)
            live.append((engine, key, tree.add(engine, key)))
        else:
            engine, key, end = live.pop(len(key) % len(live))
            tree.drop(engine, key, end if len(live) % 2 else None)
        for probe in {k for _, k, _ in live} | {key, key[:1], key + b"a"}:
            expected: dict[str, int] = {}
            for e, k, _ in live:
                n = next(
                    (i for i, x in enumerate(probe[: len(k)]) if x != k[i]), min(len(probe), len(k))
                )
                if n > expected.get(e, 0):
                    expected[e] = n
            assert tree.match(probe) == {e: n for e, n in expected.items() if n}
        nodes = _walk(tree)
        assert tree.nodes == len(nodes)
        assert tree.total_bytes == sum(len(n.label) for n in nodes)
        for node in nodes[1:]:
            assert node.counts, "a node nobody references was kept"
            assert bytes(node.label) and node.end == node.start + len(node.label)
        held = {e: sum(len(n.label) for n in nodes if e in n.counts) for e in ENGINES}
        assert tree.held_bytes == {e: b for e, b in held.items() if b}
    for engine, key, end in live:
        tree.drop(engine, key, end)
    assert tree.total_bytes == 0 and tree.nodes == 1 and not tree.held_bytes


def test_labels_borrow_the_keys_bytes_and_release_them() -> None:
    """No copy of a key's bytes is made; once every entry through it is dropped nothing holds
    the key any more."""
    tree = KeyTree()
    key = bytes(range(200)) * 100
    baseline = sys.getrefcount(key)
    end = tree.add("e0", key)
    assert end is not None and end.label.obj is key  # a view of the key, not a copy
    other = key[:5000] + b"x" * 100
    other_end = tree.add("e1", other)  # splits the first key's node at 5000
    assert tree.match(key) == {"e0": len(key), "e1": 5000}
    probe = bytearray(key)
    probe[7000] ^= 1
    assert tree.match(bytes(probe)) == {"e0": 7000, "e1": 5000}  # diverges inside a label
    tree.drop("e0", key, end)
    assert end.dead and tree.match(key) == {"e1": 5000}
    assert [n.label.obj is key for n in _walk(tree)[1:]].count(True) == 1  # the shared part
    assert sys.getrefcount(key) > baseline
    tree.drop("e1", other, other_end)
    del end
    assert sys.getrefcount(key) == baseline and tree.nodes == 1
