"""kvgate's engine core: the one object the live server and the simulator both drive.

Pure (no asyncio, clock, sockets or randomness): callers pass ``now`` (seconds) and read back
when the next thing happens. The GPU is simulated from the cost profile; the core keeps the
timeline a real engine would have:

* a *step* is one decode iteration (the policy's decode batch: ``profile.decode_step_ms(B, L)``)
  followed by some operators of one prefill unit (``engine.costs.prefill_batch_ms``, split into
  ``2 x layers`` equal operators); step time is the sum (no discount for fusing them, which
  makes mixed steps slightly pessimistic). A step's results (one token per decoded request, the
  first token of every prefill it completes) are released together when it ends, as an engine
  returns a step's sampled tokens together;
* :meth:`EngineCore.submit` queues a request (or rejects it at once) and may cut the running
  step at the next operator boundary (preemption), so callers re-read
  :meth:`EngineCore.next_event_time` after every call;
* :meth:`EngineCore.advance` completes every step due by ``now`` and plans the next one, which
  starts where the last one ended (the timeline never absorbs a late caller's lag); after idle
  time the next step starts at ``now``;
* what happened comes back as :class:`Output` s (per request: tokens with their times, first
  token, finish with usage, rejection) and as :mod:`broker.events` payloads
  (:meth:`EngineCore.drain_events`) for the engine reporter.

Usage accounting: ``cached_tokens`` is the prompt's cached prefix when its prefill started,
in tokens ``matched_bytes x input_tokens // key_bytes`` (so a trace's stated token counts scale
it), at most ``input_tokens - 1`` (the last prompt token is always computed, as in vLLM).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

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
from engine.costs import prefill_batch_ms
from engine.prefix_cache import PrefixCache
from engine.scheduler import Refusal, make_policy
from engine.scheduler.base import TOO_BIG
from engine.scheduler.book import SchedBook
from engine.scheduler.state import (
    EngineRequest,
    Phase,
    PrefillUnit,
    ReqState,
    SchedulerConfig,
)
from kvgate.cost_model import CostProfile, announced_profile

__all__ = ["EngineCore", "EngineRequest", "Output", "SchedulerConfig", "Usage"]

_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class Usage:
    """A finished request's accounting (OpenAI usage plus its measured latencies)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_ms: float
    tpot_ms: float
    slo_class: str = ""
    slo_met: bool = True  # TTFT and mean TPOT (when more than one token) within the SLO


@dataclass(frozen=True, slots=True)
class Output:
    """What happened to one request in one step.

    ``times`` are the production times (s) of output tokens ``index, index + 1, ...`` (index 0 is
    the first token); ``usage`` is set when the request finished with these tokens; ``rejected``
    is the reason when the engine refused it (then no tokens ever come).
    """

    request_id: str
    index: int = 0
    times: tuple[float, ...] = ()
    usage: Usage | None = None
    rejected: str | None = None

    @property
    def first_token(self) -> bool:
        return self.index == 0 and bool(self.times)


@dataclass(slots=True)
class _Step:
    start: float
    decode: list[ReqState]
    decode_ms: float
    unit: PrefillUnit | None
    ops: int
    end: float
    mean_ctx: float = 0.0  # of the decode batch
    plan_op_ms: float = 0.0  # one prefill operator on the announced profile (heartbeats)
    ops_reported: int = 0  # prefill operators already counted in a heartbeat

    @property
    def prefill_start(self) -> float:
        return self.start + self.decode_ms / 1000.0


class EngineCore(SchedBook):
    """One simulated engine: prefix cache, scheduler and GPU timeline (see module docstring).
    The scheduler's books (queues, SCORPIO's ledger, prefill units) are :class:`SchedBook`'s,
    shared with the vLLM scheduler plug-in."""

    def __init__(
        self,
        engine_id: str,
        profile: CostProfile,
        *,
        policy: str = "slo",
        config: SchedulerConfig | None = None,
        role: str = "both",
        announced: CostProfile | None = None,
    ) -> None:
        super().__init__(profile, config or SchedulerConfig())
        self.engine_id = engine_id
        self.role = role  # announced in heartbeats (broker.events.ROLES)
        # the profile routers know this engine by, when it runs otherwise (the simulator's
        # engine on hardware slower than its type): its heartbeats name it and plan its
        # prefill reports on it
        self.announced = announced or profile
        self.announced_spec = announced_profile(self.announced)  # (a name, or inline JSON)
        self.policy = make_policy(policy)
        self.cache = PrefixCache(profile.kv_blocks, profile.block_bytes)
        self._states: dict[str, ReqState] = {}
        self._step: _Step | None = None
        self._wake: float | None = None
        self._pending: list[Output] = []
        self._pending_at: float | None = None
        self._events: list[Event] = []
        self._seq = 0
        self.finished = 0
        self.rejected = 0
        self.busy_s = 0.0  # time spent in steps (completed ones): the GPU's busy time
        # inter-token latencies as vLLM's histogram counts them (each decoded token: the time
        # since its request's previous token), what a bridge reads an engine's TPOT off
        self.itl_s_total = 0.0
        self.itl_tokens = 0
        # what routers fit this engine's real speed from (broker.events FirstToken): per request
        # in prefill, [execution ms, batch tokens] of its finished prefill units
        self._prefill_work: dict[str, list[float]] = {}
        # prefill operators run since the last heartbeat: [execution ms, announced-profile ms]
        self._prefill_report = [0.0, 0.0]

    # ------------------------------------------------------------------ driving API

    def submit(self, req: EngineRequest, now: float) -> None:
        """Queue ``req`` (arrived at ``req.arrival``), or reject it at once (see Output)."""
        if req.request_id in self._states:
            raise ValueError(f"request id {req.request_id!r} is already in this engine")
        if req.input_tokens < 1 or req.output_tokens < 1:
            raise ValueError("input_tokens and output_tokens must be >= 1")
        p = self.profile
        hashes = self.cache.key_hashes(req.key)
        matched = self.cache.match(hashes)
        need = p.kv_blocks_needed(len(req.key), req.input_tokens, req.output_tokens)
        self._seq += 1
        st = ReqState(
            req=req,
            seq=self._seq,
            hashes=hashes,
            private_blocks=need - len(hashes),
            cached_tokens=self._cached_tokens(req, matched),
            hit_ratio=(matched * p.block_bytes / len(req.key)) if req.key else 0.0,
        )
        self.plan_output(st)
        refusal = None
        if need > p.kv_blocks:
            refusal = Refusal(
                f"request needs {need} {TOO_BIG}{req.input_tokens} prompt + "
                f"{req.output_tokens} output tokens) but this engine has {p.kv_blocks} in all"
            )
        else:
            refusal = self.policy.check_submit(self, st, now)
        if refusal is not None:
            st.move(Phase.REJECTED)
            self._events.append(refusal.event(req.request_id))
            self._push_output(Output(req.request_id, rejected=refusal.reason), now)
            self.rejected += 1
            return
        self._states[req.request_id] = st
        self.waiting.append(st)
        slo = req.slo
        self._events.append(
            RequestEnqueued(
                req.request_id,
                key_bytes=len(req.key),
                cached_bytes=matched * p.block_bytes,
                input_tokens=req.input_tokens,
                max_tokens=req.stated_tokens,
                ttft_slo_ms=slo.ttft_ms,
                tpot_slo_ms=slo.tpot_ms,
            )
        )
        step = self._step
        if step is None:
            self._wake = now if self._wake is None else min(self._wake, now)
        elif (
            step.unit is not None
            and now < step.end
            and self.policy.preempts(self, st, step.unit, now)
        ):
            self._cut(step, now)

    def cancel(self, request_id: str, now: float) -> None:
        """The client went away: drop the request and free what it holds (no Output)."""
        st = self._states.pop(request_id, None)
        if st is None:
            return
        self._prefill_work.pop(request_id, None)
        if st.phase is Phase.WAITING:
            self.waiting.remove(st)
            st.move(Phase.FINISHED)
            self._events.append(
                RequestRejected(request_id, "cancelled by the client before it started")
            )
            return
        if st.phase in (Phase.PREFILLING, Phase.PREEMPTED):
            self.prefilling.remove(st)
            st.unit = None
        elif st.phase is Phase.DECODING:
            self.decoding.remove(st)
        st.move(Phase.FINISHED)
        self._release(st, now)
        if st.first_token_at is None:
            self._events.append(
                RequestRejected(request_id, "cancelled by the client before its first token")
            )
        else:
            usage = self._usage(st)
            self._events.append(
                RequestFinished(request_id, st.generated, usage.ttft_ms, usage.tpot_ms)
            )

    def next_event_time(self) -> float | None:
        """When :meth:`advance` has something to do: the running step's end, a pending
        rejection, or the start of work after idle time; None when idle."""
        times = [t for t in (self._pending_at, self._wake) if t is not None]
        if self._step is not None:
            times.append(self._step.end)
        return min(times) if times else None

    def advance(self, now: float) -> list[Output]:
        """Complete every step due by ``now``, start the next; what happened, in time order."""
        out, self._pending, self._pending_at = self._pending, [], None
        while self._step is not None and self._step.end <= now + _EPS:
            step = self._step
            self._step = None
            self._complete(step, out)
            self._start_step(step.end)
        if self._step is None and self._wake is not None and self._wake <= now + _EPS:
            self._wake = None
            self._start_step(now)
        if self._pending:  # rejections the policy made while planning
            out.extend(self._pending)
            self._pending = []
        return out

    def drain_events(self) -> list[Event]:
        """broker.events payloads since the last call, in the order they happened."""
        out, self._events = self._events, []
        return out

    def heartbeat(
        self, url: str, models: tuple[str, ...], now: float | None = None
    ) -> LoadHeartbeat:
        """The engine's load now; its step figures cover the steps since the previous heartbeat
        (so call it once per heartbeat sent), and with ``now`` the operators a running step has
        done so far (a lone long prefill is one step: its speed shows long before it ends)."""
        step = self._step
        if now is not None and step is not None and step.unit is not None:
            op_s = step.unit.op_ms / 1000.0
            done = (now - step.prefill_start) / op_s if op_s > 0 else 0.0
            self._report_prefill(step, min(max(math.floor(done + _EPS), 0), step.ops))
        ms, plan_ms = self._prefill_report
        self._prefill_report = [0.0, 0.0]
        return self._load_heartbeat(
            url,
            models,
            kv_blocks_used=min(self.cache.used_blocks, self.profile.kv_blocks),
            kv_blocks_total=self.profile.kv_blocks,
            kv_blocks_held=min(self.cache.held_blocks, self.profile.kv_blocks),
            role=self.role,
            profile=self.announced_spec,
            prefill_ms=ms if ms > 0 else None,
            prefill_plan_ms=plan_ms if ms > 0 else None,
        )

    def _report_prefill(self, step: _Step, ops_done: int) -> None:
        """Count ``step``'s prefill operators up to ``ops_done`` for the next heartbeat."""
        unit = step.unit
        new = ops_done - step.ops_reported
        if unit is None or new <= 0:
            return
        step.ops_reported = ops_done
        rep = self._prefill_report
        rep[0] += new * unit.op_ms
        rep[1] += new * step.plan_op_ms

    def receive_kv(self, key: bytes, now: float) -> bool:
        """A prompt's KV arrived from a prefill engine (disaggregation): its whole blocks join
        the prefix cache (announced as stored), as vLLM's connectors write pulled blocks into
        cached ones; a request for that prompt submitted next computes only its last token.
        False when the cache has no room for them (the request then computes them itself)."""
        hashes = self.cache.key_hashes(key)
        holder = f"\x00kv-in-{self._seq}"
        if not hashes or self.cache.reserve(holder, hashes, 0, now) is None:
            return False
        self.cache.commit(holder, key, now)
        self.cache.release(holder, now)
        self._events.extend(self.cache.drain_events())
        return True

    # ------------------------------------------------------------------ introspection

    def phase_of(self, request_id: str) -> Phase | None:
        st = self._states.get(request_id)
        return st.phase if st is not None else None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    # ------------------------------------------------------------------ SchedView (policies)

    def admissible(self, st: ReqState) -> bool:
        return self._admitted < self.profile.max_running and self.cache.can_fit(
            st.hashes, st.private_blocks
        )

    def pending_prefix(self, st: ReqState) -> int:
        return self.cache.computing(st.hashes)

    def refresh_cached(self, st: ReqState) -> None:
        if st.phase is Phase.WAITING:
            st.cached_tokens = self._cached_tokens(st.req, self.cache.match(st.hashes))

    def admit(self, st: ReqState, now: float) -> bool:
        if self._admitted >= self.profile.max_running:
            return False
        matched = self.cache.reserve(st.request_id, st.hashes, st.private_blocks, now)
        self._events.extend(self.cache.drain_events())
        if matched is None:
            return False
        st.cached_tokens = self._cached_tokens(st.req, matched)
        self._enter_prefill(st)
        self._events.append(RequestStarted(st.request_id))
        return True

    def reject(self, st: ReqState, reason: str, now: float) -> None:
        if st.phase is Phase.PREEMPTED:  # a paused prefill: its KV and ledger place go back
            self.prefilling.remove(st)
            st.unit = None
            self._prefill_work.pop(st.request_id, None)
            self._release(st, now)
        else:
            self.waiting.remove(st)
        st.move(Phase.REJECTED)
        del self._states[st.request_id]
        self._events.append(RequestRejected(st.request_id, reason))
        self._pending.append(Output(st.request_id, rejected=reason))
        self.rejected += 1

    # ------------------------------------------------------------------ internals

    def _cached_tokens(self, req: EngineRequest, matched_blocks: int) -> int:
        if not req.key or matched_blocks == 0:
            return 0
        tokens = matched_blocks * self.profile.block_bytes * req.input_tokens // len(req.key)
        return min(tokens, req.input_tokens - 1)

    def _commit_chunks(self, st: ReqState, now: float) -> None:
        """Cache the key blocks ``st``'s prefill chunks have computed so far (its cached prefix
        and what it prefilled since): a request admitted after this chunk reuses them, as in
        vLLM, which caches a chunk's full blocks when it schedules it. (Cached only when the
        whole prompt was, a follower admitted while a long document was still prefilling
        recomputed all of it beside its first request.)"""
        req = st.req
        if not req.key or req.input_tokens <= 0:
            return
        done_tokens = st.cached_tokens + st.prefilled
        blocks = done_tokens * len(req.key) // req.input_tokens // self.profile.block_bytes
        if blocks > 0:
            self.cache.commit(st.request_id, req.key, now, upto=blocks)
            self._events.extend(self.cache.drain_events())

    def _push_output(self, out: Output, now: float) -> None:
        self._pending.append(out)
        if self._pending_at is None:
            self._pending_at = now

    def _cut(self, step: _Step, now: float) -> None:
        """Preempt: end the step's prefill slice at the first operator boundary >= now."""
        unit = step.unit
        assert unit is not None
        start = step.prefill_start
        op_s = unit.op_ms / 1000.0
        k = 0 if now <= start or op_s <= 0 else math.ceil((now - start) / op_s - _EPS)
        if k < step.ops:
            step.ops = k
            step.end = start + k * op_s

    def _start_step(self, t: float) -> None:
        plan = self.policy.plan(self, t)
        for st in self._switch_unit(plan.unit):
            self._events.append(RequestPreempted(st.request_id))
        unit = plan.unit
        if not plan.decode and (unit is None or plan.prefill_ops <= 0):
            self._step = None
            return
        decode_ms = 0.0
        if plan.decode:
            mean_ctx = sum(st.context for st in plan.decode) / len(plan.decode)
            decode_ms = self.profile.decode_step_ms(len(plan.decode), mean_ctx)
        prefill_ms = unit.op_ms * plan.prefill_ops if unit is not None else 0.0
        plan_op_ms = 0.0
        if unit is not None:
            plan_op_ms = unit.op_ms
            if self.announced is not self.profile:
                pieces = [(n, c) for _, n, c in unit.pieces]
                plan_op_ms = prefill_batch_ms(self.announced, pieces) / unit.ops_total
        self._step = _Step(
            start=t,
            decode=plan.decode,
            decode_ms=decode_ms,
            unit=unit,
            ops=plan.prefill_ops,
            end=t + (decode_ms + prefill_ms) / 1000.0,
            mean_ctx=mean_ctx if plan.decode else 0.0,
            plan_op_ms=plan_op_ms,
        )

    def _complete(self, step: _Step, out: list[Output]) -> None:
        self.busy_s += step.end - step.start
        self._report_prefill(step, step.ops)
        if step.decode:
            self._note_decode_step(step.decode_ms, len(step.decode), step.mean_ctx)
        stream = self.config.stream_outputs
        t_dec = step.end  # a step's results are released together when it ends
        for st in step.decode:
            if st.phase is not Phase.DECODING:
                continue  # cancelled during the step
            st.generated += 1
            if st.last_token_at is not None:
                self.itl_s_total += t_dec - st.last_token_at
                self.itl_tokens += 1
            st.last_token_at = t_dec
            done = st.generated >= st.req.output_tokens
            usage = self._finish(st, t_dec) if done else None
            if stream or done:
                out.append(Output(st.request_id, st.generated - 1, (t_dec,), usage))
        unit = step.unit
        if unit is None:
            return
        unit.ops_done += step.ops
        if unit.ops_left > 0:
            return
        t = step.end
        unit_tokens = unit.tokens
        for st, n, _ in unit.pieces:
            if st.unit is not unit:
                continue  # cancelled
            st.unit = None
            st.prefilled += n
            work = self._prefill_work.get(st.request_id)
            if work is None:
                work = self._prefill_work[st.request_id] = [0.0, 0.0]
            work[0] += unit.total_ms
            work[1] += unit_tokens
            if st.remaining_prefill > 0:  # chunked: more chunks to come
                if self.policy.caches_chunks:
                    self._commit_chunks(st, t)
                continue
            self.prefilling.remove(st)
            self.cache.commit(st.request_id, st.req.key, t)
            self._events.extend(self.cache.drain_events())
            st.generated = 1
            st.first_token_at = st.last_token_at = t
            work = self._prefill_work.pop(st.request_id)
            self._events.append(
                FirstToken(
                    st.request_id,
                    (t - st.req.arrival) * 1000.0,
                    prefill_ms=work[0],
                    prefill_tokens=int(work[1]),
                    context_tokens=st.cached_tokens,
                    kv_transfer_ms=st.req.kv_transfer_ms,
                    kv_transfer_tokens=st.req.kv_transfer_tokens,
                )
            )
            if st.req.output_tokens <= 1:
                out.append(Output(st.request_id, 0, (t,), self._finish(st, t)))
                continue
            st.move(Phase.DECODING)
            st.credit = 0.0
            self.decoding.append(st)
            out.append(Output(st.request_id, 0, (t,)))
        if self._running_unit is unit:
            self._running_unit = None

    def _usage(self, st: ReqState) -> Usage:
        first = st.first_token_at if st.first_token_at is not None else st.req.arrival
        last = st.last_token_at if st.last_token_at is not None else first
        tpot = (last - first) * 1000.0 / (st.generated - 1) if st.generated > 1 else 0.0
        ttft = (first - st.req.arrival) * 1000.0
        slo = st.req.slo
        return Usage(
            prompt_tokens=st.req.input_tokens,
            completion_tokens=st.generated,
            cached_tokens=st.cached_tokens,
            ttft_ms=ttft,
            tpot_ms=tpot,
            slo_class=slo.name,
            slo_met=ttft <= slo.ttft_ms and (st.generated <= 1 or tpot <= slo.tpot_ms),
        )

    def _finish(self, st: ReqState, t: float) -> Usage:
        if st.phase is Phase.DECODING:
            self.decoding.remove(st)
            if self.cache.holds(st.request_id):
                # its output's whole blocks join the prefix cache, as vLLM and SGLang cache every
                # full block: a conversation's answer as its next turn resends it, any other
                # answer as bytes no key shares (never reused, but it takes room in the LRU)
                answer = st.req.answer_key
                if callable(answer):
                    answer = answer()
                answer = answer or output_filler(
                    st.request_id, st.generated * self.profile.bytes_per_token
                )
                self.cache.extend(st.request_id, st.req.key + answer, t)
                self._events.extend(self.cache.drain_events())
        st.move(Phase.FINISHED)
        self._states.pop(st.request_id, None)
        self._release(st, t)
        usage = self._usage(st)
        self.answer_ended(st)
        self._events.append(
            RequestFinished(
                st.request_id,
                st.generated,
                usage.ttft_ms,
                usage.tpot_ms,
                max_tokens=st.req.stated_tokens,  # (its answer ended by itself: routers learn)
            )
        )
        self.finished += 1
        return usage

    def _release(self, st: ReqState, now: float) -> None:
        """Give back an admitted request's KV and its share of the VBS statistics."""
        if not self.cache.holds(st.request_id):
            return
        self.cache.release(st.request_id, now)
        self._leave_ledger(st)


def output_filler(request_id: str, n_bytes: int) -> bytes:
    """``n_bytes`` standing for a request's answer in the prefix cache when the caller did not
    say what the answer adds to a later key: fixed by the request id, so no other request's
    blocks share them. (Not :func:`engine.text.tokens_text`, the simulated model's words: their
    4 bytes a token are not every profile's, and they take 6x as long, on every finish.)"""
    out = bytearray()
    i = 0
    while len(out) < n_bytes:
        out += hashlib.blake2b(f"{request_id}:{i}".encode(), digest_size=64).digest()
        i += 1
    return bytes(out[:n_bytes])
