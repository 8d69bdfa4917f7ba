"""``slo`` (default): FlowPrefill's prefill scheduling with SCORPIO's TPOT guard for decode.

Prefill (FlowPrefill, arXiv 2602.16603), event-driven: a decision at every step boundary, which
includes every arrival-triggered preemption and every prefill completion.

* S-EDF: ``deadline = arrival + TTFT_SLO``;
  ``slack = (deadline - now) - max(pred_ttft(tokens) - executed, 0) / share``, ``share`` the
  part of each step prefill gets beside the decode batch (see *Sharing the GPU* below);
  ``priority = sign(slack) / deadline``, highest first: feasible requests earliest deadline
  first, infeasible ones after them (latest deadline first, as the formula orders negatives).
  With ``reject_infeasible`` (default) a *waiting* request is rejected once it could no longer
  make its deadline even at full speed (rejection is final; the decode batch may drain), its
  cached prefix re-read first (one queued behind the request prefilling a shared prefix finds
  it cached); with ``abandon_late`` (default) so is a *paused* prefill (preempted, no token
  out yet) once none of its batch could make its deadline: late work ranks last, so every
  feasible arrival overtook it and it was served seconds late while holding its KV. A late
  prefill that is running finishes (it runs only when nothing feasible waits).
* SLO-aware batching: around the head H (the best admissible waiting request), add waiting
  requests in priority order while the batch's new tokens stay within G (``token_budget``) and
  ``time_left(H) - pred_ttft(total) / share >= min_slack_frac x TTFT_SLO(H)``; no batching when H
  alone exceeds G or has less than that fraction of its SLO in hand.
* Preemption: a prefill batch runs as ``2 x layers`` equal operators; an arrival with a higher
  priority cuts it at the next operator boundary; the paused batch keeps its progress and
  resumes from there when it is again the best unit.
* Chunked prefill: prompts longer than ``chunk_tokens`` prefill one chunk at a time, each chunk
  its own unit (a chunk after the first sees the earlier ones as context); a unit takes fewer
  tokens where one of its operators would not fit beside the admitted batch's decode step
  (:meth:`SloPolicy._chunk_cap`).
* A shared prefix is prefilled once: a waiting request whose next key blocks an admitted request
  is prefilling (``SchedView.pending_prefix``) is neither started, nor batched with it, nor let
  preempt it while it can still make its deadline; it starts once they are stored and finds
  them cached (SGLang deprioritizes such requests within a batch the same way). Without it a
  burst of one new prefix prefilled it several times over, in one batch or by preemption
  (``programming``, 16 engines at the knee: 750 blocks computed twice under ``cache_aware``,
  1,000 under round robin).
* TTFT predictor: the cubic fit of :class:`engine.costs.TtftPredictor`.

Decode (SCORPIO, arXiv 2505.23022):

* credits: each step every decoding request adds ``TRP = T_min / TPOT_SLO`` (T_min the tightest
  TPOT SLO decoding); those with credit >= 1 join the batch and pay 1, so the tightest class
  decodes every step and a request's decode share converges to its TRP;
* VBS admission: a waiting request may start only if ``EstTPOT(VBS', L') x 1.3 < 0.99 x T_min'``
  over the admitted requests plus it, ``VBS' = sum TRP``, ``EstTPOT = profile.decode_step_ms``,
  ``L'`` the mean of ``input + output/2``; otherwise it waits (and is rejected once its TTFT
  can no longer be met).

Sharing the GPU: a step is one decode iteration (the credit batch) followed by a slice of the
chosen prefill unit; while anything decodes, the slice is cut to whole operators so that the
step lasts at most ``tpot_guard x T_min`` (at least one operator), which keeps every decoding
request within its TPOT SLO when VBS admission holds.
"""

from __future__ import annotations

import math

from engine.scheduler.base import (
    AT_ARRIVAL_TPOT,
    AT_ARRIVAL_TTFT,
    PAUSED,
    WAITED_BEHIND,
    WAITED_FOR,
    Refusal,
    SchedView,
)
from engine.scheduler.state import Phase, PrefillUnit, ReqState, SchedulerConfig, StepPlan
from kvgate.cost_model import prefill_share

Key = tuple[int, float, int]
MIN_CHUNK_TOKENS = 256  # a prefill unit takes at least this many tokens (or its whole prompt)


class SloPolicy:
    name = "slo"
    queue_order = "deadline"  # S-EDF; a request that can no longer make it is rejected
    # a prompt's blocks are cached when its prefill completes (a chunk may be preempted and
    # other prefills overtake it; per-chunk caching not measured on this scheduler yet)
    caches_chunks = False

    # ------------------------------------------------------------------ interface

    def prompt_chunk_tokens(self, config: SchedulerConfig) -> int | None:
        return config.chunk_tokens

    def check_submit(self, view: SchedView, st: ReqState, now: float) -> Refusal | None:
        pred_ms = view.predict(min(st.prefill_tokens, view.config.chunk_tokens))
        pred_ms += view.predict(max(st.prefill_tokens - view.config.chunk_tokens, 0))
        slo = st.req.slo
        if now + pred_ms / 1000.0 > st.deadline:
            return Refusal(
                f"TTFT SLO of {slo.ttft_ms:g} ms {AT_ARRIVAL_TTFT} "
                f"{st.prefill_tokens} uncached prompt tokens alone takes about {pred_ms:.0f} ms "
                "on this engine",
                "ttft",
                pred_ms,
                st.prefill_tokens,
            )
        cfg = view.config
        step_ms = self._lone_step_ms(view, st)
        if step_ms * cfg.vbs_safety >= cfg.vbs_margin * slo.tpot_ms:
            return Refusal(
                f"TPOT SLO of {slo.tpot_ms:g} ms {AT_ARRIVAL_TPOT} of this request "
                f"alone takes about {step_ms:.1f} ms (x{cfg.vbs_safety:g} safety) on this engine",
                "tpot",
                step_ms,
                round(st.mean_context),
            )
        return None

    def min_tpot_ms(self, view: SchedView, st: ReqState) -> float:
        """The tightest TPOT SLO VBS admission can ever grant ``st`` on this engine (alone in
        the batch): below it, :meth:`check_submit` refuses the request."""
        cfg = view.config
        return self._lone_step_ms(view, st) * cfg.vbs_safety / cfg.vbs_margin

    def _lone_step_ms(self, view: SchedView, st: ReqState) -> float:
        return view.profile.decode_step_ms(1, st.mean_context)

    def plan(self, view: SchedView, now: float) -> StepPlan:
        if view.config.reject_infeasible:
            self._reject_late(view, now)
        decode, tmin = self._credit_batch(view)
        unit = self._choose_unit(view, now)
        if unit is None:
            return StepPlan(decode, None, 0)
        ops = unit.ops_left
        if tmin is not None:
            mean_ctx = sum(st.context for st in decode) / len(decode) if decode else 0.0
            decode_ms = view.profile.decode_step_ms(len(decode), mean_ctx)
            slice_ms = view.config.tpot_guard * tmin - decode_ms
            if unit.op_ms > 0:
                ops = min(max(math.floor(slice_ms / unit.op_ms), 1), unit.ops_left)
        return StepPlan(decode, unit, ops)

    def preempts(self, view: SchedView, st: ReqState, running: PrefillUnit, now: float) -> bool:
        if not running.preemptible or not self._startable(view, st):
            return False
        stretch = self._stretch(view)
        key = self._key(view, st, now, stretch)
        if key[0] == 0 and view.pending_prefix(st):
            return False  # what it would interrupt is prefilling its prefix
        return key < self._unit_key(view, running, now, stretch)

    # ------------------------------------------------------------------ priorities

    def _stretch(self, view: SchedView) -> float:
        """Wall time per ms of prefill while the decode batch runs beside it: each step is one
        decode iteration (on average the credit batch, ``VBS = T_min x sum 1/TPOT``) and then a
        prefill slice, cut so that the step lasts ``tpot_guard x T_min``
        (:func:`kvgate.cost_model.prefill_share`). Slack judged on the lone prefill time let
        S-EDF start requests, and batch them, with slack they did not have: measured in the
        simulator, batches finished just past their head's deadline, all members late."""
        decoding = view.decoding
        if not decoding:
            return 1.0
        tmin = min(st.req.slo.tpot_ms for st in decoding)
        batch = sum(tmin / st.req.slo.tpot_ms for st in decoding)
        mean_ctx = sum(st.context for st in decoding) / len(decoding)
        step_ms = view.profile.decode_step_ms(batch, mean_ctx)
        return 1.0 / prefill_share(step_ms, view.config.tpot_guard * tmin)

    def _key(self, view: SchedView, st: ReqState, now: float, stretch: float) -> Key:
        """Sort key of a waiting request: lower runs first (S-EDF)."""
        slack = st.deadline - now - view.predict(st.prefill_tokens) * stretch / 1000.0
        if slack >= 0:
            return (0, st.deadline, st.seq)
        return (1, -st.deadline, st.seq)

    def _unit_key(self, view: SchedView, unit: PrefillUnit, now: float, stretch: float) -> Key:
        """A unit runs at the priority of its best member."""
        left_ms = max(unit.pred_ms - unit.executed_ms, 0.0)
        best: Key = (2, 0.0, 0)
        for st, n, _ in unit.pieces:
            if st.unit is not unit:
                continue
            after = st.remaining_prefill - n  # chunks still to come after this unit
            slack = st.deadline - now - (left_ms + view.predict(after)) * stretch / 1000.0
            key = (0, st.deadline, st.seq) if slack >= 0 else (1, -st.deadline, st.seq)
            best = min(best, key)
        return best

    def _reject_late(self, view: SchedView, now: float) -> None:
        if view.config.abandon_late:
            self._abandon_late(view, now)
        for st in list(view.waiting):
            pred_ms = view.predict(st.prefill_tokens)
            if st.deadline - now - pred_ms / 1000.0 < 0:
                # its prefix may have been cached since it arrived (a request queued behind
                # the one prefilling a shared prefix): judged on its arrival's estimate, a
                # burst of one new prefix was rejected for a prefill it no longer needed
                view.refresh_cached(st)
                pred_ms = view.predict(st.prefill_tokens)
            if st.deadline - now - pred_ms / 1000.0 < 0:
                waited = (now - st.req.arrival) * 1000.0
                why = WAITED_FOR.get(st.blocked_by, WAITED_BEHIND)
                view.reject(
                    st,
                    f"TTFT SLO of {st.req.slo.ttft_ms:g} ms can no longer be met: queued "
                    f"{waited:.0f} ms{why}, prefill needs about {pred_ms:.0f} ms",
                    now,
                )

    def _abandon_late(self, view: SchedView, now: float) -> None:
        """Reject the members of a paused prefill unit once none of them could make its deadline
        even at full speed: S-EDF ranks late work last, so every feasible arrival overtook it
        and it finished seconds late, holding its KV the while (azure, 16 engines at 1.5x the
        knee: 107 of e2's 113 requests served late had been paused)."""
        paused = {
            id(st.unit): st.unit
            for st in view.prefilling
            if st.phase is Phase.PREEMPTED and st.unit is not None
        }
        for unit in paused.values():
            left_ms = max(unit.pred_ms - unit.executed_ms, 0.0)
            members = [(st, n) for st, n, _ in unit.pieces if st.unit is unit]
            # each member's prefill left: the rest of this unit, then its chunks after it
            if all(
                st.deadline - now - (left_ms + view.predict(st.remaining_prefill - n)) / 1000.0 < 0
                for st, n in members
            ):
                for st, _ in members:
                    view.reject(
                        st,
                        f"TTFT SLO of {st.req.slo.ttft_ms:g} ms can no longer be met: {PAUSED}",
                        now,
                    )

    # ------------------------------------------------------------------ decode

    def _credit_batch(self, view: SchedView) -> tuple[list[ReqState], float | None]:
        if not view.decoding:
            return [], None
        tmin = min(st.req.slo.tpot_ms for st in view.decoding)
        batch = []
        for st in view.decoding:
            st.credit += tmin / st.req.slo.tpot_ms
            if st.credit >= 1.0 - 1e-9:
                st.credit -= 1.0
                batch.append(st)
        return batch, tmin

    def _vbs_ok(self, view: SchedView, st: ReqState) -> bool:
        tmin, inv_sum, ctx_sum, count = view.admitted_tpot_stats()
        t = st.req.slo.tpot_ms
        tmin2 = t if tmin is None else min(tmin, t)
        vbs = tmin2 * (inv_sum + 1.0 / t)
        mean_ctx = (ctx_sum + st.mean_context) / (count + 1)
        cfg = view.config
        return view.profile.decode_step_ms(vbs, mean_ctx) * cfg.vbs_safety < cfg.vbs_margin * tmin2

    def _startable(self, view: SchedView, st: ReqState) -> bool:
        if not self._vbs_ok(view, st):
            st.blocked_by = "vbs"
            return False
        if not view.admissible(st):
            st.blocked_by = "kv"
            return False
        return True

    # ------------------------------------------------------------------ prefill

    def _chunk_cap(self, view: SchedView) -> int:
        """The most new tokens a prefill unit started now may take: ``chunk_tokens``, cut so
        that one of its operators fits beside the decode step of the admitted batch within the
        step budget (``tpot_guard x T_min``), as Sarathi-Serve sizes its chunks. A step runs at
        least one operator: on a profile whose decode is dear per token of context
        (``vllm-cpu-small``) an 8K chunk's operator (55 ms) beside a batch of long contexts ran
        steps past the TPOT SLO that VBS admission had granted every request decoding there."""
        cfg = view.config
        tmin, inv_sum, ctx_sum, count = view.admitted_tpot_stats()
        if tmin is None or count <= 0:
            return cfg.chunk_tokens
        decode_ms = view.profile.decode_step_ms(tmin * inv_sum, ctx_sum / count)
        unit_ms = (cfg.tpot_guard * tmin - decode_ms) * 2 * cfg.layers
        if view.predict(cfg.chunk_tokens) <= unit_ms:
            return cfg.chunk_tokens
        lo, hi = MIN_CHUNK_TOKENS, cfg.chunk_tokens  # the largest n whose unit fits, by halving
        if view.predict(lo) > unit_ms:
            return min(lo, cfg.chunk_tokens)
        while hi - lo > MIN_CHUNK_TOKENS:
            mid = (lo + hi) // 2
            if view.predict(mid) <= unit_ms:
                lo = mid
            else:
                hi = mid
        return lo

    def _choose_unit(self, view: SchedView, now: float) -> PrefillUnit | None:
        stretch = self._stretch(view)
        best_unit: PrefillUnit | None = None
        best_unit_key: Key = (3, 0.0, 0)
        cap: int | None = None  # the same for every chunk made here (none is admitted here)
        for st in view.prefilling:
            unit = st.unit
            if unit is None:  # between chunks: its next chunk becomes a unit of its own
                if cap is None:
                    cap = self._chunk_cap(view)
                unit = view.make_unit([(st, min(st.remaining_prefill, cap))], preemptible=True)
            key = self._unit_key(view, unit, now, stretch)
            if key < best_unit_key:
                best_unit, best_unit_key = unit, key
        keys = {id(r): self._key(view, r, now, stretch) for r in view.waiting}
        ranked = sorted(view.waiting, key=lambda r: keys[id(r)])
        for i, head in enumerate(ranked):
            if keys[id(head)] >= best_unit_key:
                break  # the best paused or running unit outranks every waiting request left
            if keys[id(head)][0] == 0 and view.pending_prefix(head):
                continue  # its prefix is being prefilled: it will find it cached
            if not self._startable(view, head):
                continue
            return self._batch(view, head, ranked[i + 1 :], now, stretch)
        return best_unit

    def _batch(
        self, view: SchedView, head: ReqState, rest: list[ReqState], now: float, stretch: float
    ) -> PrefillUnit:
        """FlowPrefill's SLO-aware batching around ``head`` (admits every member)."""
        cfg = view.config
        if not view.admit(head, now):  # _startable said it fits; nothing changed since
            raise RuntimeError(f"request {head.request_id} was admissible but admit failed")
        cap = self._chunk_cap(view)
        first = min(head.prefill_tokens, cap)
        pieces = [(head, first)]
        total = first
        budget = min(cfg.token_budget, cap)
        time_left_ms = (head.deadline - now) * 1000.0
        reserve_ms = cfg.min_slack_frac * head.req.slo.ttft_ms
        if total <= budget and time_left_ms - view.predict(total) * stretch >= reserve_ms:
            for st in rest:
                if st.phase is not Phase.WAITING or st.prefill_tokens > cap:
                    continue
                n = total + st.prefill_tokens
                if n > budget or time_left_ms - view.predict(n) * stretch < reserve_ms:
                    continue
                if view.pending_prefix(st):
                    continue  # (the batch, or a request before it, prefills its prefix)
                if not self._startable(view, st) or not view.admit(st, now):
                    continue
                pieces.append((st, st.prefill_tokens))
                total = n
        return view.make_unit(pieces, preemptible=True)
