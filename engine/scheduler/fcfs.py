"""``fcfs``: the vLLM-like baseline.

First come, first served admission; chunked prefill under a token budget mixed with decoding
(:mod:`engine.scheduler.chunked`); every decoding request decodes every step; no SLO awareness:
nothing is rejected for its SLO and nothing is preempted.
"""

from __future__ import annotations

from engine.scheduler.base import Refusal, SchedView
from engine.scheduler.chunked import chunked_step, step_chunk_tokens
from engine.scheduler.state import PrefillUnit, ReqState, SchedulerConfig, StepPlan


class FcfsPolicy:
    name = "fcfs"
    queue_order = "arrival"
    caches_chunks = True  # (vLLM caches a chunk's full blocks when it schedules it)

    def check_submit(self, view: SchedView, st: ReqState, now: float) -> Refusal | None:
        return None

    def prompt_chunk_tokens(self, config: SchedulerConfig) -> int | None:
        return step_chunk_tokens(config)

    def plan(self, view: SchedView, now: float) -> StepPlan:
        return chunked_step(view, now, list(view.waiting))

    def preempts(self, view: SchedView, st: ReqState, running: PrefillUnit, now: float) -> bool:
        return False
