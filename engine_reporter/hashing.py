"""Stable block hashing shared by every part of kvgate.

``hash = H(parent_hash, block_bytes)``: xxh3-64 of the block's bytes, seeded with the parent's
hash (``ROOT`` for the first block of a prompt). Stable across processes, machines and Python
versions (never Python's ``hash()``), and no copy of the block is made to chain it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import xxhash

ROOT = 0x6B7667617465  # "kvgate": the seed standing in for "no parent"

_xxh3 = xxhash.xxh3_64_intdigest


def block_hash(parent: int | None, block: bytes) -> int:
    """The hash of ``block`` when it follows the block hashed ``parent`` (None: prompt start)."""
    return _xxh3(block, ROOT if parent is None else parent)


def chain_hashes(parent: int | None, blocks: Iterable[bytes]) -> list[int]:
    """Hashes of consecutive blocks, each chained to the one before."""
    out = []
    for b in blocks:
        parent = _xxh3(b, ROOT if parent is None else parent)
        out.append(parent)
    return out


def split_blocks(key: bytes, block_bytes: int) -> Iterator[bytes]:
    """Full blocks of ``block_bytes`` bytes from the start of ``key`` (a partial tail is not a
    block: engines cache only full blocks)."""
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    for start in range(0, len(key) - block_bytes + 1, block_bytes):
        yield key[start : start + block_bytes]
