"""Preble's E2 (exploit or explore), with rebalancing, hot-prefix replication and P/D balance.

Let ``matched`` be the longest prefix of the key cached on any feasible engine and ``missed`` the
rest (bytes).

* Rebalanced / replicated group first: a prefix group E2 moved goes to its new engine
  (``rebalance``); a replicated hot group goes to the least-loaded of its replicas
  (``replicate``).
* Exploit when ``missed < matched``: among the engines holding the longest match, the one with
  the least load ``L`` (then fewest in flight; exact ties by the rng). Preble's code picks by
  position in a set here; that is a bug, not copied.
* Exploit guard (``exploit_guard``, off by default, see docs/router.md; not in Preble): the
  exploit candidate ``h`` costs ``C_h = L_h + M_h + P_h`` (``P_h``: prefill of the few missed
  bytes). If ``C_h > guard_ratio x C_e + guard_slack_ms``, ``C_e`` being the explore optimum
  ``min_i (L_i + M_i + P_i)``, the request goes to the explore winner instead (``replicate``:
  that copies the hot prefix to a second engine). Why: when a whole family shares one system
  prompt, ``missed < matched`` holds for every request of it, and exploit sent them all to the
  one holder (~300 in flight on ``preble_mix``) long before rebalancing's warm-up (50 requests
  on *every* engine) let Preble's windowed-TTFT replication act. ``C_e`` is computed only when
  ``C_h > guard_ratio x min_i L_i + guard_slack_ms`` (``C_e >= min L``, so otherwise the guard
  cannot fire), and with explore's branch and bound cut at the threshold.
* Explore otherwise: the engine minimising ``L_i + M_i + P_i`` (ms), where
  ``L_i`` = work routed to ``i`` (prefill of missed tokens + shared-prefix share + output
  tokens x TPOT_i), by default only the work still *outstanding* (``load="outstanding"``: a
  request's prefill term until its first token, its output term until it ends), or, as
  DESIGN.md/Preble define it, all work routed in the last 3 minutes (``load="window"``, the
  pure-Preble ablation). Why the refinement: measured on Mooncake, the windowed L is ~160 s
  per engine (output x TPOT of ~20 mostly finished requests) against a P of ~1 s, and differs
  between engines by tens of seconds of *history* that says nothing about the queue a new
  request joins; explore degenerated into least-windowed-history and sent requests behind
  tens of thousands of queued prefill tokens while other engines were idle. Rebalancing
  keeps Preble's windowed L in both modes (it moves window work). ``M_i`` = eviction cost
  of fitting the missed bytes into ``i``'s free KV space (hit count x miss rate x prefill
  time of each prefix its LRU would evict),
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
``prefill_term``, ``eviction_term``, ``slo_filter``, ``exploit_guard``; ``load=window`` for
Preble's L).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from heapq import heappop, heappush
from operator import attrgetter, itemgetter
from typing import ClassVar

from router.api import Candidate, Decision, Reason
from router.policies.base import (
    LOAD_MODES,
    ClusterView,
    EngineView,
    Move,
    PolicyBase,
    PrefillCache,
    RequestContext,
    by_load,
    decide,
    pick_min,
    prefill_cost_ms,
    prefill_cost_ms_for,
    top_matched,
)
from router.policies.feasibility import check, deadline_s, retry_after, shed


@dataclass(frozen=True, slots=True)
class E2Config:
    """E2's switches and thresholds (defaults from Preble)."""

    rebalance: bool = True  # post-assignment rebalancing and hot-prefix replication
    pd_balance: bool = True  # prefill-heavy requests to decode-heavy engines first
    prefill_term: bool = True  # P_i (Preble's paper has it; its released code does not)
    eviction_term: bool = True  # M_i
    slo_filter: bool = True  # skip engines that cannot meet the SLO; shed when none can
    # exploit only while the holder costs <= ratio x explore's best (off: measured no better)
    exploit_guard: bool = False
    # L_i over "outstanding" work (in-flight requests) or Preble's 3-minute "window"
    load: str = "outstanding"
    rebalance_ratio: float = 1.5
    warmup_requests: int = 50
    min_group_requests: int = 2
    replicate_ttft_ratio: float = 2.0
    pd_hit_ratio: float = 0.7
    max_candidates: int = 4  # cheapest engines listed in an explore decision (plus holders)
    guard_ratio: float = 1.5  # exploit guard: C_h > ratio x C_e + slack -> explore's winner
    guard_slack_ms: float = 0.0


TIE_LIMIT = 4  # equally cheap engines considered for the tie-break
FLOOR_TERMS = 16  # most (profile, matched length) pairs priced for P's lower bound
P_CACHE_MAX = 4096  # memoised prefill costs kept across decisions (then it starts over)
EXPLICIT_CLASS = 4  # a matched length held by at most this many engines: score them up front
_INF = math.inf  # (mypyc builds float("inf") by parsing the string, every time)
_COST_POS = itemgetter(0, 1, 2)
_TOTAL = itemgetter(0)
_POSITION = attrgetter("position")


class E2(PolicyBase):
    name: ClassVar[str] = "e2"

    def __init__(self, config: E2Config | None = None) -> None:
        self.config = config or E2Config()
        if self.config.load not in LOAD_MODES:
            raise ValueError(f"e2: load must be one of {LOAD_MODES}, not {self.config.load!r}")
        self.load_mode = self.config.load
        # P by (profile, key bytes, matched bytes), across decisions (a pure function's memo)
        self._p_cache: PrefillCache = {}

    def choose(self, ctx: RequestContext, view: ClusterView, now: float) -> Decision:
        cfg = self.config
        engines = view.engines
        matched = view.matched
        rng = view.rng
        p_cache = self._p_cache
        if len(p_cache) > P_CACHE_MAX:
            p_cache.clear()
        worst = [_INF]  # smallest SLO excess seen (for the shed's retry-after)
        due = deadline_s(ctx, now)

        def ok(ev: EngineView) -> bool:
            if not cfg.slo_filter:
                return True
            ahead = view.prefill_ahead_ms(ev, due)
            excess = check(ev, ctx, matched.get(ev.engine_id, 0), p_cache, ahead)
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
                hv for e, m in matched.items() if m == best and (hv := view.engine(e)) is not None
            ]
            if holders:
                # matched's order follows the tree's sets (string hashes: it changes with
                # PYTHONHASHSEED), so the holders go in registration order before the rng picks
                holders.sort(key=_POSITION)
                # the least-loaded feasible holder (equal loads: a random one of them)
                lightest = min(by_load(ev) for ev in holders)
                ties = [ev for ev in holders if by_load(ev) == lightest]
                first = rng.randrange(len(ties)) if len(ties) > 1 else 0
                for k in range(len(ties)):
                    if ok(ev := ties[(first + k) % len(ties)]):
                        return self._exploit(ev, ctx, view, now, ok, p_cache)
                for ev in sorted(holders, key=by_load):  # rare: the lightest cannot meet the SLO
                    if ok(ev):
                        return self._exploit(ev, ctx, view, now, ok, p_cache)
            best = max((m for m in matched.values() if m < best), default=0)
        chosen = self._explore(ctx, view, now, ok, p_cache, pd_balance=cfg.pd_balance)
        if chosen is None:
            return shed(self.name, ctx, retry_after(worst[0]), "no engine can meet the SLO")
        return chosen

    def _exploit(
        self,
        holder: EngineView,
        ctx: RequestContext,
        view: ClusterView,
        now: float,
        ok: Callable[[EngineView], bool],
        p_cache: PrefillCache,
    ) -> Decision:
        """Exploit ``holder``, unless the exploit guard finds that it costs more than
        ``guard_ratio x`` explore's best ``+ guard_slack_ms``: then explore's winner
        (``replicate``). Explore runs only when the guard could fire (``C_e >= min L``)."""
        cfg = self.config
        if cfg.exploit_guard and len(view.engines) > 1:
            ratio, slack = cfg.guard_ratio, cfg.guard_slack_ms
            floor = ratio * next(view.by_load()).load_ms + slack  # a lower bound of the threshold
            # C_h: P_h is memoised and M_h is priced only when the missed bytes do not fit
            cost = holder.load_ms + self._p(holder, ctx.key_len, view, p_cache)
            if cfg.eviction_term:
                need = ctx.key_len - view.matched.get(holder.engine_id, 0) - holder.free_bytes
                if need > 0:
                    cost += view.eviction_ms(holder.engine_id, need, now)
            if cost > floor:  # fire iff C_e < (C_h - slack) / ratio: explore stops there
                found = self._explore(
                    ctx,
                    view,
                    now,
                    ok,
                    p_cache,
                    pd_balance=False,
                    limit=(cost - slack) / ratio,
                    reason="replicate",
                    detail=f"guard: exploit {holder.engine_id} costs {cost:.0f} ms",
                )
                if found is not None and found.engine_id != holder.engine_id:
                    return found
        return decide(self.name, "exploit", holder, view)

    def _p(self, ev: EngineView, key_len: int, view: ClusterView, p_cache: PrefillCache) -> float:
        """P_i as explore prices it (0 without the prefill term)."""
        if not self.config.prefill_term:
            return 0.0
        return prefill_cost_ms(ev, key_len, view.matched.get(ev.engine_id, 0), p_cache)

    def _explore(
        self,
        ctx: RequestContext,
        view: ClusterView,
        now: float,
        ok: Callable[[EngineView], bool],
        p_cache: PrefillCache,
        *,
        pd_balance: bool,
        limit: float = float("inf"),
        reason: Reason | None = None,
        detail: str = "",
    ) -> Decision | None:
        """Cheapest feasible engine by L + M + P, by branch and bound: engines come cheapest
        ``L + P`` first (lazily, see :class:`_CostOrder`: only the few that could win are
        scored), and feasibility and M (>= 0) are computed only while they can still change
        the answer. Only engines cheaper than ``limit`` count (None: none is); ``reason``
        replaces the pool's reason in the decision."""
        cfg = self.config
        matched = view.matched
        key_len = ctx.key_len
        get = matched.get
        if cfg.prefill_term:

            def p_of(ev: EngineView) -> float:
                m = get(ev.engine_id, 0)
                p = p_cache.get((ev.profile.name, key_len, m))  # prefill_cost_ms's, inline
                return p if p is not None else prefill_cost_ms(ev, key_len, m, p_cache)

        else:

            def p_of(ev: EngineView) -> float:
                return 0.0

        order = _CostOrder(view, key_len, p_of, p_cache if cfg.prefill_term else None)
        pools: list[tuple[Reason, Iterable[tuple[float, int, EngineView]]]] = []
        if pd_balance:
            thr = cfg.pd_hit_ratio
            decode_heavy = [
                (ev.load_ms + p_of(ev), ev.load_ms, i, ev)
                for i, ev in enumerate(view.engines)
                if ev.hit_ratio >= thr
            ]
            if decode_heavy:  # (L + P, L, position) order, as the explore order
                decode_heavy.sort(key=_COST_POS)
                pools.append(("pd_balance", [(lp, i, ev) for lp, _, i, ev in decode_heavy]))
        pools.append(("explore", order))
        for pool_reason, pool in pools:
            # Feasibility is checked lazily: the tie pool is gathered unchecked and only the
            # pick is checked. A pick that fails joins ``infeasible`` and the pool is gathered
            # again without it (the order re-reads what it has read); from then on every
            # engine is checked as it is read, so shedding an overloaded cluster stays one
            # pass. As with checking everything up front, the pick is one of the cheapest
            # feasible engines (ties broken as below).
            infeasible: set[str] = set()
            eager = False
            m_memo: dict[str, float] = {}
            while True:
                best = _INF
                evaluated: list[tuple[float, EngineView, float]] = []  # (total, view, M)
                for lp, _, ev in pool:
                    if lp > best or lp >= limit or (lp == best and len(evaluated) >= TIE_LIMIT):
                        break
                    eid = ev.engine_id
                    if eid in infeasible:
                        continue
                    if eager and not ok(ev):
                        infeasible.add(eid)
                        continue
                    mcost = 0.0
                    if cfg.eviction_term:
                        need = key_len - get(eid, 0) - ev.free_bytes
                        if need > 0:
                            m = m_memo.get(eid)
                            if m is None:
                                m = m_memo[eid] = view.eviction_ms(eid, need, now)
                            mcost = m
                            if lp + mcost >= limit:
                                continue
                    evaluated.append((lp + mcost, ev, mcost))
                    if lp + mcost < best:
                        best = lp + mcost
                if not evaluated:
                    break
                # ties on cost break on load, then in flight, then the rng
                finalists = [t for t in evaluated if t[0] == best]
                if len(finalists) > 1:
                    key = min(by_load(t[1]) for t in finalists)
                    finalists = [t for t in finalists if by_load(t[1]) == key]
                pick = finalists[view.rng.randrange(len(finalists))] if len(finalists) > 1 else None
                chosen = (pick or finalists[0])[1]
                if eager or ok(chosen):
                    break
                infeasible.add(chosen.engine_id)
                eager = True
            if not evaluated:
                continue
            return decide(
                self.name,
                reason or pool_reason,
                chosen,
                view,
                listing=_ExploreListing(
                    chosen,
                    evaluated,
                    matched,
                    view.engines,
                    key_len,
                    cfg.max_candidates,
                    p_cache if cfg.prefill_term else None,
                ),
                detail=detail,
            )
        return None

    def rebalance(self, ctx: RequestContext, view: ClusterView, now: float) -> tuple[Move, ...]:
        cfg = self.config
        if not cfg.rebalance or len(view.engines) < 2:
            return ()
        if view.min_routed() < cfg.warmup_requests:
            return ()
        # the least and the most loaded (equal loads: the first in engine order, as min/max)
        # Preble's rule on the windowed L (the work a move re-attributes), in any load mode
        extremes = view.load_extremes(window=True)
        if extremes is None:
            return ()
        least, busiest = extremes
        hi, lo = busiest.window_ms, least.window_ms
        if hi <= 0.0 or hi < cfg.rebalance_ratio * lo:
            return ()
        moves: list[Move] = []
        for g in view.groups_on(busiest.engine_id, cfg.min_group_requests):
            if g.requests < cfg.min_group_requests:
                continue
            # a group moved here earlier may move on (else the target of a move can only pile
            # up: its moved groups were pinned to it for the whole window); one moved elsewhere
            # left only history here
            target = view.override(g.group)
            if target is not None and target != busiest.engine_id:
                continue
            reps = view.replicas(g.group)
            # too heavy to move (moving it would only swap the roles), or already replicated
            # (moving one copy would pin every replica's traffic to one engine): a hot prefix
            if g.load_ms >= hi - lo or reps:
                first, second = view.ttft_halves(g.group, now)
                if (
                    first > 0.0
                    and second >= cfg.replicate_ttft_ratio * first
                    and least.engine_id not in reps
                ):
                    moves.append(Move(g.group, busiest.engine_id, least.engine_id, "replicate"))
                continue
            moves.append(Move(g.group, busiest.engine_id, least.engine_id))
            hi -= g.load_ms
            lo += g.load_ms
            if hi < cfg.rebalance_ratio * lo:  # balanced: stop before reading another group
                break
        return tuple(moves)


class _ExploreListing:
    """Explore's candidates (a ``router.api.Listing``), built when first read from what was
    scored anyway: the chosen, the next cheapest scored, and the engines holding the most of the
    key (no extra engine is scored for this; M is listed as 0 for an unscored one). It keeps the
    decision-time inputs, which nothing changes afterwards: the scored ``(total, view, M)``
    tuples, the decision's matched map and candidate list (immutable ``EngineView`` snapshots),
    and P's memo (a pure function's: a value it lost is recomputed the same)."""

    __slots__ = ("chosen", "engines", "evaluated", "key_len", "limit", "matched", "p_cache")

    def __init__(
        self,
        chosen: EngineView,
        evaluated: list[tuple[float, EngineView, float]],
        matched: Mapping[str, int],
        engines: Sequence[EngineView],
        key_len: int,
        limit: int,
        p_cache: PrefillCache | None,
    ) -> None:
        self.chosen = chosen
        self.evaluated = evaluated
        self.matched = matched
        self.engines = engines
        self.key_len = key_len
        self.limit = limit
        self.p_cache = p_cache  # None: without the prefill term (P listed as 0)

    def candidates(self) -> tuple[Candidate, ...]:
        matched = self.matched
        evaluated = sorted(self.evaluated, key=_TOTAL)
        m_of = {t[1].engine_id: t[2] for t in evaluated}
        listed = [self.chosen, *(t[1] for t in evaluated[: self.limit])]
        top = top_matched(matched, self.limit)
        if top:
            by_id = {ev.engine_id: ev for ev in self.engines}
            for engine_id, _ in top:
                if (hv := by_id.get(engine_id)) is not None:
                    listed.append(hv)
        cands: dict[str, Candidate] = {}
        p_cache = self.p_cache
        for ev in listed:
            eid = ev.engine_id
            if eid not in cands:
                m = matched.get(eid, 0)
                p = prefill_cost_ms(ev, self.key_len, m, p_cache) if p_cache is not None else 0.0
                cands[eid] = Candidate(eid, m, ev.load_ms, m_of.get(eid, 0.0), p)
        return tuple(cands.values())


def _holders_by_length(matched: Mapping[str, int]) -> dict[int, int]:
    """How many engines hold each matched length. Usually one or two lengths occur (a shared
    system prompt held by most engines): those are counted in typed locals, one comparison per
    engine; a dict takes the rest."""
    first, second = -1, -1
    n_first, n_second = 0, 0
    rest: dict[int, int] = {}
    for m in matched.values():
        if m == first:
            n_first += 1
        elif m == second:
            n_second += 1
        elif n_first == 0:
            first, n_first = m, 1
        elif n_second == 0:
            second, n_second = m, 1
        else:
            rest[m] = rest.get(m, 0) + 1
    if n_second:
        rest[second] = n_second
    if n_first:
        rest[first] = n_first
    return rest


class _CostOrder:
    """The candidates as ``(L + P, position, view)`` in ascending ``(L + P, L, position)``
    order (equal costs: the lower load first, as the final tie-break prefers), lazily.

    P depends only on an engine's class (its profile and matched length). The engines of the
    rare classes (matched lengths held by at most ``EXPLICIT_CLASS`` engines) are scored up
    front; the rest come from ``view.by_load()`` (ascending ``(L, position)``), so within a
    class the key grows too. All go into a heap keyed by the exact ``(L + P, L, position)``,
    whose top is final once no unread engine can sort before it: the unread engines of a class
    already in the heap sort after that member, the others at or after ``(next L + floor, next
    L, next position)``, ``floor`` being the least P of the classes not in the heap. So reading
    the k cheapest scores about one engine per class plus the k, not every engine; the order
    equals sorting every candidate by ``(L + P, L, position)``. Items read are kept (the order
    can be re-read). Classes are small integers (lists, not tuple-keyed dicts: this is the
    router's hottest loop)."""

    __slots__ = (
        "_class_of",
        "_explicit",
        "_floor",
        "_heap",
        "_in_heap",
        "_matched",
        "_next",
        "_p_of",
        "_price",
        "_priced",
        "_pushed",
        "_source",
        "seen",
    )

    def __init__(
        self,
        view: ClusterView,
        key_len: int,
        p_of: Callable[[EngineView], float],
        cache: PrefillCache | None,
    ) -> None:
        self._p_of = p_of
        matched = view.matched
        self._matched = matched
        self._class_of: dict[str, dict[int, int]] = {}  # profile -> matched length -> class
        self._price: list[float] = []  # class -> P
        self._in_heap: list[int] = []  # class -> its streamed engines in the heap
        self._priced = False  # every streamed engine's class is priced (floor is exact)
        self._explicit: set[int] = set()  # matched lengths whose engines are scored up front
        self._floor = 0.0  # least P an unread engine may have
        self._heap: list[tuple[float, float, int, int, EngineView, int]] = []
        self._pushed = 0  # a unique fourth key, so the heap never compares views
        self.seen: list[tuple[float, int, EngineView]] = []
        if cache is not None:  # with the prefill term: price every class there may be
            holders = _holders_by_length(matched)  # matched length -> engines holding it
            rare = {m for m, n in holders.items() if n <= EXPLICIT_CLASS and m > 0}
            lengths = [m for m in holders if m not in rare]
            if 0 not in holders:
                lengths.append(0)
            profiles = view.profiles()
            if len(lengths) * len(profiles) <= FLOOR_TERMS:
                for prof in profiles:
                    ids = self._class_of[prof.name] = {}
                    for m in lengths:
                        ids[m] = len(self._price)
                        self._price.append(prefill_cost_ms_for(prof, key_len, cache, m))
                        self._in_heap.append(0)
                self._floor = min(self._price)
                self._priced = True
                self._explicit = rare
                if rare:
                    for engine_id, m in matched.items():
                        if m in rare and (ev := view.engine(engine_id)) is not None:
                            self._push(ev, -1)
            # else: too many classes to price cheaply; 0 is a bound too, only a looser one
        self._source = view.by_load()
        self._next = next(self._source, None)

    def _push(self, ev: EngineView, cls: int) -> None:
        p = self._price[cls] if cls >= 0 else self._p_of(ev)
        self._pushed += 1
        load = ev.load_ms
        heappush(self._heap, (load + p, load, ev.position, self._pushed, ev, cls))

    def _pull(self) -> tuple[float, int, EngineView] | None:
        heap = self._heap
        nxt = self._next
        matched = self._matched
        in_heap = self._in_heap
        explicit = self._explicit
        while nxt is not None:
            if heap:  # stop once (L + floor, L, position) of nxt sorts after the top
                top = heap[0]
                load = nxt.load_ms
                bound = load + self._floor
                if bound != top[0]:
                    if bound > top[0]:
                        break
                elif load != top[1]:
                    if load > top[1]:
                        break
                elif nxt.position > top[2]:
                    break
            ev = nxt
            nxt = next(self._source, None)
            if not self._priced:
                self._push(ev, -1)
                continue
            m = matched.get(ev.engine_id, 0)
            if m in explicit:
                continue  # in the heap from the start
            ids = self._class_of.get(ev.profile.name)
            cls = ids.get(m, -1) if ids is not None else -1
            if cls < 0:  # a profile view.profiles() missed: from now on, a floor of 0
                self._priced = False
                self._floor = 0.0
                self._push(ev, -1)
                continue
            n = in_heap[cls]
            in_heap[cls] = n + 1
            if n == 0:  # the class is no longer open: the floor may rise
                self._floor = self._open_floor()
            self._push(ev, cls)
        self._next = nxt
        if not heap:
            return None
        lp, _, pos, _, ev, popped = heappop(heap)
        if popped >= 0 and self._priced:
            n = in_heap[popped] - 1
            in_heap[popped] = n
            if n == 0:  # its next member may be anywhere in the unread part again
                p = self._price[popped]
                if p < self._floor:
                    self._floor = p
        item = (lp, pos, ev)
        self.seen.append(item)
        return item

    def _open_floor(self) -> float:
        """The least P of the classes with no engine in the heap (inf: none)."""
        floor = _INF
        in_heap = self._in_heap
        for c, p in enumerate(self._price):
            if in_heap[c] == 0 and p < floor:
                floor = p
        return floor

    def __iter__(self) -> Iterator[tuple[float, int, EngineView]]:
        seen = self.seen
        i = 0
        while True:
            if i < len(seen):
                yield seen[i]
            elif (item := self._pull()) is not None:
                yield item
            else:
                return
            i += 1

    def first(self, k: int) -> list[tuple[float, int, EngineView]]:
        """The ``k`` cheapest (fewer when there are fewer candidates)."""
        while len(self.seen) < k and self._pull() is not None:
            pass
        return self.seen[:k]
