"""Preble's E2 (exploit or explore), with rebalancing, hot-prefix replication and P/D balance.

Let ``matched`` be the longest prefix of the key cached on any feasible engine and ``missed`` the
rest (bytes).

* Rebalanced / replicated group first: a prefix group E2 moved goes to its new engine
  (``rebalance``); a replicated hot group goes to the least-loaded of its replicas
  (``replicate``).
* Exploit when ``missed < matched``: among the engines holding the longest match, the one with
  the least load ``L`` (then fewest in flight; exact ties by the rng). Preble's code picks by
  position in a set here; that is a bug, not copied.
* Explore otherwise: the engine minimising ``L_i + M_i + P_i`` (ms), where
  ``L_i`` = windowed work routed to ``i`` (prefill of missed tokens + shared-prefix share +
  output tokens x TPOT_i), ``M_i`` = eviction cost of fitting the missed bytes into ``i``'s free
  KV space (hit count x miss rate x prefill time of each prefix its LRU would evict),
  ``P_i`` = ``prefill_ms(missed tokens on i, cached tokens on i)`` on ``i``'s cost profile.
  With ``pd_balance``, engines whose recent cache-hit ratio is at least 0.7 (decode-heavy) are
  tried first (``pd_balance``). Ties break on load.
* After each decision, once every engine has had ``warmup_requests``: if the busiest engine's
  load is at least ``rebalance_ratio`` x the least busy's, move prefix groups (with at least
  ``min_group_requests`` requests in the window) from the busiest to the least busy, heaviest
  first, until balanced; a group too heavy to move (moving it would just swap the roles) is a
  hot prefix: it is replicated to the least busy engine when its mean TTFT over the second half
  of the window is at least ``replicate_ttft_ratio`` x the first half.

Every mechanism can be switched off for ablation (``rebalance``, ``pd_balance``,
``prefill_term``, ``eviction_term``, ``slo_filter``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

from router.api import Candidate, Decision, Reason
from router.policies.base import (
    ClusterView,
    EngineView,
    Move,
    PolicyBase,
    RequestContext,
    by_load,
    decide,
    pick_min,
    prefill_cost_ms,
)
from router.policies.feasibility import check, retry_after, shed


@dataclass(frozen=True, slots=True)
class E2Config:
    """E2's switches and thresholds (defaults from Preble)."""

    rebalance: bool = True  # post-assignment rebalancing and hot-prefix replication
    pd_balance: bool = True  # prefill-heavy requests to decode-heavy engines first
    prefill_term: bool = True  # P_i (Preble's paper has it; its released code does not)
    eviction_term: bool = True  # M_i
    slo_filter: bool = True  # skip engines that cannot meet the SLO; shed when none can
    rebalance_ratio: float = 1.5
    warmup_requests: int = 50
    min_group_requests: int = 2
    replicate_ttft_ratio: float = 2.0
    pd_hit_ratio: float = 0.7
    max_candidates: int = 4  # cheapest engines listed in an explore decision (plus holders)


TIE_LIMIT = 8  # equally cheap engines considered for the tie-break
_LOAD = attrgetter("load_ms")
_ROUTED = attrgetter("routed_total")


class E2(PolicyBase):
    name = "e2"

    def __init__(self, config: E2Config | None = None) -> None:
        self.config = config or E2Config()

    def choose(self, ctx: RequestContext, view: ClusterView, now: float) -> Decision:
        cfg = self.config
        engines = view.engines
        matched = view.matched
        rng = view.rng
        p_cache: dict[tuple[str, int], float] = {}
        worst = [float("inf")]  # smallest SLO excess seen (for the shed's retry-after)

        def ok(ev: EngineView) -> bool:
            if not cfg.slo_filter:
                return True
            excess = check(ev, ctx, matched.get(ev.engine_id, 0), p_cache)
            if excess > 0:
                worst[0] = min(worst[0], excess)
                return False
            return True

        if cfg.rebalance:
            target = view.override(ctx.group)
            if target is not None:
                for ev in engines:
                    if ev.engine_id == target and ok(ev):
                        return decide(self.name, "rebalance", ev, view)
            reps = view.replicas(ctx.group)
            if reps:
                pool = [ev for ev in engines if ev.engine_id in reps and ok(ev)]
                if pool:
                    return decide(self.name, "replicate", pick_min(pool, by_load, rng), view)
        # exploit: the longest match held by a feasible engine, if it covers most of the key
        best = max(matched.values(), default=0)
        while best > ctx.key_len - best:
            holders = [
                ev for e, m in matched.items() if m == best and (ev := view.engine(e)) is not None
            ]
            if holders:
                # the least-loaded feasible holder (equal loads: a random one of them)
                lightest = min(by_load(ev) for ev in holders)
                ties = [ev for ev in holders if by_load(ev) == lightest]
                first = rng.randrange(len(ties)) if len(ties) > 1 else 0
                for k in range(len(ties)):
                    if ok(ev := ties[(first + k) % len(ties)]):
                        return decide(self.name, "exploit", ev, view)
                for ev in sorted(holders, key=by_load):  # rare: the lightest cannot meet the SLO
                    if ok(ev):
                        return decide(self.name, "exploit", ev, view)
            best = max((m for m in matched.values() if m < best), default=0)
        chosen = self._explore(ctx, view, now, ok, p_cache)
        if chosen is None:
            return shed(self.name, ctx, retry_after(worst[0]), "no engine can meet the SLO")
        return chosen

    def _explore(
        self,
        ctx: RequestContext,
        view: ClusterView,
        now: float,
        ok: Callable[[EngineView], bool],
        p_cache: dict[tuple[str, int], float],
    ) -> Decision | None:
        """Cheapest feasible engine by L + M + P. ``L + P`` for everyone (P computed once for
        the engines holding part of the key and once per profile for the rest), then walk them
        cheapest first computing feasibility and M (>= 0) only while it can still change the
        answer: branch and bound."""
        cfg = self.config
        matched = view.matched
        key_len = ctx.key_len
        engines = view.engines
        get = matched.get
        if cfg.prefill_term:
            # P depends on (profile, matched bytes) only: memoise per matched value and profile
            by_m: dict[tuple[str, int], float] = {}

            def p_of(ev: EngineView) -> float:
                k = (ev.profile.name, get(ev.engine_id, 0))
                p = by_m.get(k)
                if p is None:
                    p = by_m[k] = prefill_cost_ms(ev, key_len, k[1], p_cache)
                return p

            lps = [ev.load_ms + p_of(ev) for ev in engines]
        else:

            def p_of(ev: EngineView) -> float:
                return 0.0

            lps = [ev.load_ms for ev in engines]
        pools: list[tuple[Reason, list[int]]] = []
        if cfg.pd_balance:
            thr = cfg.pd_hit_ratio
            decode_heavy = [i for i, ev in enumerate(engines) if ev.hit_ratio >= thr]
            if decode_heavy:
                pools.append(("pd_balance", sorted(decode_heavy, key=lps.__getitem__)))
        order = sorted(range(len(engines)), key=lps.__getitem__)
        pools.append(("explore", order))
        for reason, pool in pools:
            best = float("inf")
            evaluated: list[tuple[float, EngineView, float]] = []  # (total, view, M)
            for i in pool:
                lp = lps[i]
                if lp > best or (lp == best and len(evaluated) >= TIE_LIMIT):
                    break
                ev = engines[i]
                if not ok(ev):
                    continue
                mcost = 0.0
                if cfg.eviction_term:
                    need = key_len - matched.get(ev.engine_id, 0) - ev.free_bytes
                    if need > 0:
                        mcost = view.eviction_ms(ev.engine_id, need, now)
                evaluated.append((lp + mcost, ev, mcost))
                best = min(best, lp + mcost)
            if not evaluated:
                continue
            # ties on cost break on load, then in flight, then the rng
            finalists = [t for t in evaluated if t[0] == best]
            key = min(by_load(t[1]) for t in finalists)
            finalists = [t for t in finalists if by_load(t[1]) == key]
            pick = finalists[view.rng.randrange(len(finalists))] if len(finalists) > 1 else None
            chosen = (pick or finalists[0])[1]
            # explain: the chosen, the next cheapest, and the engines holding the most of the key
            m_of = {t[1].engine_id: t[2] for t in evaluated}
            listed = [chosen, *(engines[i] for i in order[: cfg.max_candidates])]
            for engine_id, _ in heapq.nlargest(
                cfg.max_candidates, matched.items(), key=lambda kv: kv[1]
            ):
                if (ev := view.engine(engine_id)) is not None:
                    listed.append(ev)
            cands: dict[str, Candidate] = {}
            for ev in listed:
                if ev.engine_id not in cands:
                    cands[ev.engine_id] = Candidate(
                        ev.engine_id,
                        get(ev.engine_id, 0),
                        ev.load_ms,
                        m_of.get(ev.engine_id, 0.0),
                        p_of(ev),
                    )
            return decide(self.name, reason, chosen, view, candidates=list(cands.values()))
        return None

    def rebalance(self, ctx: RequestContext, view: ClusterView, now: float) -> tuple[Move, ...]:
        cfg = self.config
        engines = view.engines
        if not cfg.rebalance or len(engines) < 2:
            return ()
        if min(map(_ROUTED, engines)) < cfg.warmup_requests:
            return ()
        busiest = max(engines, key=_LOAD)
        least = min(engines, key=_LOAD)
        hi, lo = busiest.load_ms, least.load_ms
        if hi <= 0.0 or hi < cfg.rebalance_ratio * lo:
            return ()
        moves: list[Move] = []
        for g in view.groups_on(busiest.engine_id):
            if hi < cfg.rebalance_ratio * lo:
                break
            if g.requests < cfg.min_group_requests or view.override(g.group) is not None:
                continue
            if g.load_ms >= hi - lo:  # moving it would only swap the roles: a hot prefix
                first, second = view.ttft_halves(g.group, now)
                if (
                    first > 0.0
                    and second >= cfg.replicate_ttft_ratio * first
                    and least.engine_id not in view.replicas(g.group)
                ):
                    moves.append(Move(g.group, busiest.engine_id, least.engine_id, "replicate"))
                continue
            moves.append(Move(g.group, busiest.engine_id, least.engine_id))
            hi -= g.load_ms
            lo += g.load_ms
        return tuple(moves)
