"""vLLM's block events to kvgate's block events. Pure: the bridge feeds it decoded events.

vLLM names a cached block by its own hash of the token ids (with LoRA, salt and multimodal
extras); kvgate names it ``block_hash(parent, block_bytes)`` over the bytes the block covers
(:mod:`engine_reporter.hashing`). The translator keeps ``vLLM hash -> kvgate hash`` for every
block vLLM holds, so removals and later chains (a new block whose parent vLLM announced earlier)
translate without the tokens again.

Bookkeeping that keeps kvgate's view exact:

* a vLLM block is held by one or more ``(medium, group_idx)`` holders (GPU, CPU offload, KV cache
  groups); it counts as cached until the last holder removes it, and a second announcement of a
  held block only adds a holder (a block announced twice is stored once);
* several vLLM blocks can share one kvgate hash (same bytes, different LoRA or cache salt):
  kvgate's block is removed only when the last of them is;
* a block whose parent is unknown (events missed beyond replay) cannot be chained: it is counted
  as an orphan and skipped, as are token ids outside the vocabulary;
* blocks of a KV cache group that is not full attention (sliding window, Mamba state) do not
  hold a reusable prefix and are ignored;
* ``AllBlocksCleared`` forgets everything and yields :class:`~broker.events.AllCleared`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from broker.events import AllCleared, Event, removed_events, stored_events
from engine_reporter.hashing import block_hash
from engine_reporter.vllm.tokens import TokenBytes, UnknownTokenError
from engine_reporter.vllm.wire import (
    VllmAllCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEvent,
    VllmHash,
)

DEFAULT_MEDIUM = "GPU"
FULL_ATTENTION = "full_attention"

Holder = tuple[str, int | None]


@dataclass(slots=True)
class TranslateStats:
    """Counters the bridge exports; every skipped or odd input is counted here."""

    stored_events: int = 0
    removed_events: int = 0
    cleared_events: int = 0
    blocks_announced: int = 0
    blocks_removed: int = 0
    duplicate_blocks: int = 0
    shared_blocks: int = 0
    empty_blocks: int = 0
    orphan_blocks: int = 0
    unknown_token_blocks: int = 0
    unknown_removals: int = 0
    ignored_group_events: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class _Block:
    """What kvgate knows of one vLLM block."""

    ours: int | None  # None: a block of leading special tokens only, at a prompt's start
    empty: bool  # covers no bytes: it stands for its parent and announces nothing
    holders: set[Holder] = field(default_factory=set)


class Translator:
    """Folds vLLM events into kvgate events; see the module docstring for the rules."""

    def __init__(self, tokens: TokenBytes) -> None:
        self._tokens = tokens
        self._blocks: dict[VllmHash, _Block] = {}
        self._refs: dict[int, int] = {}
        self._partial_groups: set[int] = set()
        self.stats = TranslateStats()

    @property
    def held_blocks(self) -> int:
        """kvgate blocks currently cached on the engine."""
        return len(self._refs)

    def ours(self, vllm_hash: VllmHash) -> int | None:
        """kvgate's hash of a held vLLM block (None if not held or empty)."""
        block = self._blocks.get(vllm_hash)
        return None if block is None else block.ours

    def reset(self) -> None:
        """Forget every block (engine restart, unrecoverable gap)."""
        self._blocks.clear()
        self._refs.clear()
        self._partial_groups.clear()

    def apply_all(self, events: Iterable[VllmEvent]) -> list[Event]:
        out: list[Event] = []
        for ev in events:
            out.extend(self.apply(ev))
        return out

    def apply(self, ev: VllmEvent) -> list[Event]:
        """The kvgate events one vLLM event amounts to (often one, maybe none)."""
        if isinstance(ev, VllmBlockStored):
            return self._stored(ev)
        if isinstance(ev, VllmBlockRemoved):
            return self._removed(ev)
        if isinstance(ev, VllmAllCleared):
            self.stats.cleared_events += 1
            self.reset()
            return [AllCleared()]
        raise TypeError(f"not a vLLM event: {type(ev).__name__}")

    def _stored(self, ev: VllmBlockStored) -> list[Event]:
        self.stats.stored_events += 1
        if ev.kv_cache_spec_kind not in (None, FULL_ATTENTION):
            if ev.group_idx is not None:
                self._partial_groups.add(ev.group_idx)
            self.stats.ignored_group_events += 1
            return []
        holder: Holder = (ev.medium or DEFAULT_MEDIUM, ev.group_idx)
        at_start = ev.parent_block_hash is None
        parent_ours: int | None = None
        if not at_start:
            parent = self._blocks.get(ev.parent_block_hash)  # type: ignore[arg-type]
            if parent is None:
                self.stats.orphan_blocks += len(ev.block_hashes)
                return []
            parent_ours = parent.ours

        out: list[Event] = []
        run_parent: int | None = parent_ours
        run_hashes: list[int] = []
        run_blocks: list[bytes] = []

        def flush() -> None:
            if run_hashes:
                out.extend(stored_events(run_parent, run_hashes, run_blocks))
                self.stats.blocks_announced += len(run_hashes)
                run_hashes.clear()
                run_blocks.clear()

        size = ev.block_size
        for i, vh in enumerate(ev.block_hashes):
            known = self._blocks.get(vh)
            if known is not None:
                self.stats.duplicate_blocks += 1
                known.holders.add(holder)
                flush()
                parent_ours = run_parent = known.ours
                continue
            try:
                data = self._tokens.block_bytes(
                    ev.token_ids[i * size : (i + 1) * size], at_start=at_start and i == 0
                )
            except UnknownTokenError:
                self.stats.unknown_token_blocks += len(ev.block_hashes) - i
                break
            if not data:
                self.stats.empty_blocks += 1
                self._blocks[vh] = _Block(parent_ours, True, {holder})
                continue
            ours = block_hash(parent_ours, data)
            self._blocks[vh] = _Block(ours, False, {holder})
            refs = self._refs.get(ours, 0)
            self._refs[ours] = refs + 1
            if refs:
                # Same bytes already held through another vLLM block (LoRA, cache salt).
                self.stats.shared_blocks += 1
                flush()
                run_parent = ours
            else:
                if not run_hashes:
                    run_parent = parent_ours
                run_hashes.append(ours)
                run_blocks.append(data)
            parent_ours = ours
        flush()
        return out

    def _removed(self, ev: VllmBlockRemoved) -> list[Event]:
        self.stats.removed_events += 1
        if ev.group_idx is not None and ev.group_idx in self._partial_groups:
            self.stats.ignored_group_events += 1
            return []
        holder: Holder = (ev.medium or DEFAULT_MEDIUM, ev.group_idx)
        gone: list[int] = []
        for vh in ev.block_hashes:
            block = self._blocks.get(vh)
            if block is None:
                self.stats.unknown_removals += 1
                continue
            block.holders.discard(holder)
            if block.holders:
                continue
            del self._blocks[vh]
            if block.empty or block.ours is None:
                continue
            refs = self._refs[block.ours] - 1
            if refs:
                self._refs[block.ours] = refs
            else:
                del self._refs[block.ours]
                gone.append(block.ours)
        if not gone:
            return []
        self.stats.blocks_removed += len(gone)
        return removed_events(gone)
