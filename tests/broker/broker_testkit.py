"""Helpers shared by the broker tests: a folding sink, a workload generator, polling waits."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from broker.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    Envelope,
    Event,
    LoadHeartbeat,
    RequestStarted,
    Snapshot,
)
from engine_reporter.hashing import chain_hashes


class FoldingSink:
    """Folds KV events into per-engine block sets and checks the consumer's ordering promise:
    each (engine, epoch, seq) from a stream at most once, in increasing order."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {}
        self.resets: dict[str, int] = {}
        self.applied: list[tuple[str, str, int]] = []
        self.violations: list[str] = []
        self._last: dict[str, tuple[str, int]] = {}
        self.heartbeats: dict[str, LoadHeartbeat] = {}
        self.snapshot_mode = False  # True while the consumer applies a snapshot's chains

    def apply(self, env: Envelope, now: float) -> None:
        ev = env.event
        blocks = self.blocks.setdefault(env.engine_id, set())
        if type(ev) is BlockStored:
            blocks.update(ev.hashes)
        elif type(ev) is BlockRemoved:
            blocks.difference_update(ev.hashes)
        elif type(ev) is AllCleared:
            blocks.clear()
        elif type(ev) is LoadHeartbeat:
            self.heartbeats[env.engine_id] = ev
        if self.snapshot_mode:
            return
        last = self._last.get(env.engine_id)
        if last is not None and last[0] == env.epoch and env.seq <= last[1]:
            self.violations.append(f"{env.engine_id} {env.epoch} seq {env.seq} after {last[1]}")
        self._last[env.engine_id] = (env.epoch, env.seq)
        self.applied.append((env.engine_id, env.epoch, env.seq))

    def load_snapshot(self, snap: Snapshot, now: float) -> None:
        self.snapshot_mode = True
        try:
            for chain in snap.blocks:
                self.apply(Envelope(snap.engine_id, snap.epoch, 0, now, chain), now)
        finally:
            self.snapshot_mode = False
        self._last[snap.engine_id] = (snap.epoch, snap.seq)

    def reset_engine(self, engine_id: str, now: float) -> None:
        self.blocks[engine_id] = set()
        self.resets[engine_id] = self.resets.get(engine_id, 0) + 1
        self._last.pop(engine_id, None)

    def state(self, engine_id: str) -> set[int]:
        return self.blocks.get(engine_id, set())


class PlainSink(FoldingSink):
    """The same sink without ``load_snapshot``: the consumer applies snapshot chains itself."""

    load_snapshot = None  # type: ignore[assignment]

    def apply(self, env: Envelope, now: float) -> None:
        ev = env.event
        blocks = self.blocks.setdefault(env.engine_id, set())
        if type(ev) is BlockStored:
            blocks.update(ev.hashes)
        elif type(ev) is BlockRemoved:
            blocks.difference_update(ev.hashes)
        elif type(ev) is AllCleared:
            blocks.clear()


class Workload:
    """A deterministic engine cache: stores chains of blocks, evicts some, sometimes clears."""

    def __init__(
        self, seed: int, *, block_len: int = 64, clear_every: int = 0, capacity: int = 2000
    ) -> None:
        self.rng = random.Random(seed)
        self.block_len = block_len
        self.capacity = capacity
        self.cached: dict[int, None] = {}
        self.clear_every = clear_every
        self.n = 0

    def next_event(self) -> Event:
        self.n += 1
        rng = self.rng
        if self.clear_every and self.n % self.clear_every == 0:
            self.cached.clear()
            return AllCleared()
        if len(self.cached) > self.capacity:  # evict the oldest, as an LRU cache would
            victims = list(self.cached)[:16]
            for h in victims:
                del self.cached[h]
            return BlockRemoved(tuple(victims))
        roll = rng.random()
        if roll < 0.2 and self.cached:
            victims = rng.sample(list(self.cached), min(len(self.cached), rng.randint(1, 4)))
            for h in victims:
                del self.cached[h]
            return BlockRemoved(tuple(victims))
        if roll < 0.25:
            return RequestStarted(f"req-{self.n}")
        n = rng.randint(4, 16)
        blocks = tuple(rng.randbytes(self.block_len) for _ in range(n))
        parent = rng.choice(list(self.cached)) if self.cached and rng.random() < 0.5 else None
        hashes = tuple(chain_hashes(parent, blocks))
        for h in hashes:
            self.cached[h] = None
        return BlockStored(parent, hashes, blocks)


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds; False on timeout (the caller asserts)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True
