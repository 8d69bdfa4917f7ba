"""The step shared by the throughput-first baselines (fcfs, preble): vLLM-style chunked prefill.

Every step decodes one token for *every* decoding request and fills the rest of a token budget
(``config.chunked_budget``; each decode token counts against it, as in vLLM) with prefill
chunks: first the admitted requests whose prompts are partly prefilled, in admission order, then
newly admitted ones in the order the policy gives. Admission stops at the first request that
does not fit (head-of-line blocking, as in vLLM's FCFS waiting queue). Chunks run whole: these
baselines never preempt.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.scheduler.base import SchedView
from engine.scheduler.state import ReqState, SchedulerConfig, StepPlan


def step_chunk_tokens(config: SchedulerConfig) -> int:
    """The most new tokens of one prompt a step prefills: the step's token budget (at most:
    the decode tokens share it), what the baselines announce to routers."""
    return config.chunked_budget


def chunked_step(view: SchedView, now: float, order: Iterable[ReqState]) -> StepPlan:
    """One mixed decode + chunked-prefill step, admitting new requests from ``order``."""
    decode = list(view.decoding)
    budget = step_chunk_tokens(view.config) - len(decode)
    pieces: list[tuple[ReqState, int]] = []
    for st in view.prefilling:
        if budget <= 0:
            break
        if st.unit is None and st.remaining_prefill > 0:
            n = min(st.remaining_prefill, budget)
            pieces.append((st, n))
            budget -= n
    if budget > 0:
        for st in order:
            if not view.admit(st, now):
                st.blocked_by = "kv"
                break
            n = min(st.remaining_prefill, budget)
            pieces.append((st, n))
            budget -= n
            if budget <= 0:
                break
    unit = view.make_unit(pieces, preemptible=False) if pieces else None
    return StepPlan(decode, unit, unit.ops_total if unit else 0)
