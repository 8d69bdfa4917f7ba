"""The books a scheduling policy reads and writes, kept once for every engine that runs one.

kvgate's simulated engine (:class:`engine.core.EngineCore`) and the scheduler plug-in for a real
vLLM (:mod:`kvgate.vllm`) both subclass :class:`SchedBook`, so the same policy objects
(:mod:`engine.scheduler.slo` and the others) decide on the same state in both:

* the three queues a :class:`~engine.scheduler.base.SchedView` shows (waiting, prefilling,
  decoding) and the move of a request from waiting to prefilling;
* SCORPIO's ledger of the admitted requests' TPOT SLOs and mean contexts (what VBS admission
  reads through :meth:`admitted_tpot_stats`);
* prefill units (:meth:`make_unit`, costed on the cost profile, predicted by FlowPrefill's cubic)
  and the switch from one unit to the next (who is paused, who resumes).

What differs stays in the subclasses: where KV memory lives and whether a request fits
(``admissible``/``admit``), how a refusal reaches the client (``reject``), and how time passes
(a simulated timeline, or vLLM's own steps). Pure: no clock, no I/O.
"""

from __future__ import annotations

from broker.events import LoadHeartbeat
from engine.costs import cached_predictor, prefill_batch_ms
from engine.scheduler.base import Policy
from engine.scheduler.state import Phase, PrefillUnit, ReqState, SchedulerConfig
from kvgate.cost_model import CostProfile, OutputFit


class SchedBook:
    """Queues, SCORPIO's ledger and prefill units (a SchedView without its KV half)."""

    policy: Policy  # the subclass's: what decides each step

    def __init__(self, profile: CostProfile, config: SchedulerConfig) -> None:
        self.profile = profile
        self.config = config
        self.predict = cached_predictor(profile, config.predictor_max_tokens)
        self.waiting: list[ReqState] = []
        self.prefilling: list[ReqState] = []
        self.decoding: list[ReqState] = []
        # Admitted requests' TPOT SLOs, for SCORPIO's VBS: ms -> count, sum 1/ms, sum contexts.
        self._tpot_counts: dict[float, int] = {}
        self._inv_tpot_sum = 0.0
        self._ctx_sum = 0.0
        self._admitted = 0
        self._running_unit: PrefillUnit | None = None  # the unit the last step ran
        # decode steps since the last heartbeat: [count, ms, batch, mean context] (what routers
        # fit the engine's real decode speed from: broker.events.LoadHeartbeat)
        self._decode_stats = [0, 0.0, 0.0, 0.0]
        # how long answers are against their stated caps (max_tokens): what VBS admission
        # plans a new request's context on (a cap taken at its word made admission refuse
        # decode places to answers that end far below it)
        self.output_fit = OutputFit()

    def plan_output(self, st: ReqState) -> None:
        """Set the answer's length ``st`` is planned on (before it joins any ledger)."""
        st.planned_out = self.output_fit.expected(st.req.stated_tokens)

    def answer_ended(self, st: ReqState) -> None:
        """``st``'s answer ended by itself (EOS or its cap; not cut short by the client)."""
        self.output_fit.observe(st.req.stated_tokens, st.generated)

    # ------------------------------------------------------------------ what policies read

    @property
    def running(self) -> int:
        """Admitted requests (prefilling, preempted or decoding)."""
        return self._admitted

    @property
    def vbs(self) -> float:
        """SCORPIO's virtual batch size over admitted requests: sum of T_min / TPOT_SLO."""
        if not self._tpot_counts:
            return 0.0
        return min(self._tpot_counts) * self._inv_tpot_sum

    def admitted_tpot_stats(self) -> tuple[float | None, float, float, int]:
        tmin = min(self._tpot_counts) if self._tpot_counts else None
        return tmin, self._inv_tpot_sum, self._ctx_sum, self._admitted

    def make_unit(self, pieces: list[tuple[ReqState, int]], *, preemptible: bool) -> PrefillUnit:
        full = [
            (st, n, min(st.cached_tokens, st.req.input_tokens - 1) + st.prefilled)
            for st, n in pieces
        ]
        unit = PrefillUnit(
            pieces=full,
            total_ms=prefill_batch_ms(self.profile, [(n, c) for _, n, c in full]),
            pred_ms=self.predict(sum(n for _, n, _ in full)),
            ops_total=2 * self.config.layers,
            preemptible=preemptible,
        )
        for st, _, _ in full:
            st.unit = unit
        return unit

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to prefill: every waiting request's, and what admitted ones have
        left."""
        return sum(st.prefill_tokens for st in self.waiting) + sum(
            st.remaining_prefill for st in self.prefilling
        )

    # ------------------------------------------------------------------ load reports

    def _note_decode_step(self, ms: float, batch: int, mean_context: float) -> None:
        ds = self._decode_stats
        ds[0] += 1
        ds[1] += ms
        ds[2] += batch
        ds[3] += mean_context

    def _load_heartbeat(
        self,
        url: str,
        models: tuple[str, ...],
        *,
        kv_blocks_used: int,
        kv_blocks_total: int,
        kv_blocks_held: int | None = None,
        role: str = "both",
        profile: str | None = None,
        prefill_ms: float | None = None,
        prefill_plan_ms: float | None = None,
    ) -> LoadHeartbeat:
        """The load now; the decode-step figures cover the steps since the previous heartbeat
        (the prefill ones are the caller's: only it knows how far a running step has got)."""
        queued = self.queued_prefill_tokens()
        steps, ms, batch, ctx = self._decode_stats
        self._decode_stats = [0, 0.0, 0.0, 0.0]  # each heartbeat reports the steps since
        return LoadHeartbeat(
            waiting=len(self.waiting),
            running=self._admitted,
            queued_prefill_tokens=queued,
            kv_blocks_used=kv_blocks_used,
            kv_blocks_total=kv_blocks_total,
            kv_blocks_held=kv_blocks_held,
            vbs=self.vbs,
            profile=profile or self.profile.name,
            url=url,
            models=models,
            decode_step_ms=ms / steps if steps else None,
            decode_batch=batch / steps if steps else None,
            decode_context=ctx / steps if steps else None,
            role=role,
            prefill_ms=prefill_ms,
            prefill_plan_ms=prefill_plan_ms,
            queue_order=self.policy.queue_order,
            prefill_chunk_tokens=self.policy.prompt_chunk_tokens(self.config),
        )

    # ------------------------------------------------------------------ bookkeeping

    def _enter_prefill(self, st: ReqState) -> None:
        """``st`` was admitted: waiting -> prefilling, and its TPOT SLO joins the ledger."""
        st.move(Phase.PREFILLING)
        self.waiting.remove(st)
        self.prefilling.append(st)
        self._enter_ledger(st)

    def _enter_ledger(self, st: ReqState) -> None:
        """``st`` holds admission now: its TPOT SLO and mean context count for VBS."""
        t = st.req.slo.tpot_ms
        self._tpot_counts[t] = self._tpot_counts.get(t, 0) + 1
        self._inv_tpot_sum += 1.0 / t
        self._ctx_sum += st.mean_context
        self._admitted += 1

    def _leave_ledger(self, st: ReqState) -> None:
        """An admitted ``st`` is gone (finished, cancelled, evicted): its share of the ledger."""
        t = st.req.slo.tpot_ms
        left = self._tpot_counts[t] - 1
        if left:
            self._tpot_counts[t] = left
        else:
            del self._tpot_counts[t]
        self._inv_tpot_sum = max(self._inv_tpot_sum - 1.0 / t, 0.0) if self._tpot_counts else 0.0
        self._ctx_sum = max(self._ctx_sum - st.mean_context, 0.0) if self._tpot_counts else 0.0
        self._admitted -= 1

    def _switch_unit(self, unit: PrefillUnit | None) -> list[ReqState]:
        """The next step runs ``unit``: the members of the previous unit, if it is left unfinished,
        are paused (returned, in order), and ``unit``'s paused members resume."""
        paused: list[ReqState] = []
        prev = self._running_unit
        if prev is not None and prev is not unit and prev.ops_left > 0:
            for st in prev.live():
                if st.phase is Phase.PREFILLING:
                    st.move(Phase.PREEMPTED)
                    paused.append(st)
        if unit is not None:
            for st in unit.live():
                if st.phase is Phase.PREEMPTED:
                    st.move(Phase.PREFILLING)
        self._running_unit = unit
        return paused
