"""Cluster state folded from broker events and the router's own decisions. Pure: takes ``now``.

What it keeps and why:

* engines: liveness by heartbeat TTL (router receipt time, so engine clock skew does not
  matter), epoch, cost profile, the latest :class:`LoadHeartbeat` (also how an engine's URL and
  models are learned), draining, static;
* the cache map (:class:`router.tree.RadixTree`) and the router's own speculative/approximate
  entries (:class:`router.speculative.Speculative`): a routed key counts as cached on its
  engine at once, for a short TTL on engines that report KV events (so a burst of one prefix is
  not explored N times) or a long one on engines that do not (approximate mode);
* in-flight requests, recorded at routing time and released by the engine's RequestFinished or
  RequestRejected (matched by request id), the gateway's ``report``, or a timeout; their prefill
  done at the engine's FirstToken or, for an engine that sends no request events, at the first
  token the gateway sees of a streamed answer (else at a guess);
* sliding windows (3 minutes by default): per engine, the work routed there (Preble's L: prefill
  of missed tokens, output tokens to be multiplied by the engine's TPOT), per prefix group and
  engine (what E2 moves), per prefix group the TTFTs (hot-prefix detection); 30 s of matched
  vs. key bytes per engine (prefill/decode balance);
* TPOT: median of each engine's last 200 measured TPOTs (its RequestFinished events' or, for an
  engine that sends none, its heartbeats' mean decode step), seeded at 150 ms.

Policies see it through :class:`router.view.View` (read-only) and immutable :class:`EngineView`
snapshots, rebuilt only for engines whose state changed.

Where it lives: this module folds events, decisions and time in (:class:`Cluster`); the state
itself, its configuration and its read side are :mod:`router.cluster_state`, the per-engine and
per-request records :mod:`router.engine_state`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from statistics import median

from broker.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    Envelope,
    FirstToken,
    LoadHeartbeat,
    RequestEnqueued,
    RequestFinished,
    RequestPreempted,
    RequestRejected,
    RequestStarted,
)
from engine_reporter.hashing import block_hash
from kvgate.cost_model import TtftReference, slower_than
from router.api import RouteRequest
from router.cluster_state import TTFT_FIT_MIN_EVIDENCE, ClusterState
from router.engine_state import _Engine, _GroupWork, _Inflight
from router.policies.base import Move
from router.policies.feasibility import (
    RATE_TAU_S,
    decode_step_ms,
    prefill_share,
    queued_prefill_tokens,
)
from router.tree_node import Match

# prefill work in one heartbeat that weighs as much as a first token in the speed fit
HEARTBEAT_FULL_WEIGHT_MS = 100.0
# the weight of an idle engine's TTFT in its prefill speed fit (an exact prefill time weighs 1:
# the TTFT also holds a decode step and the request's trip)
IDLE_TTFT_WEIGHT = 0.5


class Cluster(ClusterState):
    """Folds broker events, the router's decisions and time into :class:`ClusterState`; see
    the module docstring."""

    # ------------------------------------------------------------------ events

    def apply(self, env: Envelope, now: float) -> None:
        """Fold one broker event in."""
        ev = env.event
        kind = ev.KIND
        self.events[kind] = self.events.get(kind, 0) + 1
        eng = self._engine(env.engine_id)
        if eng.epoch != env.epoch:
            if eng.epoch:
                self.reset_engine(env.engine_id, now)
            eng.epoch = env.epoch
            eng.reports_kv = False
            eng.reports_prefill_steps = False
            eng.stored_blocks = eng.stored_key_bytes = 0  # (a new engine: maybe another model)
        if isinstance(ev, BlockStored):
            eng.reports_kv = True
            self.tree.apply_stored(env.engine_id, ev.parent_hash, ev.hashes, ev.blocks, now)
            eng.stored_blocks += len(ev.blocks)
            eng.stored_key_bytes += sum(map(len, ev.blocks))
            eng.view = None
        elif isinstance(ev, BlockRemoved):
            eng.reports_kv = True
            self.tree.apply_removed(env.engine_id, ev.hashes, now)
            eng.view = None
        elif isinstance(ev, AllCleared):
            eng.reports_kv = True
            self.reset_engine(env.engine_id, now)
        elif isinstance(ev, LoadHeartbeat):
            if eng.heartbeat is None or eng.heartbeat.profile != ev.profile:
                eng.profile = self._profile(ev.profile)
                eng.stored_blocks = eng.stored_key_bytes = 0  # (its block size may differ)
                self._membership += 1  # the eligible sets cache their profiles
            if now - eng.last_heartbeat > self.config.heartbeat_ttl_s:
                self._membership += 1  # (re)joins the eligible sets
            if ev.role != eng.role:
                self._set_role(eng, ev.role)
            eng.heartbeat = ev
            eng.last_heartbeat = now
            if ev.kv_blocks_held is not None:
                # the engine's own count of the memory its requests hold corrects the router's
                # until the next heartbeat (what its reservations, shared blocks and other
                # routers' requests add)
                eng.held_offset = ev.kv_blocks_held * eng.profile.block_tokens - eng.held_kv
            own = eng.enqueued_tokens if eng.reports_requests else eng.open_prefill_tokens
            eng.foreign_prefill_tokens = max(ev.queued_prefill_tokens - own, 0)
            if ev.decode_step_ms is not None and ev.decode_batch and self.config.fit_speed:
                if eng.reports_requests:
                    predicted = eng.profile.decode_step_ms(
                        ev.decode_batch, ev.decode_context or 0.0
                    )
                    eng.speed.observe_decode(predicted, ev.decode_step_ms)
                else:
                    self._fit_steps(eng, ev)
            if self.config.fit_speed:
                self._fit_prefill_steps(eng, ev)
            if ev.decode_step_ms and not eng.reports_requests:
                # no request events (a plain vLLM behind the bridge): its requests' TPOT is its
                # mean step (the bridge reads it off vLLM's inter-token latencies)
                self._record_heartbeat_tpot(eng, ev.decode_step_ms, now)
            if (not eng.static or not eng.url) and (eng.url, eng.models) != (ev.url, ev.models):
                eng.url = ev.url
                eng.models = ev.models
                self._membership += 1
            eng.view = None
        elif isinstance(ev, RequestEnqueued):
            eng.reports_requests = True
            rec = self._on(eng, ev.request_id)
            if rec is not None and not rec.engine_tokens:
                # the engine's own count of its prefill (it may not see a prefix the router
                # credits yet): what its heartbeats' queue holds of this request
                cached = ev.cached_bytes * ev.input_tokens // ev.key_bytes if ev.key_bytes else 0
                rec.engine_tokens = max(ev.input_tokens - cached, 1)
                eng.enqueued_tokens += rec.engine_tokens
        elif isinstance(ev, (RequestStarted, RequestPreempted)):
            eng.reports_requests = True
            rec = self._on(eng, ev.request_id)
            if isinstance(ev, RequestStarted) and rec is not None:
                # its prefill starts: the engine reserves its KV memory now, not at its first
                # token (a long prompt holds a small engine's memory for its whole prefill)
                self._hold_memory(eng, rec)
                eng.view = None
                self._load_dirty[eng.engine_id] = eng
        elif isinstance(ev, FirstToken):
            eng.reports_requests = True
            rec = self._on(eng, ev.request_id)
            self._fit_prefill(eng, ev, rec)
            if ev.kv_transfer_ms is not None and ev.kv_transfer_tokens and self.config.fit_speed:
                self.kv.observe(ev.kv_transfer_tokens, ev.kv_transfer_ms)
            if rec is not None and not rec.first_token:
                self._first_token(eng, ev.request_id, rec, ev.ttft_ms, now)
        elif isinstance(ev, RequestFinished):
            eng.reports_requests = True
            rec = self._on(eng, ev.request_id)
            if rec is not None and not rec.first_token:
                self._record_ttft(rec.group, ev.ttft_ms, now)
            if ev.output_tokens > 1:
                self._record_tpot(eng, ev.tpot_ms, now)
            if ev.max_tokens is not None:  # (the answer against the cap it was given)
                self.output_fit.observe(ev.max_tokens, ev.output_tokens)
            if rec is not None:
                self.release(ev.request_id, "event", now)
        elif isinstance(ev, RequestRejected):
            eng.reports_requests = True
            self._fit_refusal(eng, ev)
            if self._on(eng, ev.request_id) is not None:
                self.release(ev.request_id, "event", now)

    def _first_token(
        self, eng: _Engine, request_id: str, rec: _Inflight, ttft_ms: float, now: float
    ) -> None:
        """``rec``'s first token came out (on ``eng``) ``ttft_ms`` after it arrived there: its
        prefill is no longer queued work, it decodes, and its prefix group's TTFT is recorded
        (hot-prefix replication)."""
        rec.first_token = True
        rec.first_at = now
        self._prefill_done(rec, request_id)
        self._record_ttft(rec.group, ttft_ms, now)
        if rec.engine_id == eng.engine_id:
            self._start_decoding(eng, request_id, rec)

    def gateway_answer(self, engine_id: str, max_tokens: int, output_tokens: int) -> bool:
        """The gateway relayed an answer of ``output_tokens`` from ``engine_id`` to a request
        that stated ``max_tokens``: how long answers are against their caps
        (:class:`kvgate.cost_model.OutputFit`), for an engine that sends no RequestFinished of
        its own (a plain vLLM behind the bridge), whose answers the router would otherwise plan
        at their caps. An engine's own events say it exactly, so for one that sends them this is
        ignored. False when nothing was learned."""
        eng = self.engines.get(engine_id)
        if eng is None or eng.reports_requests or not (max_tokens >= 1 and output_tokens >= 1):
            return False
        self.output_fit.observe(max_tokens, output_tokens)
        return True

    def gateway_first_token(
        self, request_id: str, engine_id: str, ttft_ms: float, now: float
    ) -> bool:
        """The gateway saw the first token of a streamed answer ``ttft_ms`` after it sent the
        request to ``engine_id``. Folded only for an engine that sends no request events of its
        own (a plain vLLM behind the bridge, a static engine), whose prefill the router would
        otherwise guess done (``_Engine.open_prefill``). With ``fit_gateway_ttft`` (off), as
        :class:`FirstToken` without ``prefill_ms``, the TTFT of a request that found the engine
        idle is weaker evidence of its prefill speed. An engine's own events are exact, so for
        one that sends them this is ignored. False when nothing was folded."""
        rec = self._inflight.get(request_id)
        eng = self.engines.get(engine_id)
        if (
            rec is None
            or eng is None
            or rec.engine_id != engine_id
            or rec.first_token
            or eng.reports_requests
            or not (math.isfinite(ttft_ms) and ttft_ms >= 0.0)
        ):
            return False
        self._on(eng, request_id)  # (no longer pending)
        cfg = self.config
        if (
            cfg.fit_speed
            and cfg.fit_gateway_ttft
            and rec.idle_prefill_ms > 0
            and not eng.reports_prefill_steps
        ):
            eng.speed.observe_prefill(rec.idle_prefill_ms, ttft_ms, weight=IDLE_TTFT_WEIGHT)
        elif rec.ttft_pred_ms > 0 and not eng.reports_prefill_steps:
            self._fit_ttft(eng, rec, ttft_ms)
        self._first_token(eng, request_id, rec, ttft_ms, now)
        return True

    def _fit_ttft(self, eng: _Engine, rec: _Inflight, ttft_ms: float) -> None:
        """A first token the gateway saw on an engine that reports no prefill timings: its TTFT
        against the router's prediction, with the prefill factor that prediction used divided
        out, says how slow the engine runs plus what every engine's TTFT holds that the router
        does not model (:class:`kvgate.cost_model.TtftFit`). Each such engine's prefill factor
        is then how much slower it runs than the fleet's fastest
        (:func:`kvgate.cost_model.ttft_reference`, :func:`~kvgate.cost_model.slower_than`),
        which is taken to be as fast as its profile. Behind the bridge on arrival-order
        engines, with half of four engines 2x slower than they announced, tool_use at twice the
        knee went from 75.5% to 98.8% of its SLOs (docs/BENCHMARKS.md). The reference is a
        fleet-wide figure: re-read, with every engine's factor, once in as many first tokens
        as there are engines (an engine that reads faster than it reads as fast, at once);
        between times only the engine observed is re-read."""
        fit = eng.ttft_fit
        if not fit.observe(
            rec.ttft_pred_ms, ttft_ms * math.exp(rec.ttft_factor_log), rec.ttft_weight
        ):
            return
        if fit.evidence < TTFT_FIT_MIN_EVIDENCE:
            return
        reference = self._ttft_ref
        if reference.due(len(self.engines)):
            fitted = [e for e in self.engines.values() if self._ttft_fitted(e)]
            ref = reference.reread([e.ttft_fit for e in fitted])
            if ref is not None:
                for e in fitted:
                    self._set_ttft_factor(e, ref)
        elif reference.ref is not None:
            self._set_ttft_factor(eng, reference.ref)

    @staticmethod
    def _ttft_fitted(eng: _Engine) -> bool:
        return eng.ttft_fit.evidence >= TTFT_FIT_MIN_EVIDENCE and not eng.reports_prefill_steps

    def _set_ttft_factor(self, eng: _Engine, ref: TtftReference) -> None:
        eng.speed.set_prefill(slower_than(eng.ttft_fit, ref), eng.ttft_fit.evidence)
        eng.view = None
        self._load_dirty[eng.engine_id] = eng

    def _on(self, eng: _Engine, request_id: str) -> _Inflight | None:
        """The in-flight record of ``request_id`` if the router sent it to ``eng`` (which has
        now said something of it: no longer pending), else None. A request retried elsewhere
        keeps its id, so the first engine's late word on it (or another engine's) is about a
        request not there: counted in ``stale_outcomes``, it must not release the new one."""
        rec = self._inflight.get(request_id)
        if rec is None:
            return None
        if rec.engine_id != eng.engine_id:
            self.stale_outcomes += 1
            return None
        if rec.pending:
            rec.pending = False
            eng.pending_prefill_tokens -= rec.missed_tokens
            eng.view = None
        return rec

    def _prefill_done(self, rec: _Inflight, request_id: str) -> None:
        """``rec``'s prefill is no longer outstanding work of its engine."""
        eng = self.engines.get(rec.engine_id)
        if eng is not None:
            if eng.open_prefill.pop(request_id, None) is not None:
                eng.open_prefill_tokens -= rec.missed_tokens
            eng.enqueued_tokens -= rec.engine_tokens
            eng.open_prefill_ms -= rec.prefill_ms
            eng.view = None
            self._load_dirty[eng.engine_id] = eng

    def _fit_prefill(self, eng: _Engine, ev: FirstToken, rec: _Inflight | None) -> None:
        """What a first token says of the engine's prefill speed: the execution time of its
        prefill batches against the profile's time for their tokens, or (an engine that does not
        report that) the TTFT of a request that found nothing ahead of it, as weaker evidence."""
        if not self.config.fit_speed or eng.reports_prefill_steps:
            return  # (its heartbeats time the same work exactly)
        if ev.prefill_ms is not None and ev.prefill_tokens:
            predicted = eng.profile.prefill_ms(ev.prefill_tokens, ev.context_tokens or 0)
            eng.speed.observe_prefill(predicted, ev.prefill_ms)
        elif rec is not None and rec.idle_prefill_ms > 0 and not rec.first_token:
            eng.speed.observe_prefill(rec.idle_prefill_ms, ev.ttft_ms, weight=IDLE_TTFT_WEIGHT)
        else:
            return
        eng.view = None
        self._load_dirty[eng.engine_id] = eng

    def _fit_refusal(self, eng: _Engine, ev: RequestRejected) -> None:
        """What a refusal says of the engine's speed: the engine's own time for the prefill of
        the request's uncached prompt alone (``ttft``) or for one decode step of it alone
        (``tpot``) against the profile's for the same tokens. An engine slower than it
        announced that refuses every request it is sent serves none: no first token, no
        finished request, no decode step in its heartbeats ever shows its speed, it looks
        idle, and the router kept sending it requests (on fleets whose every second engine
        was 2x slower than announced and too slow for the TPOT SLO, e2 sent those engines up
        to 87% of the requests, most of them refused: docs/router.md)."""
        if not self.config.fit_speed or ev.estimate_ms <= 0 or ev.estimate_tokens <= 0:
            return
        if ev.cause == "tpot":
            predicted = eng.profile.decode_step_ms(1, ev.estimate_tokens)
            eng.speed.observe_decode(predicted, ev.estimate_ms)
        elif ev.cause == "ttft":
            eng.speed.observe_prefill(eng.profile.prefill_ms(ev.estimate_tokens), ev.estimate_ms)
        else:
            return
        eng.view = None
        self._load_dirty[eng.engine_id] = eng

    def _fit_steps(self, eng: _Engine, ev: LoadHeartbeat) -> None:
        """A bridged engine's heartbeat: its mean inter-token latency against the profile's step
        for the interval's batch and context, the prefill done in it (as the profile prices it)
        spread over its steps. A step is timed only this way behind the bridge, and an interval
        of pure decode is rare on a busy engine: read from those alone, a 2x slower engine's
        decode factor came 60 s into a run (docs/router.md, *Fifty-second session*). Each
        interval's reading is noisy (a step that prefills with nothing decoding is priced but
        timed by no token), so the engine's decode factor is read as its TTFTs are: against the
        fleet's fastest bridged engines, past two standard errors (:meth:`decode_scale`). The
        reference is re-read once in as many readings as there are engines."""
        batch = ev.decode_batch or 0.0
        predicted = eng.profile.decode_step_ms(batch, ev.decode_context or 0.0)
        if ev.decode_tokens and ev.prefill_ms is None and ev.prefill_plan_ms:
            predicted += ev.prefill_plan_ms * batch / ev.decode_tokens
        fit = eng.step_fit
        if not fit.observe(predicted, ev.decode_step_ms or 0.0):
            return
        if fit.evidence < TTFT_FIT_MIN_EVIDENCE:
            return
        if self._step_ref.due(len(self.engines)):
            fitted = [
                e
                for e in self.engines.values()
                if not e.reports_requests and e.step_fit.evidence >= TTFT_FIT_MIN_EVIDENCE
            ]
            self._step_ref.reread([e.step_fit for e in fitted])
        else:
            fitted = [eng]
        for e in fitted:
            e.view = None
            self._load_dirty[e.engine_id] = e

    def _fit_prefill_steps(self, eng: _Engine, ev: LoadHeartbeat) -> None:
        """A heartbeat's prefill work against its plan on the profile the engine names: the
        engine's speed shows within a heartbeat of its starting work (a first token can take
        seconds on a slow engine, and every request routed there meanwhile is placed on the
        wrong speed). Weighted by the work it covers, up to a first token's weight at
        ``HEARTBEAT_FULL_WEIGHT_MS``: a few ms of work is timing noise on a real engine. Only
        when this router costs the engine on that same profile (not a default)."""
        plan = ev.prefill_plan_ms or 0.0
        if eng.profile.name != ev.profile or ev.prefill_ms is None or plan <= 0:
            return
        eng.reports_prefill_steps = True
        eng.speed.observe_prefill(
            plan, ev.prefill_ms, weight=min(plan / HEARTBEAT_FULL_WEIGHT_MS, 1.0)
        )
        self._load_dirty[eng.engine_id] = eng

    def _start_decoding(self, eng: _Engine, request_id: str, rec: _Inflight) -> None:
        eng.decoding[request_id] = rec
        eng.decode_ctx += rec.ctx_tokens
        self._hold_memory(eng, rec)  # (from here, unless it holds it since its prefill began)
        _count(eng.decode_tpots, rec.tpot_slo_ms, 1)

    def _stop_decoding(self, eng: _Engine, request_id: str, rec: _Inflight) -> None:
        if eng.decoding.pop(request_id, None) is None:
            return
        eng.decode_ctx = eng.decode_ctx - rec.ctx_tokens if eng.decoding else 0.0
        self._release_memory(eng, rec)
        _count(eng.decode_tpots, rec.tpot_slo_ms, -1)

    @staticmethod
    def _hold_memory(eng: _Engine, rec: _Inflight) -> None:
        """``rec``'s prefill has started on ``eng``, or it decodes there: the KV memory it holds
        there is its context past its cached prefix, and its prefix group's cached prefix,
        held once for all the group's holders there (the engine pins a cached block once for
        all its readers). Once per request."""
        if rec.holds_memory:
            return
        rec.holds_memory = True
        eng.kv_holders += 1
        shared = float(rec.cached_tokens)
        eng.held_kv += rec.ctx_tokens - shared
        prefix = eng.held_prefixes.get(rec.group)
        if prefix is None:
            eng.held_prefixes[rec.group] = [1.0, shared]
            eng.held_kv += shared
            return
        prefix[0] += 1.0
        if shared > prefix[1]:
            eng.held_kv += shared - prefix[1]
            prefix[1] = shared

    @staticmethod
    def _release_memory(eng: _Engine, rec: _Inflight) -> None:
        """``rec`` ended on ``eng``: its own memory is free, and its group's cached prefix
        once the group's last holder there ends."""
        if not rec.holds_memory:
            return
        rec.holds_memory = False
        eng.kv_holders -= 1
        eng.held_kv -= rec.ctx_tokens - rec.cached_tokens
        prefix = eng.held_prefixes[rec.group]
        prefix[0] -= 1.0
        if prefix[0] <= 0.0:
            del eng.held_prefixes[rec.group]
            eng.held_kv -= prefix[1]
        if not eng.kv_holders:  # (no drift from float sums)
            eng.held_kv = 0.0

    def _record_tpot(self, eng: _Engine, tpot_ms: float, now: float) -> None:
        """A finished request's TPOT: the engine's is the median of its last requests'."""
        eng.tpots.append((now, tpot_ms))
        if len(eng.tpots) > self.config.tpot_samples:
            eng.tpots.popleft()
        self._tpot_changed(eng)

    def _record_heartbeat_tpot(self, eng: _Engine, tpot_ms: float, now: float) -> None:
        """A heartbeat's mean inter-token latency (a bridged engine): the engine's TPOT is the
        median of those of the last ``tpot_window_s``."""
        eng.tpots.append((now, tpot_ms))
        horizon = now - self.config.tpot_window_s
        while len(eng.tpots) > 1 and eng.tpots[0][0] < horizon:
            eng.tpots.popleft()
        self._tpot_changed(eng)

    def _tpot_changed(self, eng: _Engine) -> None:
        eng.tpot_ms = median([tpot for _, tpot in eng.tpots])
        eng.top_work, eng.top_known = None, False  # loads move by different amounts
        eng.view = None
        self._load_dirty[eng.engine_id] = eng

    def _record_ttft(self, group: int, ttft_ms: float, now: float) -> None:
        dq = self._ttfts.get(group)
        if dq is None:
            dq = self._ttfts[group] = deque()
        dq.append((now, ttft_ms))
        self._ttft_order.append((now, group))

    # ------------------------------------------------------------------ decisions

    def group_of(self, key: bytes) -> int:
        """The key's prefix group (the unit rebalancing moves): the hash of its first
        ``group_bytes``; of a key shorter than twice that, its first power of two bytes up to
        half its length (the same for the keys of one shared prefix with tails of different
        lengths). A whole short key (a document and a unique question, a system prompt and a
        user turn) made every request its own group, and rebalancing had nothing to move."""
        n = self.config.group_bytes
        if len(key) < 2 * n:
            n = 1 << max((len(key) // 2).bit_length() - 1, 0)
        return block_hash(None, key[:n])

    def match(self, key: bytes) -> tuple[Match, dict[str, int]]:
        """The tree's match (``Match.per_engine``: what the engines' block events confirm) and
        the per-engine matched bytes including the router's speculative entries (a new dict
        when there are any, else the match's own). A speculative entry is a whole key, not
        blocks: it is credited in whole blocks of the engine's profile (the tree's matches
        already are)."""
        m = self.tree.match(key)
        confirmed = m.per_engine
        merged = confirmed
        if len(self.spec):
            engines = self.engines
            for e, v in self.spec.tree.match(key).items():
                if v > merged.get(e, 0):
                    eng = engines.get(e)
                    if eng is not None:
                        v -= v % eng.profile.block_bytes
                    if v > merged.get(e, 0):
                        if merged is confirmed:
                            merged = dict(confirmed)
                        merged[e] = v
        return m, merged

    def record_route(
        self,
        req: RouteRequest,
        engine_id: str,
        match: Match,
        matched: Mapping[str, int],
        group: int,
        now: float,
    ) -> None:
        """The router sent ``req`` to ``engine_id``: in flight, window load, speculative key."""
        c = self.config
        eng = self._engine(engine_id)
        p = eng.profile
        key_len = len(req.key)
        mine = matched.get(engine_id, 0)
        cached = p.cached_tokens_for_bytes(mine)
        tokens = p.prompt_tokens(req.input_tokens, key_len)
        missed = max(tokens - cached, 1)
        # Preble's L entry: prefill of the missed part, plus this engine's share of the shared
        # prefix's prefill (divided among the engines holding it), plus output tokens later
        # multiplied by the engine's TPOT.
        holders = 1
        if mine:
            holders = 0
            for v in matched.values():
                if v >= mine:
                    holders += 1
        own_ms = p.prefill_ms(missed, cached)  # (its own prefill on the profile)
        prefill = own_ms + (p.prefill_ms(cached) / holders if cached else 0)
        prefill *= eng.speed.prefill
        entry = [now, engine_id, group, prefill, req.max_tokens]
        self._load.append(entry)
        eng.load_prefill_ms += prefill
        eng.load_out_tokens += req.max_tokens
        self._window_prefill_ms += prefill
        self._window_out_tokens += req.max_tokens
        eng.load_requests += 1
        self._load_dirty[engine_id] = eng
        g = eng.groups.get(group)
        if g is None:
            g = eng.groups[group] = _GroupWork()
        g.prefill_ms += prefill
        g.out_tokens += req.max_tokens
        g.requests += 1
        if key_len > g.key_bytes:
            g.key_bytes = key_len
        g.entries.append(entry)
        self._note_group(eng, group, g)
        self._hits.append((now, engine_id, mine, key_len))
        eng.hit_matched += mine
        eng.hit_total += key_len
        old = self._inflight.pop(req.request_id, None)
        if old is not None:
            self._forget(old, req.request_id)
        ctx_tokens = tokens + req.max_tokens / 2
        deadline = now + req.slo.ttft_ms / 1000.0
        idle = (
            not eng.open_prefill
            and not eng.decoding
            and not queued_prefill_tokens(eng.heartbeat, 0)
        )
        rec = self._inflight[req.request_id] = _Inflight(
            engine_id,
            now,
            group,
            missed,
            prefill_ms=prefill,
            out_tokens=req.max_tokens,
            ctx_tokens=ctx_tokens,
            deadline=deadline,
            tpot_slo_ms=req.slo.tpot_ms,
            idle_prefill_ms=own_ms if idle else 0.0,
            matched_bytes=mine,
            cached_tokens=cached,
        )
        if c.fit_speed and c.fit_relative_ttft and not (eng.reports_requests or c.fit_gateway_ttft):
            self._predict_ttft(eng, rec, own_ms)
        own_s = own_ms * eng.speed.prefill / 1e3
        # an engine that sends no request events (a plain vLLM behind the bridge) never says
        # when a prefill ends: assume it ends when the work queued there would be done
        done = math.inf
        if not eng.reports_requests:
            done = now + p.prefill_ms(eng.open_prefill_tokens + missed) * eng.speed.prefill / 1e3
        eng.open_prefill[req.request_id] = (deadline, missed, own_s, done)
        eng.open_prefill_tokens += missed
        eng.inflight += 1
        _count(eng.open_tpots, req.slo.tpot_ms, 1)
        eng.open_prefill_ms += prefill
        eng.open_out_tokens += req.max_tokens
        eng.open_ctx_tokens += ctx_tokens
        eng.pending_prefill_tokens += missed
        eng.routed_total += 1
        self.routed_total += 1
        decay = math.exp(-(now - eng.rate_t) / RATE_TAU_S)
        eng.rate = eng.rate * decay + 1.0 / RATE_TAU_S  # (exponentially weighted rates)
        eng.prefill_rate = eng.prefill_rate * decay + own_s * 1e3 / RATE_TAU_S
        slo_ms = max(req.slo.ttft_ms, 1.0)
        eng.prefill_slo_rate = eng.prefill_slo_rate * decay + own_s * 1e3 / slo_ms / RATE_TAU_S
        eng.rate_t = now
        self.slo_mix.add(req.slo.ttft_ms, own_s * 1e3, now)
        eng.view = None
        ttl = c.approximate_ttl_s if c.approximate or not eng.reports_kv else c.speculative_ttl_s
        rec.spec = self.spec.add(engine_id, req.key, ttl, now)
        # a request that wanted the prefix counts in its hit count wherever it was served
        # (Preble's M prices an eviction by the requests that want what it evicts)
        self.tree.touch(match, engine_id, max(mine, match.depth), now)

    def _predict_ttft(self, eng: _Engine, rec: _Inflight, own_ms: float) -> None:
        """What ``rec`` (just routed to ``eng``, which reports no request events) should see as
        its TTFT there, for :meth:`_fit_ttft`: on an engine that says nothing of when a prefill
        ends the prefill routed there and not yet answered runs first (as the prefill's guessed
        end, ``_Engine.open_prefill``, has it), at the share of the GPU its decode batch leaves
        prefill (on an engine that serves in arrival order, of its profile's step), after one
        decode step at its fitted speed. Weighted by its own prefill's share of that prefill:
        the router's guess of the queue is what it knows least."""
        p = eng.profile
        queued = p.prefill_ms(eng.open_prefill_tokens + rec.missed_tokens)
        if queued <= 0:
            return
        ev = self.engine_view(eng)
        step = decode_step_ms(ev)
        # an engine that serves in arrival order (vLLM) cuts no step to a TPOT budget: slower at
        # both, it is slower at its steps' prefill too, and prefill keeps its share of them (on
        # the profile's step; at the fitted one a slow decode, read first, made the fit read
        # such an engine's prefill as fast as the fastest's: docs/router.md, *Fifty-second
        # session*). An S-EDF engine cuts its steps to the budget: a slow decode leaves less.
        if ev.arrival_order and ev.decode_scale > 0:
            share = prefill_share(ev, step / ev.decode_scale)
        else:
            share = prefill_share(ev, step)
        rec.ttft_pred_ms = queued * eng.speed.prefill / share + step
        rec.ttft_factor_log = eng.speed.prefill_log
        rec.ttft_weight = min(own_ms / queued, 1.0)

    def inflight_engine(self, request_id: str) -> str | None:
        """The engine ``request_id`` is in flight on (None: no record)."""
        rec = self._inflight.get(request_id)
        return rec.engine_id if rec is not None else None

    def release(self, request_id: str, how: str, now: float) -> bool:
        """A routed request ended (``how``: event, report or timeout); frees its in-flight slot.
        On an engine that reports KV events its speculative entry now expires within
        ``speculative_grace_s``: the engine's own events describe its cache from here on (so
        the speculative tree holds about the requests in flight, not ``speculative_ttl_s`` of
        traffic)."""
        rec = self._inflight.pop(request_id, None)
        if rec is None:
            return False
        self._forget(rec, request_id)
        self.released_by[how] = self.released_by.get(how, 0) + 1
        if rec.spec and not self.config.approximate:
            eng = self.engines.get(rec.engine_id)
            if eng is not None and eng.reports_kv:
                self.spec.settle(rec.spec, self.config.speculative_grace_s, now)
        return True

    def _forget(self, rec: _Inflight, request_id: str) -> None:
        eng = self.engines.get(rec.engine_id)
        if eng is not None:
            eng.inflight -= 1
            _count(eng.open_tpots, rec.tpot_slo_ms, -1)
            if eng.open_prefill.pop(request_id, None) is not None:
                eng.open_prefill_tokens -= rec.missed_tokens
            if rec.pending:
                eng.pending_prefill_tokens -= rec.missed_tokens
            if not rec.first_token:
                eng.open_prefill_ms -= rec.prefill_ms
                eng.enqueued_tokens -= rec.engine_tokens
            eng.open_out_tokens -= rec.out_tokens
            eng.open_ctx_tokens -= rec.ctx_tokens
            if rec.first_token:
                self._stop_decoding(eng, request_id, rec)
            self._release_memory(eng, rec)  # (a request refused or ended in its prefill)
            if not eng.inflight:  # no drift from float sums: nothing is open
                eng.open_prefill_ms = eng.open_ctx_tokens = 0.0
            eng.view = None
            self._load_dirty[eng.engine_id] = eng

    def apply_moves(self, moves: Iterable[Move], now: float) -> None:
        """Apply E2's rebalancing: re-attribute a group's window work and route it elsewhere."""
        until = now + self.config.window_s
        for mv in moves:
            if mv.kind == "replicate":
                reps, _ = self._replicas.get(mv.group, (frozenset((mv.src,)), 0.0))
                self._replicas[mv.group] = (reps | {mv.src, mv.dst}, until)
                # the replicas take over from an earlier move (whose target is ``src`` or had
                # no load here): an override would send every request to one copy
                self._overrides.pop(mv.group, None)
                self.replications += 1
                continue
            src, dst = self.engines.get(mv.src), self.engines.get(mv.dst)
            if src is None or dst is None:
                continue
            g = src.groups.pop(mv.group, None)
            if g is not None:
                if g is src.top_work:
                    src.top_work, src.top_known = None, False
                src.load_prefill_ms -= g.prefill_ms
                src.load_out_tokens -= g.out_tokens
                dst.load_prefill_ms += g.prefill_ms
                dst.load_out_tokens += g.out_tokens
                src.load_requests -= g.requests
                dst.load_requests += g.requests
                self._load_dirty[src.engine_id] = src
                self._load_dirty[dst.engine_id] = dst
                for entry in g.entries:
                    entry[1] = mv.dst
                d = dst.groups.get(mv.group)
                if d is None:
                    d = dst.groups[mv.group] = g
                else:
                    d.prefill_ms += g.prefill_ms
                    d.out_tokens += g.out_tokens
                    d.requests += g.requests
                    d.key_bytes = max(d.key_bytes, g.key_bytes)
                    d.entries = deque(sorted((*d.entries, *g.entries), key=lambda e: e[0]))
                self._note_group(dst, mv.group, d)
            self._overrides[mv.group] = (mv.dst, until)
            src.view = dst.view = None
            self.moves += 1

    # ------------------------------------------------------------------ time

    def expire(self, now: float) -> None:
        """Slide every window to ``now``; time out forgotten requests and speculative keys."""
        c = self.config
        horizon = now - c.window_s
        load = self._load
        while load and load[0][0] < horizon:
            t, engine_id, group, prefill, out = load.popleft()
            self._window_prefill_ms -= prefill
            self._window_out_tokens -= out
            eng = self.engines.get(engine_id)
            if eng is None:
                continue
            eng.load_prefill_ms -= prefill
            eng.load_out_tokens -= out
            eng.load_requests -= 1
            self._load_dirty[engine_id] = eng
            g = eng.groups.get(group)
            if g is not None:
                if g is eng.top_work:  # the heaviest got lighter: another may lead now
                    eng.top_work, eng.top_known = None, False
                g.prefill_ms -= prefill
                g.out_tokens -= out
                g.requests -= 1
                dq = g.entries
                if dq and dq[0][0] == t and dq[0][3] == prefill:
                    dq.popleft()
                else:
                    for i, e in enumerate(dq):
                        if e[0] == t and e[3] == prefill:
                            del dq[i]
                            break
                if g.requests <= 0:
                    del eng.groups[group]
            eng.view = None
        order = self._ttft_order
        while order and order[0][0] < horizon:
            _, group = order.popleft()
            samples = self._ttfts.get(group)
            if samples:
                samples.popleft()
                if not samples:
                    del self._ttfts[group]
        hit_horizon = now - c.hit_window_s
        timeout = now - c.inflight_timeout_s
        while self._inflight:
            rid, rec = next(iter(self._inflight.items()))
            if rec.t >= timeout:
                break
            self.release(rid, "timeout", now)
        hits = self._hits
        while hits and hits[0][0] < hit_horizon:
            _, engine_id, m, k = hits.popleft()
            eng = self.engines.get(engine_id)
            if eng is not None:
                eng.hit_matched -= m
                eng.hit_total -= k
                eng.view = None
        self.spec.expire(now)
        if now >= self._next_sweep:  # the rarely-changing tables: once a second is plenty
            self._next_sweep = now + 1.0
            for table in (self._overrides, self._replicas):
                for group in [g for g, (_, until) in table.items() if until <= now]:
                    del table[group]
            self.tree.gc(now)


def _count(counts: dict[float, int], tpot_ms: float, delta: int) -> None:
    """Add ``delta`` to the count of requests with this TPOT SLO (a count of 0 is removed: the
    keys are the SLOs present)."""
    left = counts.get(tpot_ms, 0) + delta
    if left > 0:
        counts[tpot_ms] = left
    else:
        counts.pop(tpot_ms, None)
