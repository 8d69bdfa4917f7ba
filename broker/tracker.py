"""The consumer's pure core: what to do with each decoded stream entry of one engine.

A :class:`Cursor` remembers, per engine stream, the last entry id read and the (epoch, seq) the
next event must carry. :func:`classify` compares an entry against it:

* the expected seq (or a partial overlap: a re-sent batch) -> apply the new events;
* all events already seen -> duplicate, skip (a publish that was retried);
* a new epoch starting at seq 0 -> the engine restarted: reset it, then apply;
* anything else (seq gap, a new epoch not from its start, a first read of a trimmed stream) ->
  gap: reset the engine and rebuild it from a snapshot that covers the gap (its epoch's, up to
  the gap's seq, or any taken after the entry that showed the gap);
* an epoch this cursor already left behind -> stale, skip (a zombie publisher); but when that
  epoch is still publishing while the current one has written nothing for ``reclaim_after_ms``
  of stream time (entry ids carry the broker's clock) -> reclaim: the current epoch was not
  the engine's (a forged "restart" at seq 0), so the old one is taken back and resynced from a
  snapshot. A real restart keeps its new epoch: its engine writes (heartbeats at least) far
  more often than that, and its old process has stopped.

No I/O, no clock: the async shell in :mod:`broker.consumer` does the reading and the timing.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from broker.base import START_ID, parse_id
from broker.events import Envelope, Snapshot

RETIRED_EPOCHS = 8  # how many past epochs per engine are remembered as stale
# a retired epoch that publishes while the current one was silent this long is taken back
RECLAIM_AFTER_MS = 15_000


class Verdict(enum.Enum):
    APPLY = "apply"
    DUPLICATE = "duplicate"
    NEW_EPOCH = "new_epoch"
    GAP = "gap"
    STALE = "stale"
    RECLAIM = "reclaim"


class State(enum.Enum):
    NEW = "new"  # discovered; its snapshot has not been loaded yet
    ACTIVE = "active"  # reading its stream
    WAITING = "waiting"  # after a gap: waiting for a snapshot that covers it


@dataclass(frozen=True, slots=True)
class Gap:
    """What a snapshot must cover: events of ``epoch`` up to ``seq``, seen at entry ``entry_id``."""

    epoch: str
    seq: int
    entry_id: str


@dataclass(slots=True)
class Cursor:
    """Where a consumer stands on one engine's stream."""

    engine_id: str
    position: str = START_ID
    epoch: str | None = None
    next_seq: int | None = None  # None: only an epoch's seq 0 (or a snapshot) can come next
    state: State = State.NEW
    gap: Gap | None = None
    retired: deque[str] = field(default_factory=lambda: deque(maxlen=RETIRED_EPOCHS))
    reclaim_after_ms: int = RECLAIM_AFTER_MS
    # the stream time (ms of an entry id) the current epoch was last seen at
    current_ms: int = 0

    def classify(self, envs: list[Envelope], entry_id: str = START_ID) -> tuple[Verdict, int]:
        """The verdict for one decoded entry (read at ``entry_id``) and, for APPLY, how many
        leading events to skip."""
        head = envs[0]
        if head.epoch in self.retired:
            if parse_id(entry_id)[0] - self.current_ms >= self.reclaim_after_ms:
                return Verdict.RECLAIM, 0
            return Verdict.STALE, 0
        if head.epoch == self.epoch and self.next_seq is not None:
            last = envs[-1].seq
            if last < self.next_seq:
                return Verdict.DUPLICATE, 0
            if head.seq <= self.next_seq:
                return Verdict.APPLY, self.next_seq - head.seq
            return Verdict.GAP, 0
        if head.seq == 0:
            return Verdict.NEW_EPOCH, 0
        return Verdict.GAP, 0

    def advance(self, entry_id: str, last: Envelope) -> None:
        """Record that everything up to ``last`` (in entry ``entry_id``) was applied."""
        self.position = entry_id
        self.next_seq = last.seq + 1
        self.current_ms = parse_id(entry_id)[0]
        if last.epoch != self.epoch:
            self._switch_epoch(last.epoch)

    def _switch_epoch(self, epoch: str) -> None:
        if self.epoch is not None and self.epoch != epoch and self.epoch not in self.retired:
            self.retired.append(self.epoch)
        self.epoch = epoch

    def open_gap(self, entry_id: str, head: Envelope) -> Gap:
        """Stop reading until a snapshot covering everything before ``head`` arrives."""
        self.gap = Gap(head.epoch, head.seq - 1, entry_id)
        self.state = State.WAITING
        return self.gap

    def reclaim(self, entry_id: str, head: Envelope) -> Gap:
        """Take back retired epoch ``head.epoch`` (still publishing while the current one is
        silent) and retire the current one: wait for a snapshot covering everything before
        ``head``, as after a gap (never one of the epoch retired now)."""
        self.retired.remove(head.epoch)
        self._switch_epoch(head.epoch)
        self.next_seq = None
        return self.open_gap(entry_id, head)

    def covered_by(self, snap: Snapshot) -> bool:
        """Whether ``snap`` can end the current gap (or start a NEW cursor)."""
        if snap.epoch in self.retired:
            return False
        gap = self.gap
        if gap is None:
            return True
        if snap.epoch == gap.epoch and snap.seq >= gap.seq:
            return True
        # Else it must have been taken after the entry that showed the gap: a later epoch's
        # snapshot, or one of the same epoch that never reached the gap's seq. An engine's
        # snapshot names the last entry it wrote, every event in it settled, so for a gap it
        # really made, this follows from the seq; a forged or corrupt jump (seq 2**63) has a
        # seq the engine never reaches, and waiting for that stopped its stream for good.
        try:
            return parse_id(snap.stream_id) >= parse_id(gap.entry_id)
        except ValueError:
            return False

    def load(self, snap: Snapshot) -> None:
        """Continue after ``snap``: replay entries after its stream id, expecting seq + 1."""
        self._switch_epoch(snap.epoch)
        self.position = snap.stream_id
        self.current_ms = parse_id(snap.stream_id)[0]
        self.next_seq = snap.seq + 1
        self.gap = None
        self.state = State.ACTIVE

    def restart(self) -> None:
        """Forget the position (the broker refused it): start over from a snapshot, as when the
        engine was discovered (its retired epochs stay retired)."""
        self.position = START_ID
        self.next_seq = None
        self.gap = None
        self.state = State.NEW

    def start_without_snapshot(self) -> None:
        """No snapshot exists: read the stream from its start, accepting only a seq-0 start."""
        self.position = START_ID
        self.epoch = None
        self.next_seq = None
        self.state = State.ACTIVE
