"""The request state machine and the data the scheduling policies work on.

Phases and the only legal moves between them (one table, checked on every move)::

    waiting ----> prefilling <----> preempted
       |              |                 |
       v              v                 |
    rejected      decoding --> finished <+   (any live phase -> finished: done or cancelled)

An illegal move raises :class:`TransitionError` naming the request and the move, so a policy bug
shows up where it happens instead of as a wrong number in a benchmark.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.slo import Slo


class Phase(enum.Enum):
    WAITING = "waiting"  # queued; holds no KV
    PREFILLING = "prefilling"  # admitted (holds KV); its prefill unit is running or next
    PREEMPTED = "preempted"  # admitted; its unit was paused for a higher-priority one
    DECODING = "decoding"  # first token produced; generating the rest
    FINISHED = "finished"  # all tokens produced, or cancelled by the client
    REJECTED = "rejected"  # refused (SLO cannot be met, or too large for this engine)


TRANSITIONS: frozenset[tuple[Phase, Phase]] = frozenset(
    {
        (Phase.WAITING, Phase.PREFILLING),
        (Phase.WAITING, Phase.REJECTED),
        (Phase.WAITING, Phase.FINISHED),  # cancelled while queued
        (Phase.PREFILLING, Phase.PREEMPTED),
        (Phase.PREEMPTED, Phase.PREFILLING),
        (Phase.PREFILLING, Phase.DECODING),
        (Phase.PREFILLING, Phase.FINISHED),  # one-token output, or cancelled
        (Phase.PREEMPTED, Phase.FINISHED),  # cancelled
        (Phase.PREEMPTED, Phase.REJECTED),  # paused past its deadline (slo: abandon_late)
        (Phase.DECODING, Phase.FINISHED),
    }
)
ADMITTED = frozenset({Phase.PREFILLING, Phase.PREEMPTED, Phase.DECODING})


class TransitionError(RuntimeError):
    """A request was moved along an edge the state machine does not have."""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as the engine core sees it (token counts already decided by the caller)."""

    request_id: str
    key: bytes
    input_tokens: int
    output_tokens: int
    slo: Slo
    arrival: float
    # disaggregation: the prompt's KV came from a prefill engine, taking this long (reported
    # in its FirstToken, for the routers' fit of the link)
    kv_transfer_ms: float | None = None
    kv_transfer_tokens: int | None = None
    # what its answer adds to the key of the conversation's next turn (the simulated model's
    # output as that turn resends it); b"": unknown, and bytes of its own stand for it. Cached
    # when it finishes, as real engines cache a finished request's output tokens. Or a
    # function that makes it, called once when it finishes: a long answer's text is then made
    # only if the answer ends, not on arrival (which held the live engine's loop for seconds)
    answer_key: bytes | Callable[[], bytes] = b""
    # the cap the client stated (its max_tokens; None: ``output_tokens``): all a real
    # scheduler knows of the answer's length before it ends. ``output_tokens`` is where the
    # simulated model ends it (its EOS), which the scheduler does not plan on
    max_tokens: int | None = None

    @property
    def stated_tokens(self) -> int:
        """The answer's length as the client stated it (its cap)."""
        return self.max_tokens or self.output_tokens


@dataclass(slots=True, eq=False)
class ReqState:
    """Everything the scheduler tracks about one request (mutable; owned by the core)."""

    req: EngineRequest
    seq: int  # arrival order, the tie-break everywhere
    hashes: list[int]  # chain hashes of the key's full blocks
    private_blocks: int  # KV blocks beyond the key blocks (output, tail)
    cached_tokens: int  # prompt tokens served from the prefix cache (estimate until admitted)
    hit_ratio: float  # cached fraction of the key on arrival (Preble's grouping)
    phase: Phase = Phase.WAITING
    prefilled: int = 0  # new (uncached) prompt tokens already prefilled
    unit: PrefillUnit | None = None  # the prefill unit it belongs to while prefilling/preempted
    generated: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    credit: float = 0.0  # SCORPIO's decode credit
    # the answer's length the scheduler plans on (set at submit from the stated cap and what
    # answers under such caps took: SchedBook.plan_output; 0: the stated cap)
    planned_out: int = 0
    blocked_by: str = ""  # why it last waited although it was the best candidate (vbs, kv)

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def deadline(self) -> float:
        """Absolute TTFT deadline (s): arrival + TTFT SLO."""
        return self.req.arrival + self.req.slo.ttft_ms / 1000.0

    @property
    def prefill_tokens(self) -> int:
        """New tokens to prefill: the prompt minus its cached prefix, at least one."""
        return max(self.req.input_tokens - self.cached_tokens, 1)

    @property
    def remaining_prefill(self) -> int:
        return self.prefill_tokens - self.prefilled

    @property
    def context(self) -> int:
        """Tokens in its KV now (prompt plus what it generated)."""
        return self.req.input_tokens + self.generated

    @property
    def mean_context(self) -> float:
        """Its context averaged over its decode life (SCORPIO's L for admission), on the
        answer's planned length (the scheduler does not know where it will end)."""
        return self.req.input_tokens + (self.planned_out or self.req.stated_tokens) / 2.0

    def move(self, to: Phase) -> None:
        if (self.phase, to) not in TRANSITIONS:
            raise TransitionError(
                f"request {self.request_id}: illegal move {self.phase.value} -> {to.value}"
            )
        self.phase = to


@dataclass(slots=True, eq=False)
class PrefillUnit:
    """One prefill batch: ``pieces`` of ``(request, new_tokens, context_tokens)``.

    Executed as ``ops_total`` equal operators (layers x {attention, MLP}); preemptible at operator
    boundaries when ``preemptible``. ``pred_ms`` is what the scheduler predicted, ``total_ms``
    what it costs.
    """

    pieces: list[tuple[ReqState, int, int]]
    total_ms: float
    pred_ms: float
    ops_total: int
    preemptible: bool
    ops_done: int = 0

    @property
    def op_ms(self) -> float:
        return self.total_ms / self.ops_total

    @property
    def executed_ms(self) -> float:
        return self.ops_done * self.op_ms

    @property
    def ops_left(self) -> int:
        return self.ops_total - self.ops_done

    @property
    def tokens(self) -> int:
        return sum(n for _, n, _ in self.pieces)

    def live(self) -> list[ReqState]:
        """Members still waiting for this unit (a cancelled one drops out)."""
        return [st for st, _, _ in self.pieces if st.unit is self]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one engine step runs: a decode batch, then ``prefill_ops`` operators of a unit."""

    decode: list[ReqState] = field(default_factory=list)
    unit: PrefillUnit | None = None
    prefill_ops: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduler knobs (defaults from FlowPrefill, SCORPIO and vLLM as cited)."""

    token_budget: int = 4096  # FlowPrefill's batch token budget G (4K reported best)
    min_slack_frac: float = 0.1  # batch only while H keeps >= this x its TTFT SLO in hand
    layers: int = 32  # operators per prefill = 2 x layers (attention, MLP)
    chunk_tokens: int = 8192  # slo: prompts longer than this prefill in chunks (FlowPrefill 8K)
    reject_infeasible: bool = True  # slo: reject waiting requests whose TTFT can't be met
    # slo, with reject_infeasible: also reject paused (preempted) prefills whose TTFT can't be
    # met (in vLLM: aborted, their blocks freed)
    abandon_late: bool = True
    tpot_guard: float = 0.9  # slo: a step lasts at most this x the tightest decoding TPOT
    vbs_safety: float = 1.3  # SCORPIO: EstTPOT(VBS', L') x 1.3 < 0.99 x T_min'
    vbs_margin: float = 0.99
    chunked_budget: int = 2048  # fcfs/preble: tokens per step (vLLM's online default)
    stream_outputs: bool = True  # emit an Output per token batch (off: first/finish/reject)
    predictor_max_tokens: int = 32768  # range the cubic TTFT predictor is fit over

    def __post_init__(self) -> None:
        for name in ("token_budget", "layers", "chunk_tokens", "chunked_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 < self.tpot_guard <= 1:
            raise ValueError("tpot_guard must be in (0, 1]")
