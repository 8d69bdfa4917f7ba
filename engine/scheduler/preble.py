"""``preble``: Preble's local scheduler (arXiv 2407.00023), for comparison.

Waiting requests fall into 10 groups by the fraction of their key cached on arrival,
``g = 0 if hit == 0 else ceil(10 hit) - 1``. Groups are visited round-robin starting from group
9 (the most cached); a visit to group ``g`` admits at most ``(g + 1) x 10`` requests, first come
first served within the group, then moves on (a visit can span steps while the token budget is
full). Prefill is chunked under a token budget and mixed with decoding as in ``fcfs``
(:mod:`engine.scheduler.chunked`); the prefix cache evicts LRU. No SLO awareness.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator

from engine.scheduler.base import Refusal, SchedView
from engine.scheduler.chunked import chunked_step, step_chunk_tokens
from engine.scheduler.state import PrefillUnit, ReqState, SchedulerConfig, StepPlan

GROUPS = 10


def hit_group(hit_ratio: float) -> int:
    """Preble's group of a request whose key is ``hit_ratio`` cached (0..1)."""
    if hit_ratio <= 0:
        return 0
    return min(max(math.ceil(GROUPS * hit_ratio) - 1, 0), GROUPS - 1)


def group_quota(group: int) -> int:
    """Requests a visit to ``group`` may admit."""
    return (group + 1) * 10


class PreblePolicy:
    name = "preble"
    # by cache-hit group, first come first served within each; nothing is due sooner or
    # rejected for its SLO, so to a router it is an arrival-order queue
    queue_order = "arrival"
    caches_chunks = True  # (SGLang's radix cache keeps a chunked request's computed prefix)

    def __init__(self) -> None:
        self.group = GROUPS - 1  # the group being visited
        self.left = group_quota(self.group)  # admissions left in this visit

    def check_submit(self, view: SchedView, st: ReqState, now: float) -> Refusal | None:
        return None

    def prompt_chunk_tokens(self, config: SchedulerConfig) -> int | None:
        return step_chunk_tokens(config)

    def plan(self, view: SchedView, now: float) -> StepPlan:
        return chunked_step(view, now, self._order(view))

    def preempts(self, view: SchedView, st: ReqState, running: PrefillUnit, now: float) -> bool:
        return False

    def _order(self, view: SchedView) -> Iterator[ReqState]:
        """Waiting requests in the order the round robin admits them.

        A visit's quota is spent only when the consumer asks for the next request (it admitted
        the last one); when the consumer stops, the visit stays where it is for the next step.
        """
        groups: list[deque[ReqState]] = [deque() for _ in range(GROUPS)]
        for st in view.waiting:
            groups[hit_group(st.hit_ratio)].append(st)
        while True:  # each round admits from some non-empty group, so this ends
            queue = groups[self.group]
            while self.left > 0 and queue:
                yield queue.popleft()
                self.left -= 1
            if not any(groups):
                return
            self.group = (self.group - 1) % GROUPS
            self.left = group_quota(self.group)
