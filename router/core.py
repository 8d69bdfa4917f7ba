"""The router: one pure object the gateway, the router service and the simulator all drive.

``route(request, now)`` matches the key against the cache map, asks the configured policy, and
records the decision at once (in-flight work, windowed load, a speculative cache entry) so the
next request already sees it; ``apply(envelope, now)`` folds broker events in. A request's
``max_tokens`` is a cap: the policy and the records see the answer's length the router expects
under it (:class:`kvgate.cost_model.OutputFit`, learned from finished requests). No I/O, no
clock, no global state: time is passed in, randomness comes from the injected rng.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from broker.events import Envelope
from router.api import Decision, EngineInfo, Outcome, RouteRequest
from router.cluster import Cluster
from router.cluster_state import ClusterConfig
from router.pd import choose_decode, decode_id, decode_phase, prefill_phase
from router.policies.base import EngineView, Policy, RequestContext, Rng, kv_blocks
from router.policies.registry import make_policy
from router.tree_node import Match
from router.view import View

NO_ENGINE_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Which policy (registry key) with which options, and the cluster state's windows/budgets."""

    policy: str = "e2"
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


class Router:
    """See the module docstring. Not thread-safe: one event loop (or one simulator) drives it."""

    def __init__(self, config: RouterConfig | None, rng: Rng) -> None:
        self.config = config or RouterConfig()
        self.rng = rng
        self.policy: Policy = make_policy(self.config.policy, self.config.policy_options)
        # the policy says which load L the cluster orders engines by (E2's ``load`` option)
        self.cluster = Cluster(
            self.config.cluster, load_mode=getattr(self.policy, "load_mode", "window")
        )
        self.decisions: dict[tuple[str, str], int] = {}  # (policy, reason) -> count
        self.routed_key_bytes = 0
        self.routed_matched_bytes = 0

    # ------------------------------------------------------------------ routing

    def route(self, req: RouteRequest, now: float) -> Decision:
        """Pick an engine for ``req`` (or shed it) and record the choice. In a fleet with
        prefill-only and decode-only engines (``router.pd``) the policy picks among the engines
        that prefill, and a prefill-only choice gets a decode engine too."""
        cl = self.cluster
        cl.expire(now)
        asked = req
        if cl.config.fit_output:
            planned = cl.output_fit.expected(req.max_tokens)
            if planned != req.max_tokens:
                req = dataclasses.replace(req, max_tokens=planned)
        if req.prefilled_on is not None:
            return self._route_decode(req, now)
        group = cl.group_of(req.key)
        ctx = RequestContext(req, len(req.key), group)
        engines = cl.candidates(req, now)
        decode_only: frozenset[str] = frozenset()
        prefill_only: frozenset[str] = frozenset()
        every = engines
        if cl.roled:
            decode_only, prefill_only = cl.role_split(req.model, now)
            if decode_only:
                engines = [v for v in engines if v.engine_id not in decode_only]
        if not engines:
            return self._no_engine(f"no live engine serves model {req.model!r}")
        match, matched = cl.match(req.key)
        view = View(
            cl,
            engines,
            matched,
            self.rng,
            model=req.model,
            exclude=req.exclude | decode_only if decode_only else req.exclude,
            now=now,
            confirmed=match.per_engine,
        )
        decision = self.policy.choose(ctx, view, now)
        self._count(decision)
        chosen = decision.engine_id
        if chosen is None:
            return self._never_fits(asked, decision, now)
        if chosen in prefill_only:
            decision = self._pair(req, decision, every, match, matched, group, now)
        else:
            cl.record_route(req, chosen, match, matched, group, now)
        self.routed_key_bytes += len(req.key)
        self.routed_matched_bytes += decision.matched_bytes
        # (``view.engines`` still holds the chosen engine's view from before: rebalancing reads
        # loads through ``view.by_load``/``view.engine``, which rebuild changed views)
        moves = self.policy.rebalance(ctx, view, now)
        if moves:
            cl.apply_moves(moves, now)
        return decision

    def _pair(
        self,
        req: RouteRequest,
        decision: Decision,
        every: list[EngineView],
        match: Match,
        matched: Mapping[str, int],
        group: int,
        now: float,
    ) -> Decision:
        """The policy chose a prefill-only engine: add the decode engine and record both
        phases (``router.pd``). With no engine that decodes, the prefill engine runs it all."""
        cl = self.cluster
        prefill = decision.engine_id
        assert prefill is not None
        d = choose_decode(every, req, len(req.key))
        if d is None:
            cl.record_route(req, prefill, match, matched, group, now)
            return dataclasses.replace(
                decision,
                detail=(decision.detail + "; " if decision.detail else "")
                + "no decode engine: colocated",
            )
        cl.record_route(prefill_phase(req), prefill, match, matched, group, now)
        self._record_decode(req, d.engine_id, match, group, now)
        return dataclasses.replace(
            decision,
            decode_engine_id=d.engine_id,
            decode_url=d.url,
            kv_transfer_ms=self._kv_ms(req, d),
        )

    def _kv_ms(self, req: RouteRequest, decode: EngineView) -> float:
        """The predicted move of ``req``'s KV to ``decode``."""
        return self.cluster.kv.transfer_ms(
            decode.profile.prompt_tokens(req.input_tokens, len(req.key))
        )

    def _record_decode(
        self, req: RouteRequest, engine_id: str, match: Match, group: int, now: float
    ) -> None:
        """The decode phase's record: its prompt counts as cached there (the KV moves in)."""
        self.cluster.record_route(
            decode_phase(req), engine_id, match, {engine_id: len(req.key)}, group, now
        )

    def _route_decode(self, req: RouteRequest, now: float) -> Decision:
        """A decode retry: the prompt's KV waits on ``req.prefilled_on``; only a decode
        engine is chosen (the failed ones are in ``req.exclude``)."""
        cl = self.cluster
        prefill = req.prefilled_on
        assert prefill is not None
        cl.release(decode_id(req.request_id), "report", now)
        d = choose_decode(
            (v for v in cl.candidates(req, now) if v.engine_id != prefill), req, len(req.key)
        )
        if d is None:
            return self._no_engine(f"no live decode engine serves model {req.model!r}")
        match, _ = cl.match(req.key)
        self._record_decode(req, d.engine_id, match, cl.group_of(req.key), now)
        p = cl.engines.get(prefill)
        decision = Decision(
            engine_id=prefill,
            url=p.url if p is not None else None,
            reason="decode",
            policy=self.policy.name,
            decode_engine_id=d.engine_id,
            decode_url=d.url,
            kv_transfer_ms=self._kv_ms(req, d),
        )
        self._count(decision)
        return decision

    def _never_fits(self, req: RouteRequest, shed: Decision, now: float) -> Decision:
        """A shed request that no engine serving its model could ever hold (its prompt and
        stated ``max_tokens`` need more KV blocks than each one has in all, as its heartbeat
        says: a bridge reports vLLM's real block count) is told apart (reason ``too_long``):
        no wait makes room for it, so it must not be answered as an overload to retry. Judged
        only on engines that announced themselves (a heartbeat): one that did not may hold
        more than the default profile says. Only on a shed: the decision path pays nothing."""
        most = 0
        for eng in self.cluster.eligible(req.model, now).values():
            p = eng.profile
            if eng.heartbeat is None:
                return shed
            blocks = kv_blocks(p, eng.heartbeat)
            prompt = p.prompt_tokens(req.input_tokens, len(req.key))
            if p.kv_blocks_needed(len(req.key), prompt, req.max_tokens) <= blocks:
                return shed
            most = max(most, blocks * p.block_tokens)
        if most == 0:
            return shed
        return dataclasses.replace(
            shed,
            reason="too_long",
            detail=f"{req.input_tokens} prompt + {req.max_tokens} output tokens; the largest "
            f"engine serving {req.model!r} holds {most} tokens in all",
        )

    def _no_engine(self, detail: str) -> Decision:
        """A shed for want of any engine to send to (counted like a policy's shed)."""
        decision = Decision(
            engine_id=None,
            url=None,
            reason="shed",
            policy=self.policy.name,
            retry_after_s=NO_ENGINE_RETRY_S,
            detail=detail,
        )
        self._count(decision)
        return decision

    def _count(self, decision: Decision) -> None:
        k = (decision.policy, decision.reason)
        self.decisions[k] = self.decisions.get(k, 0) + 1

    # ------------------------------------------------------------------ inputs

    def apply(self, env: Envelope, now: float) -> None:
        """Fold one broker event (the consumer's sink interface)."""
        self.cluster.apply(env, now)

    def reset_engine(self, engine_id: str, now: float) -> None:
        """Forget an engine's cache (gap, new epoch, AllCleared: the consumer re-applies its
        snapshot next)."""
        self.cluster.reset_engine(engine_id, now)

    def report(
        self,
        request_id: str,
        engine_id: str,
        outcome: Outcome,
        now: float,
        output_tokens: int = 0,
        max_tokens: int = 0,
    ) -> bool:
        """The gateway's word on a routed request: whatever the outcome, it is no longer in
        flight. With ``output_tokens`` and ``max_tokens`` (0: unknown) the answer's length
        against the cap its request stated, learned for an engine that sends no finished-request
        events of its own (:meth:`router.cluster.Cluster.gateway_answer`). False when the router
        had no record of it (already released), or its records are on other engines: a request
        retried elsewhere keeps its id, and the report of the engine that failed it, queued in
        the gateway, may come after the retry was routed (``Cluster.stale_outcomes``)."""
        cl = self.cluster
        if outcome == "ok":
            cl.gateway_answer(engine_id, max_tokens, output_tokens)
        # (a disaggregated request's pair: the gateway names the engine of the phase it was in)
        records = [cl.inflight_engine(request_id), cl.inflight_engine(decode_id(request_id))]
        if engine_id not in records:
            if any(records):
                cl.stale_outcomes += 1
            return False
        decode = cl.release(decode_id(request_id), "report", now)
        return cl.release(request_id, "report", now) or decode

    def first_token(self, request_id: str, engine_id: str, ttft_ms: float, now: float) -> bool:
        """The gateway's TTFT of a streamed answer, for an engine that sends no request events
        (:meth:`router.cluster.Cluster.gateway_first_token`). False when it was not folded in."""
        return self.cluster.gateway_first_token(request_id, engine_id, ttft_ms, now)

    def add_static_engine(
        self,
        engine_id: str,
        url: str,
        models: Iterable[str] = (),
        profile: str = "mistral-7b-a6000",
        role: str = "both",
    ) -> None:
        """An engine configured by hand: always alive, routable without a heartbeat."""
        self.cluster.add_static_engine(engine_id, url, models, profile, role)

    def set_draining(self, engine_id: str, draining: bool) -> None:
        """A draining engine gets no new requests (its in-flight ones finish)."""
        self.cluster.set_draining(engine_id, draining)

    # ------------------------------------------------------------------ introspection

    def engines(self, now: float) -> list[EngineInfo]:
        return self.cluster.infos(now)

    def state(self, now: float) -> dict:
        """Engines, loads, tree size and hit statistics (``GET /state``), JSON-ready. Read-only:
        ``now`` only ages heartbeats (pass the clock the router is fed with)."""
        cl = self.cluster
        ttl = cl.config.heartbeat_ttl_s
        engines = []
        for eng in sorted(cl.engines.values(), key=lambda e: e.engine_id):
            ev = cl.engine_view(eng)
            hb = eng.heartbeat
            engines.append(
                {
                    "engine_id": eng.engine_id,
                    "url": eng.url,
                    "models": list(eng.models),
                    "alive": eng.alive(now, ttl),
                    "draining": eng.draining,
                    "static": eng.static,
                    "epoch": eng.epoch,
                    "profile": eng.profile.name,
                    "role": eng.role,
                    "reports_kv": eng.reports_kv,
                    "reports_requests": eng.reports_requests,
                    "inflight": eng.inflight,
                    "routed_total": eng.routed_total,
                    "load_ms": round(ev.load_ms, 3),
                    # Preble's L (what rebalancing weighs): prefill + output tokens x TPOT
                    "window_ms": round(eng.window_ms(), 3),
                    "window_prefill_ms": round(eng.load_prefill_ms, 3),
                    "window_out_tokens": round(eng.load_out_tokens),
                    "window_requests": eng.load_requests,
                    "tpot_ms": round(eng.tpot_ms, 3),
                    # the online fit: how much slower (> 1) than its profile it runs, and the
                    # weight of the evidence (0: nothing measured, the profile is trusted);
                    # behind the vLLM bridge, against the fleet's fastest (as the router reads it)
                    "speed": {
                        "prefill": round(eng.speed.prefill, 4),
                        "decode": round(cl.decode_scale(eng), 4),
                        "prefill_evidence": round(eng.speed.prefill_evidence, 2),
                        "decode_evidence": round(cl.decode_evidence(eng), 2),
                    },
                    "hit_ratio_30s": round(ev.hit_ratio, 4),
                    "cached_bytes": cl.tree.held_bytes.get(eng.engine_id, 0),
                    # KV memory its requests hold, in tokens, as the router counts it (its
                    # requests past the start of their prefill, corrected to the engine's
                    # last report): what a request's wait for memory there is read from
                    "held_kv_tokens": round(ev.held_kv_tokens),
                    "heartbeat": None
                    if hb is None
                    else {
                        "age_s": round(now - eng.last_heartbeat, 3),
                        "waiting": hb.waiting,
                        "running": hb.running,
                        "queued_prefill_tokens": hb.queued_prefill_tokens,
                        "kv_blocks_used": hb.kv_blocks_used,
                        "kv_blocks_total": hb.kv_blocks_total,
                        "kv_blocks_held": hb.kv_blocks_held,
                        "vbs": hb.vbs,
                        "queue_order": hb.queue_order,
                        "prefill_chunk_tokens": hb.prefill_chunk_tokens,
                    },
                }
            )
        ts = cl.tree.stats()
        return {
            "policy": self.policy.name,
            "engines": engines,
            "tree": {
                "nodes": ts.nodes,
                "bytes": ts.bytes,
                "unheld_bytes": ts.unheld_bytes,
                "budget_bytes": cl.tree.budget_bytes,
                "index_entries": ts.index_entries,
                "index_bytes": ts.index_bytes,
                "dropped_nodes": ts.dropped_nodes,
                "orphan_chains": ts.orphan_chains,
                "hash_conflicts": ts.hash_conflicts,
            },
            "speculative": {
                "entries": len(cl.spec),
                "nodes": cl.spec.tree.nodes - 1,  # (not counting the root)
                "bytes": cl.spec.tree.total_bytes,
            },
            "hits": {
                "routed_key_bytes": self.routed_key_bytes,
                "routed_matched_bytes": self.routed_matched_bytes,
                "hit_ratio": (
                    self.routed_matched_bytes / self.routed_key_bytes
                    if self.routed_key_bytes
                    else 0.0
                ),
            },
            "decisions": [
                {"policy": p, "reason": r, "count": n}
                for (p, r), n in sorted(self.decisions.items())
            ],
            "inflight": len(cl._inflight),
            "released": dict(cl.released_by),
            "stale_outcomes": cl.stale_outcomes,
            "rebalance": {"moves": cl.moves, "replications": cl.replications},
            "events": dict(cl.events),
            # engines' announcements of a profile this router cannot read (the default stood in)
            "unknown_profiles": cl.unknown_profiles,
            "kv_link": {
                "kv_bytes_per_token": cl.kv.bytes_per_token,
                "gbps": cl.kv.gbps,
                "fitted_factor": round(cl.kv.factor, 4),
            },
        }
