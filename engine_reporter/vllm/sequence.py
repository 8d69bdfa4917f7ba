"""What a vLLM sequence number means for the bridge. Pure: the bridge acts on the verdicts.

vLLM numbers its published batches 0, 1, 2, ... per process and keeps the last ones (10,000 by
default) for replay. For each message that arrives on the PUB socket the tracker says:

* ``apply``: the next expected one (or the first ever seen, when it is 0);
* ``fill``: batches ``[replay_from, seq)`` are missing (a gap, or the bridge started after vLLM):
  ask the replay socket for them, apply what comes back in order, then this one;
* ``restart``: the number went backwards (vLLM never repeats one on its PUB socket), so vLLM
  restarted: its cache is empty, the bridge resets (AllCleared, new epoch) and then fills
  ``[0, seq)`` like a fresh start;
* ``stale``: a batch the bridge already applied from the replay socket (the PUB socket delivers
  it too when it was published while the replay ran): drop it.

A restart the numbers cannot show (the new process published past the old count before the
bridge saw a message) is caught by the bridge from vLLM's ``process_start_time_seconds``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

VerdictKind = Literal["apply", "fill", "restart", "stale"]


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: VerdictKind
    replay_from: int = 0


class SeqTracker:
    """Tracks the next sequence number vLLM should send."""

    def __init__(self) -> None:
        self.expected: int | None = None  # None: nothing seen since start or reset
        self._dup: tuple[int, int] | None = None  # replayed seqs the PUB socket may repeat

    def on_message(self, seq: int) -> Verdict:
        """Classify a message from the PUB socket (call :meth:`applied` once it is applied)."""
        if self._dup is not None:
            low, high = self._dup
            if low <= seq <= high and self.expected is not None and seq < self.expected:
                return Verdict("stale")
            self._dup = None
        if self.expected is None:
            return Verdict("fill", 0) if seq > 0 else Verdict("apply")
        if seq == self.expected:
            return Verdict("apply")
        if seq > self.expected:
            return Verdict("fill", self.expected)
        self.expected = None
        return Verdict("restart", 0) if seq > 0 else Verdict("restart")

    def applied(self, seq: int) -> None:
        self.expected = seq + 1

    def replayed(self, low: int, high: int) -> None:
        """Batches ``low..high`` came from the replay socket; the PUB socket may still deliver
        them (published while the replay ran): those are ``stale``, not a restart."""
        self._dup = (low, high)

    def reset(self) -> None:
        self.expected = None
        self._dup = None


def usable_run(seqs: Iterable[int], start: int, until: int | None) -> tuple[list[int], bool]:
    """Which replayed batches to apply, and whether they close the gap.

    Only a consecutive run can be applied; it must end right before ``until`` (the message that
    revealed the gap; None: whatever is newest) so nothing is missing between it and what comes
    next. The gap is closed when that run starts at ``start``.
    """
    wanted = sorted({s for s in seqs if s >= start and (until is None or s < until)})
    if not wanted or (until is not None and wanted[-1] != until - 1):
        return [], start == until
    first = len(wanted) - 1
    while first > 0 and wanted[first - 1] == wanted[first] - 1:
        first -= 1
    run = wanted[first:]
    return run, run[0] == start
