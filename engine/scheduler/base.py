"""The one small interface every scheduling policy implements, and what the core shows it.

A policy decides *what runs* in the next step (:meth:`Policy.plan`), whether a new arrival is
refused outright (:meth:`Policy.check_submit`) and whether it should interrupt the running
prefill (:meth:`Policy.preempts`). *How long* a step takes comes from the cost profile and
*when* it ends is the core's business (:mod:`engine.core`): policies never see a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from broker.events import RequestRejected
from engine.costs import TtftPredictor
from engine.scheduler.state import PrefillUnit, ReqState, SchedulerConfig, StepPlan
from kvgate.cost_model import CostProfile

# Why an engine refused a request, as the end of its message says it (the message is for people;
# :func:`refusal_cause` reads the cause back from it, for ``kvgate bench records``). Refused at
# arrival: its prefill alone, or one decode step of it alone, cannot meet its SLO there, or it
# needs more KV blocks than the engine has. Refused while it waited (S-EDF): behind requests due
# sooner, for a place in the decode batch (SCORPIO's TPOT guard), or for KV memory; or its
# prefill was paused for requests due sooner and can no longer make its deadline.
AT_ARRIVAL_TTFT = "cannot be met: prefilling"
AT_ARRIVAL_TPOT = "cannot be met: one decode step"
TOO_BIG = "KV blocks ("
WAITED_BEHIND = " behind higher-priority requests"
WAITED_FOR = {
    "vbs": " while waiting for decode capacity (TPOT guard)",
    "kv": " while waiting for KV memory",
}
PAUSED = "its prefill was paused for requests due sooner"
REFUSAL_CAUSES = {
    "paused": PAUSED,
    "decode_capacity": WAITED_FOR["vbs"],
    "kv_memory": WAITED_FOR["kv"],
    "queued": WAITED_BEHIND,
    "arrival_ttft": AT_ARRIVAL_TTFT,
    "arrival_tpot": AT_ARRIVAL_TPOT,
    "too_big": TOO_BIG,
}


def refusal_cause(message: str) -> str:
    """The cause (a key of :data:`REFUSAL_CAUSES`) of a refusal whose message kvgate's engine
    wrote; ``other`` for any other text (another engine's, or a transport error)."""
    for cause, fragment in REFUSAL_CAUSES.items():
        if fragment in message:
            return cause
    return "other"


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a policy refuses a request at once: ``reason`` for the client and the logs, the rest
    for the router (:class:`broker.events.RequestRejected`: the engine's own time for the
    request's prefill alone, or for one decode step of it alone, and the tokens it is for)."""

    reason: str
    cause: str = ""
    estimate_ms: float = 0.0
    estimate_tokens: int = 0

    def event(self, request_id: str) -> RequestRejected:
        """The refusal of ``request_id`` as the engine reports it."""
        return RequestRejected(
            request_id, self.reason, self.cause, self.estimate_ms, self.estimate_tokens
        )


class SchedView(Protocol):
    """The engine state a policy reads, and the few actions it may take (the core implements)."""

    profile: CostProfile
    config: SchedulerConfig
    predict: TtftPredictor
    waiting: list[ReqState]  # in arrival order
    prefilling: list[ReqState]  # admitted, prompt not fully prefilled, in admission order
    decoding: list[ReqState]  # in order of their first token

    def admissible(self, st: ReqState) -> bool:
        """Whether ``st`` fits in KV memory and the running limit now (no side effects)."""
        ...

    def admit(self, st: ReqState, now: float) -> bool:
        """Reserve KV for ``st`` and move it waiting -> prefilling; False if it does not fit."""
        ...

    def refresh_cached(self, st: ReqState) -> None:
        """Re-read a waiting request's cached prefix from the cache as it is now: its estimate
        dates from its arrival, and the request that prefills a shared prefix may have stored
        it since (no change where the engine cannot tell)."""
        ...

    def pending_prefix(self, st: ReqState) -> int:
        """Key blocks of a waiting request, past what the cache holds of it now, that an
        admitted request is prefilling (they are cached once it is done; 0 where the engine
        cannot tell)."""
        ...

    def reject(self, st: ReqState, reason: str, now: float) -> None:
        """Refuse a waiting request, or a paused one that has no token out yet (it gets a 429
        with ``reason``; a paused one gives back its KV and its place in the VBS ledger)."""
        ...

    def make_unit(self, pieces: list[tuple[ReqState, int]], *, preemptible: bool) -> PrefillUnit:
        """A prefill unit of ``(request, new_tokens)`` pieces, costed from the profile; each piece
        continues where its request's prefill stopped (its context includes the cached prefix)."""
        ...

    def admitted_tpot_stats(self) -> tuple[float | None, float, float, int]:
        """Over admitted requests: (tightest TPOT SLO ms or None, sum of 1/TPOT SLO,
        sum of mean contexts, count), for SCORPIO's VBS."""
        ...


class Policy(Protocol):
    """A scheduling policy; ``name`` is its registry key and its file name; ``queue_order``
    the order it serves prefill in, as heartbeats announce it to routers
    (:data:`broker.events.QUEUE_ORDERS`)."""

    name: str
    queue_order: str
    # whether a prompt's blocks are cached chunk by chunk as its prefill computes them (vLLM,
    # SGLang) or only once the whole prefill is done
    caches_chunks: bool

    def check_submit(self, view: SchedView, st: ReqState, now: float) -> Refusal | None:
        """Why ``st`` is refused at once, or None to queue it."""
        ...

    def prompt_chunk_tokens(self, config: SchedulerConfig) -> int | None:
        """The most new tokens of one prompt it prefills in one piece (None: whole prompts),
        as heartbeats announce it to routers: each piece attends to the ones before it, so a
        long prompt costs more chunked (:meth:`kvgate.cost_model.CostProfile.prompt_prefill_ms`)."""
        ...

    def plan(self, view: SchedView, now: float) -> StepPlan:
        """The next step (an empty plan when there is nothing to run)."""
        ...

    def preempts(self, view: SchedView, st: ReqState, running: PrefillUnit, now: float) -> bool:
        """Whether the new arrival ``st`` should interrupt ``running`` at its next operator
        boundary."""
        ...
