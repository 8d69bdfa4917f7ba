"""The byte-block prefix cache: matching, events, LRU eviction, pinning, reservations."""

from __future__ import annotations

from broker.events import BlockRemoved, BlockStored
from engine.prefix_cache import PrefixCache
from engine_reporter.hashing import chain_hashes


def _cache(capacity: int) -> PrefixCache:
    return PrefixCache(capacity=capacity, block_bytes=4)


def _store(c: PrefixCache, rid: str, key: bytes, now: float, private: int = 0) -> list[int]:
    hashes = c.key_hashes(key)
    assert c.reserve(rid, hashes, private, now) is not None
    c.commit(rid, key, now)
    c.release(rid, now)
    return hashes


def test_only_new_blocks_are_announced_as_a_chain() -> None:
    c = _cache(100)
    h = _store(c, "r1", b"aaaabbbb", 1.0)
    assert c.drain_events() == [BlockStored(None, tuple(h), (b"aaaa", b"bbbb"))]
    h2 = _store(c, "r2", b"aaaabbbbcccc!!", 2.0)  # partial tail "!!" is not a block
    assert h2[:2] == h
    assert c.drain_events() == [BlockStored(h[1], (h2[2],), (b"cccc",))]
    assert c.match(c.key_hashes(b"aaaabbbbcccc")) == 3
    assert c.match(c.key_hashes(b"aaaaXXXX")) == 1


def test_lru_evicts_the_least_recently_used_leaf_first() -> None:
    c = _cache(4)
    ha = _store(c, "r1", b"aaaabbbb", 1.0)
    hc = _store(c, "r2", b"ccccdddd", 2.0)
    c.drain_events()
    assert c.free_blocks == 0
    assert c.reserve("r3", c.key_hashes(b"eeee"), 0, 3.0) == 0
    assert c.drain_events() == [BlockRemoved((ha[1],))]  # bbbb: oldest leaf
    assert c.reserve("r4", c.key_hashes(b"ffff"), 0, 4.0) == 0
    assert c.drain_events() == [BlockRemoved((ha[0],))]  # then its parent aaaa
    assert c.match(hc) == 2


def test_touching_a_prefix_protects_it() -> None:
    c = _cache(4)
    ha = _store(c, "r1", b"aaaabbbb", 1.0)
    hc = _store(c, "r2", b"ccccdddd", 2.0)
    _store(c, "r3", b"aaaabbbb", 3.0)  # a hit refreshes a..b
    c.drain_events()
    assert c.reserve("r4", c.key_hashes(b"eeeeffff"), 0, 4.0) == 0
    assert c.drain_events() == [BlockRemoved((hc[1], hc[0]))]
    assert c.match(ha) == 2


def test_pinned_blocks_are_never_evicted() -> None:
    c = _cache(4)
    h = c.key_hashes(b"aaaabbbb")
    assert c.reserve("run", h, 1, 1.0) == 0
    c.commit("run", b"aaaabbbb", 1.0)  # running: pins a, b and holds 1 private block
    assert c.used_blocks == 3 and c.evictable_blocks == 0
    assert not c.can_fit(c.key_hashes(b"ccccdddd"), 0)
    assert c.reserve("big", c.key_hashes(b"ccccdddd"), 0, 2.0) is None
    assert c.reserve("small", c.key_hashes(b"cccc"), 0, 2.0) == 0
    c.release("small", 3.0)
    c.release("run", 4.0)
    assert c.used_blocks == 2 and c.evictable_blocks == 2  # a, b stay cached, unpinned
    assert c.can_fit(c.key_hashes(b"xxxxyyyyzzzzwwww"), 0)


def test_a_request_reusing_a_cached_prefix_pins_instead_of_reserving() -> None:
    c = _cache(3)
    h = _store(c, "r1", b"aaaabbbb", 1.0)
    c.drain_events()
    key = b"aaaabbbbcccc"
    assert c.can_fit(c.key_hashes(key), 0)
    assert c.reserve("r2", c.key_hashes(key), 0, 2.0) == 2
    assert c.matched_blocks("r2") == 2
    assert c.used_blocks == 3
    c.commit("r2", key, 2.0)
    assert c.drain_events() == [BlockStored(h[1], (chain_hashes(h[1], [b"cccc"])[0],), (b"cccc",))]
    assert c.hits_bytes == 8


def test_concurrent_requests_storing_the_same_blocks_store_them_once() -> None:
    c = _cache(10)
    key = b"aaaabbbb"
    h = c.key_hashes(key)
    c.reserve("x", h, 0, 1.0)
    c.reserve("y", h, 0, 1.0)
    assert c.used_blocks == 4  # both reserved room before either computed them
    c.commit("x", key, 2.0)
    c.commit("y", key, 2.0)
    assert c.used_blocks == 2
    assert len([e for e in c.drain_events() if isinstance(e, BlockStored)]) == 1
    c.release("x", 3.0)
    assert c.evictable_blocks == 0  # y still pins them
    c.release("y", 3.0)
    assert c.evictable_blocks == 2


def test_a_prefill_commits_its_chunks_as_one_chain_then_the_rest() -> None:
    """``commit(upto=n)`` stores the first n key blocks (a chunk of the prefill computed them):
    another request matches them at once; the final commit stores the rest as the chain's
    continuation, and a release frees what a cancelled prefill never computed."""
    c = _cache(10)
    key = b"aaaabbbbccccdddd"
    h = c.key_hashes(key)
    assert c.reserve("r1", h, 0, 1.0) == 0
    c.commit("r1", key, 1.0, upto=2)
    assert c.drain_events() == [BlockStored(None, tuple(h[:2]), (b"aaaa", b"bbbb"))]
    assert c.match(h) == 2
    c.commit("r1", key, 1.5, upto=1)  # (behind what is stored: nothing)
    assert c.drain_events() == []
    c.commit("r1", key, 2.0)
    assert c.drain_events() == [BlockStored(h[1], tuple(h[2:]), (b"cccc", b"dddd"))]
    assert c.match(h) == 4
    c.release("r1", 3.0)
    assert c.free_blocks == 6
    # cancelled after one chunk: the computed block stays cached, the reserved rest is freed
    k2 = b"eeeeffffgggg"
    h2 = c.key_hashes(k2)
    assert c.reserve("r2", h2, 1, 4.0) == 0
    c.commit("r2", k2, 4.0, upto=1)
    c.release("r2", 5.0)
    assert c.match(h2) == 1
    assert c.free_blocks == 5


def test_extend_caches_an_answer_s_whole_blocks_into_the_reserved_private_ones() -> None:
    # a request of key "aaaabb" (one whole block, a partial "bb") with 3 private blocks answers
    # "bbcccdddd": the next turn resends "aaaabbbbcccdddd..." and finds 3 blocks cached
    c = _cache(100)
    key = b"aaaabb"
    h = c.key_hashes(key)
    assert c.reserve("r1", h, 3, 1.0) == 0
    c.commit("r1", key, 1.0)
    c.drain_events()
    used = c.used_blocks
    c.extend("r1", key + b"bbcccdddd", 2.0)
    full = c.key_hashes(b"aaaabbbbcccdddd")
    assert c.drain_events() == [BlockStored(h[0], tuple(full[1:3]), (b"bbbb", b"cccd"))]
    assert c.used_blocks == used  # two reserved blocks became cache nodes
    c.release("r1", 3.0)
    assert c.match(full) == 3  # "aaaa", "bbbb", "cccd" ("ddd" is not a whole block)
    assert c.free_blocks == 100 - 3
    # no more than it reserved: one private block holds one answer block
    assert c.reserve("r2", c.key_hashes(b"xxxx"), 1, 4.0) == 0
    c.commit("r2", b"xxxx", 4.0)
    c.extend("r2", b"xxxxyyyyzzzz", 4.0)
    c.release("r2", 5.0)
    assert c.match(c.key_hashes(b"xxxxyyyyzzzz")) == 2


def test_extend_refuses_another_key_or_an_uncommitted_one() -> None:
    import pytest

    from engine.prefix_cache import KvError

    c = _cache(100)
    assert c.reserve("r1", c.key_hashes(b"aaaabbbb"), 2, 1.0) == 0
    with pytest.raises(KvError, match="not committed"):
        c.extend("r1", b"aaaabbbbcccc", 1.0)
    c.commit("r1", b"aaaabbbb", 1.0)
    with pytest.raises(KvError, match="another key"):
        c.extend("r1", b"aaaaXXXXcccc", 1.0)
