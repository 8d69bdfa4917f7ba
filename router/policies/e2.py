"""E2 (Preble's exploit or explore), its cost made a prediction of the request's time to first
token on each engine, plus the work it takes from others.

Preble (arXiv 2407.00023) exploits when most of the key is cached (the least-loaded holder of
the longest match) and otherwise explores by ``L_i + M_i + P_i``: ``L`` the work routed to the
engine in a 3-minute window, ``M`` the cost of what fitting the request would evict, ``P`` the
prefill of the part not cached there. On kvgate's routing matrix (``kvgate bench matrix``)
that rule lost to round robin and to SGLang's ``cache_aware`` for four causes: exploit piled a
shared prefix onto one engine whatever its queue; ``L`` counted history, not the queue a request
joins; partial blocks were credited as cached; the SLO filter shed requests an engine would have
served. So E2 keeps Preble's terms but asks of every engine *when would this request's first
token come out there, and what does it cost others*. Each term's reasons and measurements:
docs/router.md, *E2: what the matrix showed, and what changed*.

The cost of engine ``i``::

    C_i = TTFT_i + M_i + w x (P_i x (1 + behind_i + arrivals_i) + decode_i) + miss_i
    TTFT_i = (queue_i + P_i) / share_i x stretch_i + admit_i + D_i

* ``TTFT_i``, the router's latency model (:mod:`router.policies.feasibility`): the prefill the
  engine's S-EDF scheduler runs first (``queue_i``: work due no later that can still make its
  deadline), this request's own prefill after its cached whole blocks (Preble's ``P``; on an
  engine that announces it prefills a prompt in chunks, chunk by chunk, each attending to the
  ones before it: :meth:`kvgate.cost_model.CostProfile.prompt_prefill_ms`), slowed by the GPU
  share the decode batch takes (``share_i``) and stretched by the work due sooner
  that will arrive and overtake it (``stretch_i = 1 / (1 - busy_i x sooner)``), plus any wait
  for SCORPIO's VBS admission or for KV memory (``admit_i``) and the decode iteration before
  the first prefill slice (``D_i``). On an engine that serves in arrival order (vLLM's own
  scheduler, as its heartbeat says) the whole queue runs first and nothing overtakes. A prefix
  only routed there, not yet announced by a block event, counts as cached if a request there
  computes it before this one starts. All times are the engine's profile corrected by its
  fitted speed (:class:`kvgate.cost_model.SpeedFit`).
* ``M_i``, Preble's eviction cost: hit count x miss rate x prefill time of each prefix the
  engine's LRU would evict, each capped at one recompute (the next request that wants it
  prefills it once more; uncapped, a full engine's old copy of a popular document was priced
  at dozens of prefills and that engine starved) (:meth:`router.view.View.eviction_ms`).
* The work (weight ``w``, ``work_weight``): the request's prefill is GPU time (the 1) that
  delays the requests queued behind it (``behind_i``) and those arriving before its queue
  drains (``arrivals_i``: recent request rate x ``TTFT_i`` over ``1 - `` prefill
  utilization); ``decode_i`` is its place in the decode batch (decode GPU time x ``fill / (1 -
  fill)``; where requests already wait for a place, at least the delay that place adds to the
  line) and the KV memory it holds while it decodes, priced by how full the engine's memory is
  (:func:`router.policies.feasibility.kv_harm_ms`). At light load the work is about ``P_i``;
  under load it dominates, so a loaded fleet keeps prefixes where they are cached and fills
  decode batches evenly. ``idle_free`` (off) charges no GPU time on an idle engine.
* ``miss_i`` (``miss_penalty``): where the first token could not come within the TTFT SLO even
  with nothing overtaking (``Estimate.ttft_floor_ms``), one TTFT SLO in ms: a delay spread over
  requests whose slack lies anywhere within their SLO makes about one of them miss per SLO of
  it, so a request lost weighs about one SLO.

Exploit and explore are the two outcomes of this one rule: the holder of the longest match is
usually cheapest, until its queue costs more than prefilling the prefix elsewhere (a hot prefix
gets a second copy exactly then).

* Tie band: engines within ``tie_rel x C_min + tie_ms`` of the cheapest are equally good (the
  predictions are not that precise). Among them the one holding the most of the key wins (a
  prefix's requests stay together); then, of the engines with room for the rest of the key
  (free KV less what the prefills routed there will write), the least recent traffic for its
  speed (``spread_by_traffic``: the later requests sharing the new part follow it, and traffic
  predicts their queue better than the work in flight at this instant); then the least
  outstanding work (which spreads new prefixes over full caches evenly); then the injected rng.
* Among the holders, the fast lanes kept (``decode_delay``, on): of every engine holding as
  much of the key as the one chosen, the cheapest by ``C_i`` plus what the request's decode
  does to that engine's prefills (``Estimate.decode_delay_ms``: each ms of a decode step is a
  ms every prefill there waits, the ones due sooner too, priced as their misses at this
  request's SLO). Where a long-context prefix is held everywhere (an agent prompt), its
  requests gather on the engines whose prefills are due late and leave the others to the
  requests due soon; the holder-or-not question stays the cost's (weighed in the cost itself,
  it sent long documents off their holders: docs/router.md, *Fifty-eighth session*). Only
  where the holders hold at least half of the key: a request that prefills most of its prompt
  wherever it goes is no long-context prefix's, and holding its opening (a trace's common
  first blocks, on every engine) made the whole fleet its holders (*Sixtieth session*). Where
  a holder in the band is expected to meet the request's TTFT SLO, only such holders are
  weighed: the lane is not bought with the request's own expected miss (*Fifty-ninth
  session*).
* SLO: an engine that cannot decode the request within its TPOT SLO is skipped (on an
  arrival-order engine: its whole batch's TPOT, and no request decoding there pushed past its
  own, :func:`router.policies.feasibility.arrival_order_tpot_ms`). The request is routed even
  when no engine is expected to meet its TTFT SLO; it is shed (429, naming the engine it would
  have gone to) only when even the best would miss by more than ``shed_factor`` x the SLO with
  nothing overtaking it: shedding is final. Where no engine of the tie band is expected to
  meet the SLO, on engines that refuse a late request while it waits (S-EDF;
  ``doomed_to_holder``), it goes among the engines holding the most of its key (cached or
  routed there) to the one where its first token could come soonest
  (``Estimate.ttft_floor_ms``), and the holder's lane (below) is not weighed: refused while it
  waits, it costs the others nothing wherever it goes, so what is left to choose is where its
  key is counted and its best chance of running after all (an engine outside the band that
  could serve it in time is then that chance, whatever it costs the others: the cost weighs
  the request's miss at one SLO only where the band has an engine expected in time). By cost
  alone, an overloaded fleet's doomed requests seeded their prefixes on whichever engine was
  cheapest, and the next requests of a prefix followed them there; a conversation's late turn
  went to a cold engine and prefilled its whole history there; and among the holders, the
  work term sent short requests away from the engine taking most of them, whose expected TTFT
  counts the doomed requests queued there, which never run (docs/router.md, *Sixty-fourth
  session*). An engine serving in arrival order runs such a request ahead of the ones behind
  it, so there the cost decides.
* Big fleets: only ``contenders`` engines are scored (the top holders and the least loaded, the
  rest drawn at random), every engine before a shed; of those, an engine whose lower bound on
  ``C_i`` is past the band of the cheapest found is not estimated (``bound_skip``: the same
  decisions, half the time on 1,024 engines).
* Prefill/decode balance (Preble's; ``pd_balance``, off): within the band, a mostly uncached
  request prefers an engine whose recent work is mostly cached (a GPU overlaps prefill with
  memory-bound decode; kvgate's simulated engine does not model that).
* Rebalancing (Preble's; ``rebalance``, on; :meth:`E2.rebalance`): once ``warmup_requests`` an
  engine have been routed, when the busiest engine is ``rebalance_ratio`` x the least busy's
  windowed load (output tokens priced at one TPOT) and ``balance_trigger`` x the fleet's mean
  (by load or by requests), prefix groups lighter than the gap move from it to the least busy
  engine that is not slower (``SAME_SPEED``) and has room for them beside every prefix reused
  there (``make_way``: beside the ones reused as often, where no engine has such room), the
  group that leaves the two closest to even first (``moves_by_fit``; Preble moves the heaviest
  first); a hot prefix whose TTFT doubled over the window is replicated instead. A moved or
  replicated group's requests follow it only where its new engine is in the tie band, or
  (``follow_spare``) has room to spare and would be in the band if it held the prefix, the
  copy costing no more than the band's share of the SLO (followed everywhere, Preble's moves
  lost 0.7 points on the held-out Mooncake trace; never followed, the books balanced and the
  engines did not). A prefix is placed when its first request comes, before its popularity
  shows, and at light load no queue moves its later requests: only rebalancing undoes the
  layout a cold start drew (in a replica of the real-vLLM benchmark one engine took over 45%
  of the requests in 36 of 200 runs without it, 5 with it).
* Replicas on spare engines (``replicate_to_spare``, on): the cost prices a copy of a prefix for
  the request that makes it, never for the requests that will find it, so a flash crowd of one
  system prompt queued on its first holders while other engines idled. A request of a hot
  prefix (on two engines or more, the heaviest group on the best one) goes to the least loaded
  engine with room to spare that would beat the best past the band if it held the prefix, when
  the copy's extra cost is repaid by that gain on the prefix's requests expected while the best
  engine's queue lasts.

Ablation flags (``bench/sim/policies.py`` names them): ``eviction_term``, ``slo_filter``,
``work_weight=0``, ``idle_free``, ``tie_rel=0,tie_ms=0``, ``spread_by_traffic``,
``prefer_feasible``, ``miss_penalty=0``, ``doomed_to_holder=false``, ``pd_balance``,
``rebalance=false``, ``follow_spare=false``, ``replicate_to_spare=false``,
``room_beside_all_reused=false``, ``balance_trigger=0``, ``make_way=false``,
``moves_by_fit=false``, ``decode_delay=false``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import ClassVar

from router.api import Candidate, Decision, Reason
from router.policies.base import (
    ClusterView,
    EngineView,
    GroupLoad,
    Move,
    PolicyBase,
    PrefillCache,
    RequestContext,
    by_load,
    decide,
    pick_min,
    prefill_cost_ms,
    top_matched,
)
from router.policies.feasibility import (
    TPOT_MISS_RETRY_MS,
    Estimate,
    estimate,
    mostly_cached,
    prefill_busy,
    rate_decay,
    recent_rate,
    retry_after,
    shed,
)


@dataclass(frozen=True, slots=True)
class E2Config:
    """E2's switches and thresholds."""

    eviction_term: bool = True  # M_i
    slo_filter: bool = True  # shed when no engine can meet the SLO (by shed_factor)
    # only engines predicted to meet the SLO, while there are any (off: ``miss_penalty`` prices
    # the miss instead; outright, overloaded cells lost up to 5 points; docs/router.md)
    prefer_feasible: bool = False
    shed_factor: float = 1.5  # shed only when even the best engine's TTFT > this x the SLO
    # judge shedding on the expected TTFT (overtakers included) instead of the soonest the
    # first token could come: admission control that sheds earlier, before a queue snowballs
    # (more attainment in overload, but a third of what it sheds would have made it)
    shed_expected: bool = False
    # a request that no engine of the tie band is expected to serve within its TTFT SLO, on
    # engines that refuse it while it waits (S-EDF), goes among the engines holding (or routed)
    # the most of its key to the one where its first token could come soonest: lost at no one's
    # cost wherever it goes, it is where its key is counted and has its best chance (off: the
    # cheapest engine; docs/router.md, *Fifty-fifth*, *Fifty-ninth* and *Sixty-fourth session*)
    doomed_to_holder: bool = True
    tie_rel: float = 0.05  # tie band: within tie_rel x C_min + tie_ms of the cheapest
    tie_ms: float = 5.0
    # within the band, among equal holders with room for the key: the least recent traffic
    # for its speed first
    # (off: the least outstanding work first)
    spread_by_traffic: bool = True
    # where the holders hold at least half of the key, of the engines holding as much of it as
    # the one chosen (those expected to meet its TTFT SLO, where one in the band is), the
    # cheapest counting the delay its decode adds to each one's prefills, priced as their
    # misses (off: the cost alone; held-out hot_prompt lost up to 7 points, its agent
    # prompt's decodes on every engine)
    decode_delay: bool = True
    work_weight: float = 1.0  # x the request's own prefill GPU time (what it delays others by)
    # an engine where the request cannot meet its TTFT SLO (even with nothing overtaking it) is
    # charged this x the SLO in ms: a request lost weighs about one SLO of delay to others
    # (0: off, the cheapest engine whether it can meet the SLO or not; docs/router.md)
    miss_penalty: float = 1.0
    # an idle engine's GPU time (nothing in flight or queued there, room for the request without
    # evicting) is nobody's: a prefill there is charged only for the requests it delays (off:
    # it wins programming's flash crowds but cost hit rate on real vLLM; docs/router.md)
    idle_free: bool = False
    pd_balance: bool = False  # prefill-heavy requests to decode-heavy engines within the band
    pd_hit_ratio: float = 0.7
    # Preble's post-assignment moves and hot-prefix replication, followed within the tie band
    rebalance: bool = True
    # a move followed also where the new engine would be in the band if it held the prefix and
    # has room to spare (``Estimate.spare``): the copy's one prefill as an investment (off: the
    # books moved while the requests stayed, and on real vLLM an engine kept 45% of them)
    follow_spare: bool = True
    # a request of a hot shared prefix whose holders are congested goes to an engine with room
    # to spare, which copies the prefix, where the requests of the prefix expected while the
    # congestion lasts repay the copy (off: new copies only where the cost alone finds them)
    replicate_to_spare: bool = True
    # a group moves only where it fits beside every prefix reused there (off: beside the ones
    # reused at least as often as it, the others making way; but their requests keep coming
    # there, and the cache thrashes; docs/router.md)
    room_beside_all_reused: bool = True
    rebalance_ratio: float = 1.5
    # ... and only while the busiest engine takes at least this x the fleet's mean, by
    # windowed load or by requests (the load bound; 0: Preble's ratio alone)
    balance_trigger: float = 1.3
    # where no engine tried has room for a group beside every prefix reused there, the ones
    # reused less often than it make way (the caches cannot hold every prefix reused, and a
    # move that waits for room waits for ever; off: no move)
    make_way: bool = True
    # of the groups light enough to move, the one that leaves the two engines closest to even
    # first (off: Preble's heaviest first, which moves the hottest prefix whenever it is
    # lighter than the gap: the least busy engine may end nearly as busy, and as a moved
    # group's requests follow it only within the tie band, the hottest prefix was split over
    # two engines; docs/router.md)
    moves_by_fit: bool = True
    warmup_requests: int = 50
    min_group_requests: int = 2
    replicate_ttft_ratio: float = 2.0
    max_candidates: int = 4  # cheapest engines listed in a decision (plus the top holders)
    contenders: int = 16  # engines scored in a bigger fleet: top holders + least loaded
    # estimate only the contenders whose lower bound on the cost is within the tie band of the
    # cheapest found (off: every contender; the same decisions, measured and tested)
    bound_skip: bool = True

    def __post_init__(self) -> None:
        if self.shed_factor < 1:
            raise ValueError("e2: shed_factor must be >= 1 (never shed a request that fits)")
        if self.tie_rel < 0 or self.tie_ms < 0:
            raise ValueError("e2: tie_rel and tie_ms must be >= 0")
        if self.contenders < 2:
            raise ValueError("e2: contenders must be >= 2")
        if self.work_weight < 0:
            raise ValueError("e2: work_weight must be >= 0")
        if self.miss_penalty < 0:
            raise ValueError("e2: miss_penalty must be >= 0")
        if self.balance_trigger < 0:
            raise ValueError("e2: balance_trigger must be >= 0 (0: Preble's ratio alone)")


SAME_SPEED = 1.25  # rebalancing moves work only to an engine at most this much slower
REBALANCE_TARGETS = 4  # rebalancing tries the least busy engines, at most this many
P_CACHE_MAX = 4096  # memoised prefill costs kept across decisions (then it starts over)
BOUND_SLACK = 1.0 - 1e-9  # a cost's lower bound, rounded down (it is computed differently)


class _Scored:
    """One engine's cost for the request (the eviction term only where it could matter)."""

    __slots__ = ("base", "cost", "est", "ev", "eviction", "matched", "priced")

    def __init__(
        self,
        ev: EngineView,
        est: Estimate,
        matched: int,
        work_weight: float,
        idle: bool,
        slo_ms: float,
        miss_penalty: float,
    ) -> None:
        self.ev = ev
        self.est = est
        self.matched = matched
        self.eviction = 0.0
        self.priced = False  # the eviction term is in ``cost``
        # its prefill's GPU time, unless the engine would otherwise idle (``idle_free``)
        gpu = 0.0 if idle else 1.0
        work = est.own_work_ms * (gpu + est.behind + est.arrivals) + est.decode_harm
        self.base = est.ttft_ms + work_weight * work  # the cost before the eviction term
        if est.ttft_floor_ms > slo_ms:  # it cannot meet its SLO there: the miss's price
            self.base += miss_penalty * slo_ms
        self.cost = self.base

    def overflow(self, key_len: int) -> int:
        """Bytes of the key beyond what the engine holds and its free KV (> 0: it evicts)."""
        return key_len - self.matched - self.ev.free_bytes


class E2(PolicyBase):
    name: ClassVar[str] = "e2"
    load_mode = "outstanding"  # EngineView.load_ms: in-flight work (the tie-break's balance)

    def __init__(self, config: E2Config | None = None) -> None:
        self.config = config or E2Config()
        # the profile's prefill time by (profile, key bytes, matched bytes), across decisions
        self._p_cache: PrefillCache = {}

    def choose(self, ctx: RequestContext, view: ClusterView, now: float) -> Decision:
        cfg = self.config
        if len(self._p_cache) > P_CACHE_MAX:
            self._p_cache.clear()
        matched = view.matched
        contenders = self._contenders(view)
        scored = self._scored(contenders, ctx, view, now)
        slo_ms = ctx.request.slo.ttft_ms
        pool = [s for s in scored if s.est.tpot_ok]
        shed_ttft = _expected if cfg.shed_expected else _soonest
        if cfg.slo_filter:
            feasible = [s for s in pool if shed_ttft(s) <= slo_ms]
            if not feasible and len(scored) < len(view.engines):
                # before shedding, every engine (the contenders were only the likely best)
                scored = self._score_all(contenders, scored, ctx, view, now)
                pool = [s for s in scored if s.est.tpot_ok]
                feasible = [s for s in pool if shed_ttft(s) <= slo_ms]
            if not feasible:
                best = min(pool, key=shed_ttft, default=None)
                if best is None or shed_ttft(best) > cfg.shed_factor * slo_ms:
                    return shed(
                        self.name,
                        ctx,
                        retry_after(shed_ttft(best) - slo_ms if best else TPOT_MISS_RETRY_MS),
                        "no engine can meet the SLO"
                        + (
                            f": the best, {best.ev.engine_id}, in ~{shed_ttft(best):.0f} ms"
                            if best
                            else " (no engine can decode it within its TPOT SLO without pushing"
                            " the requests decoding there past theirs)"
                        ),
                        fallback=_fallback(best, scored),
                    )
            elif cfg.prefer_feasible:
                pool = feasible
        if not pool:  # (slo_filter off and no engine meets the TPOT SLO: cheapest anyway)
            pool = scored
        finalists = self._band(pool, ctx, view, now)
        doomed = cfg.doomed_to_holder and _doomed(finalists, slo_ms)
        if doomed:
            routed = view.matched
            held = _most_held(pool, lambda s: routed.get(s.ev.engine_id, 0))
            if len(held) < len(pool):
                pool = held
            finalists = self._near_best(pool, _soonest)
        if cfg.rebalance:
            moved = self._rebalanced(ctx, view, finalists, now)
            if moved is not None:
                return moved
        if cfg.replicate_to_spare:
            spare = self._spare_replica(ctx, view, finalists, now)
            if spare is not None:
                return decide(self.name, "replicate", spare, view)
        reason: Reason = "explore"
        if cfg.pd_balance and ctx.key_len and not mostly_cached(finalists[0].matched, ctx.key_len):
            heavy = [s for s in finalists if s.ev.hit_ratio >= cfg.pd_hit_ratio]
            if heavy and len(heavy) < len(finalists):
                finalists, reason = heavy, "pd_balance"
        holders = _most_held(finalists, _credited)
        most = holders[0].matched
        tie_break = _Traffic(now, ctx.key_len) if cfg.spread_by_traffic else _Balance(now)
        if cfg.decode_delay and not doomed and mostly_cached(most, ctx.key_len):
            holders = self._least_delay(pool, most, holders, slo_ms)
        chosen = pick_min(holders, tie_break, view.rng).ev
        if reason == "explore" and most > 0 and most >= max(matched.values(), default=0):
            reason = "exploit"
        return decide(
            self.name,
            reason,
            chosen,
            view,
            listing=_Listing(chosen, scored, matched, ctx.key_len, cfg.max_candidates),
        )

    def _score(self, ev: EngineView, ctx: RequestContext, view: ClusterView, now: float) -> _Scored:
        eid = ev.engine_id
        est = estimate(
            ev, ctx, view.matched.get(eid, 0), view, now, self._p_cache, view.confirmed.get(eid, 0)
        )
        cfg = self.config
        # an idle engine that fits the request without evicting anything: its GPU time and its
        # memory are nobody's
        idle = (
            cfg.idle_free
            and ev.inflight <= 0
            and est.queue_ms <= 0
            and ctx.key_len - est.credited <= ev.free_bytes
        )
        return self._scored_as(ev, est, est.credited, ctx, idle)

    def _scored_as(
        self, ev: EngineView, est: Estimate, matched: int, ctx: RequestContext, idle: bool = False
    ) -> _Scored:
        """``ev``'s cost for the request given its estimate there."""
        cfg = self.config
        slo_ms = ctx.request.slo.ttft_ms
        return _Scored(ev, est, matched, cfg.work_weight, idle, slo_ms, cfg.miss_penalty)

    def _scored(
        self, contenders: list[EngineView], ctx: RequestContext, view: ClusterView, now: float
    ) -> list[_Scored]:
        """The contenders that could be in the tie band, scored (in contender order, so that
        ties resolve as if all were). Each engine's cost is at least its own prefill in its
        TTFT, and again as the work it adds for itself and the requests arriving meanwhile:
        ``P_i x (1 + w x (1 + rate_i x P_i / (1 - busy_i)))`` (queueing, overtakers, admission,
        the requests queued behind, decode, a busy decoder's share of the GPU, the eviction
        term and the miss only add; ``busy_i`` at full share), so they are scored lowest bound
        first, and the rest is skipped once a bound is past the band of the cheapest cost
        found. Where the key is cached on few engines, the others' bound (a whole prefill) is
        past the holders' cost and they are never estimated: the estimate is the largest part
        of a decision (docs/router.md). The skipped ones cannot be picked; they are scored only
        if no scored engine can meet the SLO (before shedding, :meth:`_score_all`)."""
        cfg = self.config
        if cfg.prefer_feasible or not cfg.bound_skip:
            # (prefer_feasible: the band is over the feasible ones, whose cheapest is unknown)
            return [self._score(ev, ctx, view, now) for ev in contenders]
        matched = view.matched
        confirmed = view.confirmed
        cache = self._p_cache
        key_len = ctx.key_len
        w = cfg.work_weight
        gpu = 0.0 if cfg.idle_free else 1.0  # (its GPU time may be free on an idle engine)
        bounded: list[tuple[float, int, EngineView]] = []
        for i, ev in enumerate(contenders):
            eid = ev.engine_id
            m = matched.get(eid, 0)
            own = prefill_cost_ms(ev, key_len, m, cache)
            c = confirmed.get(eid, 0)
            if c < m:  # (the estimate may count only the confirmed part as cached)
                own = min(own, prefill_cost_ms(ev, key_len, c, cache))
            decay = rate_decay(ev, now)
            busy = prefill_busy(ev, decay)
            arrivals = ev.rate_per_s * decay * own / 1000.0 / (1.0 - busy)
            bounded.append((own * (1.0 + w * (gpu + arrivals)) * BOUND_SLACK, i, ev))
        bounded.sort(key=_first_two)
        out: list[tuple[int, _Scored]] = []
        best = limit = math.inf
        for bound, i, ev in bounded:
            if bound > limit:
                break
            s = self._score(ev, ctx, view, now)
            out.append((i, s))
            if s.est.tpot_ok and s.cost < best:
                if cfg.eviction_term:
                    self._price_eviction(s, ctx, view, now)
                if s.cost < best:
                    best = s.cost
                    limit = best + cfg.tie_rel * best + cfg.tie_ms
        out.sort(key=_first)
        return [s for _, s in out]

    def _score_all(
        self,
        contenders: list[EngineView],
        scored: list[_Scored],
        ctx: RequestContext,
        view: ClusterView,
        now: float,
    ) -> list[_Scored]:
        """Every engine scored: the contenders (in their order), then the others."""
        done = {s.ev.engine_id: s for s in scored}
        out: list[_Scored] = []
        for ev in contenders:
            s = done.get(ev.engine_id)
            out.append(s if s is not None else self._score(ev, ctx, view, now))
        seen = {ev.engine_id for ev in contenders}
        out += [self._score(ev, ctx, view, now) for ev in view.engines if ev.engine_id not in seen]
        return out

    def _price_eviction(
        self, s: _Scored, ctx: RequestContext, view: ClusterView, now: float
    ) -> None:
        """Add Preble's M_i to ``s``'s cost (once), where fitting the key evicts."""
        if s.priced:
            return
        s.priced = True
        need = s.overflow(ctx.key_len)
        if need > 0:
            s.eviction = view.eviction_ms(s.ev.engine_id, need, now)
            s.cost += s.eviction

    def _contenders(self, view: ClusterView) -> list[EngineView]:
        """The engines worth scoring: all of them in a fleet of at most ``contenders``, else a
        quarter each of the ones holding the most of the key and the least loaded (by
        outstanding work), and the rest drawn at random (the injected rng). The holders are
        where the key is cheap; the random draws are the power of d choices (no single scalar
        orders engines by this cost: the least loaded by outstanding work were measured to
        miss the best engine often enough to lose 14 points of attainment on a 64-engine
        fleet); scoring every engine of a 1,000-engine fleet would take milliseconds."""
        engines = view.engines
        k = self.config.contenders
        if len(engines) <= k:
            return list(engines)
        out: dict[str, EngineView] = {}
        for engine_id, m in top_matched(view.matched, k // 4):
            ev = view.engine(engine_id)
            if ev is not None and m > 0:
                out[engine_id] = ev
        for ev in view.by_load():
            if len(out) >= k // 2:
                break
            out.setdefault(ev.engine_id, ev)
        rng = view.rng
        n = len(engines)
        for _ in range(4 * k):  # (bounded: draws that hit a chosen engine are redrawn)
            if len(out) >= k:
                break
            ev = engines[rng.randrange(n)]
            out.setdefault(ev.engine_id, ev)
        return list(out.values())

    def _band(
        self, pool: list[_Scored], ctx: RequestContext, view: ClusterView, now: float
    ) -> list[_Scored]:
        """The engines within the tie band of the cheapest ``TTFT + M``. M (>= 0, a walk of an
        LRU list) is priced only for engines whose cost without it is still within the band
        (in the order of that cost, whichever were priced before: ties among the band's
        engines resolve by their order)."""
        cfg = self.config
        pool.sort(key=_base)
        best = math.inf
        costed: list[_Scored] = []
        for s in pool:
            if s.base > best + cfg.tie_rel * best + cfg.tie_ms:
                break
            if cfg.eviction_term:
                self._price_eviction(s, ctx, view, now)
            costed.append(s)
            if s.cost < best:
                best = s.cost
        limit = best + cfg.tie_rel * best + cfg.tie_ms
        return [s for s in costed if s.cost <= limit]

    def _near_best(self, pool: list[_Scored], key: Callable[[_Scored], float]) -> list[_Scored]:
        """The engines of ``pool`` within the tie band of the lowest ``key``."""
        cfg = self.config
        best = min(key(s) for s in pool)
        limit = best + cfg.tie_rel * best + cfg.tie_ms
        return [s for s in pool if key(s) <= limit]

    def _least_delay(
        self, pool: list[_Scored], most: int, holders: list[_Scored], slo_ms: float
    ) -> list[_Scored]:
        """Of every engine in ``pool`` holding ``most`` bytes of the key (``holders``: those of
        them in the tie band), the ones within the band of the cheapest by cost plus the delay
        the request's decode adds to their prefills (``Estimate.decode_delay_ms``). An engine
        holding a prefix is also a lane for the requests due soon, which a long-context decode
        there slows at every step; among equal holders that is what tells them apart. Where a
        holder of the band is expected to give the request its first token within its TTFT
        SLO (``slo_ms``), only such holders are weighed: the delay is others' misses priced by
        a mean, and a lane bought with the request's own expected miss was no bargain (a prefix
        every engine holds made every engine a holder, and the lane rule sent requests from an
        engine expected in time to one expected late: docs/router.md, *Fifty-ninth session*)."""
        top = [s for s in pool if s.matched == most]
        if any(_expected(s) <= slo_ms for s in holders):
            # the lane is not bought with the request's own SLO
            top = [s for s in top if _expected(s) <= slo_ms]
        if len(top) < 2:
            return holders
        return self._near_best(top, _with_delay)

    def _rebalanced(
        self, ctx: RequestContext, view: ClusterView, finalists: list[_Scored], now: float
    ) -> Decision | None:
        """A prefix group that rebalancing moved goes to its new engine, a replicated hot
        group to the least loaded of its replicas (Preble; only with ``rebalance``), when that
        engine is in the tie band: the cost finds it as good as the best; elsewhere the cost
        decides. (Followed everywhere, Preble's moves cost 0.7 points on the held-out Mooncake
        trace.) A moved group's new engine that must prefill the prefix again is never in the
        band beside an idle holder; with ``follow_spare`` it is followed anyway where the copy
        is worth it (:meth:`_worth_investing`: room to spare there, in the band as if it held
        the prefix, the copy's own cost small against the request's SLO): the copy's prefill
        costs nobody a wait there, and the group's later requests hit it."""
        target = view.override(ctx.group)
        if target is not None:
            for s in finalists:
                if s.ev.engine_id == target:
                    return decide(self.name, "rebalance", s.ev, view)
            if self.config.follow_spare:
                ev = view.engine(target)
                if ev is not None and self._worth_investing(ev, ctx, view, finalists, now):
                    return decide(self.name, "rebalance", ev, view)
        reps = view.replicas(ctx.group)
        if reps:
            pool = [s.ev for s in finalists if s.ev.engine_id in reps]
            if pool:
                return decide(self.name, "replicate", pick_min(pool, by_load, view.rng), view)
        return None

    def _spare_replica(
        self, ctx: RequestContext, view: ClusterView, finalists: list[_Scored], now: float
    ) -> EngineView | None:
        """An engine with room to spare worth a copy of the key's hot prefix
        (``replicate_to_spare``), or None. The prefix is hot: at least two engines' block
        events show it, and it is the heaviest group on the best engine. The spare engine would
        be cheaper than the best past the band if it held the prefix (by ``gain``), and what the
        copy costs this request over the best is repaid by ``gain`` on the requests of the prefix
        expected while the best engine's queue lasts (its rate across the holders x the best
        TTFT): a flash crowd's system prompt repays a copy at once, a long document asked for
        once a minute never does. Only the ``REBALANCE_TARGETS`` least loaded engines are
        tried: a spare engine is among them, and a fleet whose every engine holds the prefix
        costs no walk over it."""
        matched = view.matched
        most = max(matched.values(), default=0)
        if most <= 0:
            return None
        # (the refusals that read least first: most requests are not of the best engine's
        # heaviest group, and they skip the walk over the least loaded engines)
        best = min(finalists, key=_cost)
        hot = next(iter(view.groups_on(best.ev.engine_id)), None)
        if hot is None or hot.group != ctx.group:
            return None
        # held where block events show it, not only where it was routed and is still computed
        holders = sum(1 for m in view.confirmed.values() if m >= most)
        if holders < 2:
            return None
        candidates = [
            ev
            for ev in islice(view.by_load(), REBALANCE_TARGETS)
            if matched.get(ev.engine_id, 0) < most
        ]
        if not candidates:
            return None
        share = hot.requests / max(best.ev.window_requests, hot.requests, 1)
        expected = recent_rate(best.ev, now) * share * holders * best.est.ttft_ms / 1000.0
        cfg = self.config
        for ev in candidates:
            as_holder = self._spare_as_holder(ev, ctx, view, now, most)
            if as_holder is None:
                continue
            gain = best.cost - as_holder.cost
            if gain <= cfg.tie_rel * as_holder.cost + cfg.tie_ms:
                continue
            copy = self._copy(ev, ctx, view, now)
            if copy.est.tpot_ok and copy.cost - best.cost <= expected * gain:
                return ev
        return None

    def _spare_as_holder(
        self, ev: EngineView, ctx: RequestContext, view: ClusterView, now: float, held: int
    ) -> _Scored | None:
        """``ev`` scored as if it held the first ``held`` bytes of the key, or None unless it
        has room to spare (:meth:`Estimate.spare`) and meets the TPOT SLO there."""
        est = estimate(ev, ctx, held, view, now, self._p_cache, held)
        if not (est.tpot_ok and est.spare()):
            return None
        return self._scored_as(ev, est, held, ctx)

    def _copy(self, ev: EngineView, ctx: RequestContext, view: ClusterView, now: float) -> _Scored:
        """``ev`` scored as it is, so copying the part of the key it lacks: its own match, and
        the eviction term where fitting the key evicts."""
        eid = ev.engine_id
        real = estimate(
            ev, ctx, view.matched.get(eid, 0), view, now, self._p_cache, view.confirmed.get(eid, 0)
        )
        copy = self._scored_as(ev, real, real.credited, ctx)
        if self.config.eviction_term:
            self._price_eviction(copy, ctx, view, now)
        return copy

    def _worth_investing(
        self,
        ev: EngineView,
        ctx: RequestContext,
        view: ClusterView,
        finalists: list[_Scored],
        now: float,
    ) -> bool:
        """Whether ``ev``, a moved group's new engine outside the tie band, is worth its copy of
        the prefix: it has room to spare now, as if it held what the best holder holds its cost
        is within the band of the cheapest, and what the copy costs over that (this request's
        later first token, the requests it delays there, what it evicts) is no more than the
        band's share of its TTFT SLO (a delay the SLO cannot tell from a prediction's error): a
        long document's copy costs seconds, and on arrival-order engines such moves made the
        tail requests."""
        as_holder = self._spare_as_holder(ev, ctx, view, now, max(view.matched.values(), default=0))
        if as_holder is None:
            return False
        cfg = self.config
        best = min(finalists, key=_cost)
        if as_holder.cost > best.cost + cfg.tie_rel * best.cost + cfg.tie_ms:
            return False
        copy = self._copy(ev, ctx, view, now)
        return copy.cost - as_holder.cost <= cfg.tie_rel * ctx.request.slo.ttft_ms + cfg.tie_ms

    def rebalance(self, ctx: RequestContext, view: ClusterView, now: float) -> tuple[Move, ...]:
        """Preble's post-assignment rebalancing (only with ``rebalance``): see the module
        docstring."""
        cfg = self.config
        if not cfg.rebalance or len(view.engines) < 2:
            return ()
        # warm-up: ``warmup_requests`` per engine on average (the fewest routed to any one
        # engine, as this read before, never reaches it on the engine a pinned layout starves:
        # the very imbalance rebalancing is for)
        if view.routed_total() < cfg.warmup_requests * len(view.engines):
            return ()
        busiest = _busiest_on_one_clock(view.most_loaded(REBALANCE_TARGETS, window=True))
        if busiest is None:
            return ()
        if busiest.window_ms <= 0.0:
            return ()
        # ... and balance_trigger x the fleet's mean, by windowed load (on the busiest's clock)
        # or by requests (an engine serving hits takes many requests for its load)
        mean_ms, mean_requests = view.window_means(busiest.tpot_ms)
        if (
            busiest.window_ms < cfg.balance_trigger * mean_ms
            and busiest.window_requests < cfg.balance_trigger * mean_requests
        ):
            return ()
        # the least busy engine first; when nothing can move there (no room in its cache for
        # any group, or it is slower), the next, up to REBALANCE_TARGETS of them: on three vLLM
        # engines of 64 KV blocks the least busy one often holds the cold tail of the documents,
        # its cache full of prefixes reused as often as the movable one, while the second least
        # busy has room (one engine kept 137 of 300 requests so). (A group too heavy for the
        # least busy is too heavy for the next, whose gap is smaller; the bound keeps a big
        # fleet, where hundreds of idle engines qualify, from reading its groups for each.)
        for strict in (True, False) if cfg.make_way else (True,):
            for tried, least in enumerate(view.by_load(window=True)):
                if tried >= REBALANCE_TARGETS or least.engine_id == busiest.engine_id:
                    break
                if least.prefill_scale > SAME_SPEED * busiest.prefill_scale:
                    # a slower engine is less busy on purpose (its prefill costs more; the cost
                    # above sends it less): moving work there was measured -2.8 points in mixed
                    # fleets
                    continue
                if not _busier_on_one_clock(busiest, least, cfg.rebalance_ratio):
                    continue
                moves = self._moves(view, busiest, least, now, strict)
                if moves:
                    return moves
        return ()

    def _moves(
        self,
        view: ClusterView,
        busiest: EngineView,
        least: EngineView,
        now: float,
        strict: bool = True,
    ) -> tuple[Move, ...]:
        """Preble's moves from ``busiest`` to ``least``: its groups lighter than the gap
        between them (both engines' output on one clock) and fitting in ``least``'s cache
        beside the prefixes reused there (``strict``; else beside those reused at least as
        often as the group: ``make_way``), the one that leaves the two closest to even first
        (``moves_by_fit``; else the heaviest first), until the two are within
        ``rebalance_ratio``; a group too heavy to move is replicated there when its TTFT
        doubled over the window."""
        cfg = self.config
        # (on one clock, as the two were compared: behind the bridge a measured TPOT counts
        # the prefill chunks in the engine's steps)
        clock = (busiest.tpot_ms + least.tpot_ms) / 2.0
        hi, lo = busiest.window_on_clock(clock), least.window_on_clock(clock)
        moves: list[Move] = []
        movable: list[GroupLoad] = []
        for g in view.groups_on(busiest.engine_id, cfg.min_group_requests):
            if g.requests < cfg.min_group_requests:
                continue
            # a group moved here earlier may move on; one moved elsewhere left only history
            target = view.override(g.group)
            if target is not None and target != busiest.engine_id:
                continue
            reps = view.replicas(g.group)
            # too heavy to move (moving it would only swap the roles), or already replicated:
            # a hot prefix, replicated when its TTFT doubled over the window
            if g.load_ms >= hi - lo or reps:
                first, second = view.ttft_halves(g.group, now)
                if (
                    first > 0.0
                    and second >= cfg.replicate_ttft_ratio * first
                    and least.engine_id not in reps
                ):
                    moves.append(Move(g.group, busiest.engine_id, least.engine_id, "replicate"))
                continue
            if not cfg.moves_by_fit:
                if self._fits(view, g, least, strict):
                    moves.append(Move(g.group, busiest.engine_id, least.engine_id))
                    hi -= g.load_ms
                    lo += g.load_ms
                    if hi < cfg.rebalance_ratio * lo:
                        break
                continue
            movable.append(g)
        # by fit: each time the group that leaves the two closest to even, of those still
        # lighter than the gap (a heavier one would swap the roles)
        while movable and hi >= cfg.rebalance_ratio * lo:
            gap = hi - lo
            best = min(
                (g for g in movable if g.load_ms < gap),
                key=lambda g: abs(gap - 2.0 * g.load_ms),
                default=None,
            )
            if best is None:
                break
            movable.remove(best)
            if not self._fits(view, best, least, strict):
                continue
            moves.append(Move(best.group, busiest.engine_id, least.engine_id))
            hi -= best.load_ms
            lo += best.load_ms
        return tuple(moves)

    def _fits(self, view: ClusterView, g: GroupLoad, least: EngineView, strict: bool) -> bool:
        """Whether group ``g``'s prefix fits in ``least``'s cache beside every prefix reused
        there: a group moved onto a full cache evicts one of them, whose requests still come
        there and evict another in turn (on three vLLM engines of 64 KV blocks, moves without
        this check cost up to 0.06 of hit rate; letting the prefixes reused less often than the
        moved one make way, as before the thirty-third session, thrashed the same way:
        docs/router.md), unless no engine tried has that room (``make_way``: the second pass,
        not ``strict``, beside those reused at least as often)."""
        cfg = self.config
        reused = cfg.min_group_requests
        if not (cfg.room_beside_all_reused and strict):
            reused = max(g.requests, reused)
        return g.key_bytes <= view.cache_room(least.engine_id, reused)


def _busier_on_one_clock(busiest: EngineView, least: EngineView, ratio: float) -> bool:
    """Whether ``busiest`` is still ``ratio`` x busier than ``least`` with both engines' output
    tokens priced at one TPOT (the mean of theirs). Each engine's windowed load prices them at
    its own measured TPOT, and behind the vLLM bridge that is its inter-token latency, prefill
    chunks included: of three identical engines the one serving mostly hits read 2x faster
    (6.7 against 14-15 ms), so it looked least busy, and rebalancing moved a group *to* the
    engine with the most requests (which ended with 48% of them). Engines of one speed class
    (the ``SAME_SPEED`` check) decode at one rate; their measured TPOTs differ by contention."""
    clock = (busiest.tpot_ms + least.tpot_ms) / 2.0
    hi = busiest.window_on_clock(clock)
    return hi > 0.0 and hi >= ratio * least.window_on_clock(clock)


def _busiest_on_one_clock(tops: Sequence[EngineView]) -> EngineView | None:
    """Of the most loaded engines by windowed load (``tops``, the most loaded first), the
    busiest with every output token priced at one TPOT (the mean of theirs), among those of
    the first one's speed class (a slower engine's TPOT is its own speed, not contention).
    Behind the vLLM bridge a measured TPOT counts the prefill chunks in the engine's steps:
    of three identical engines, the one with 73 requests (a group just moved there, its TPOT
    8.6 ms) read busier than the one with 149 (5.9 ms), and rebalancing never looked at the
    one with half the requests."""
    if not tops:
        return None
    first = tops[0]
    same = [
        e
        for e in tops
        if e.prefill_scale <= SAME_SPEED * first.prefill_scale
        and first.prefill_scale <= SAME_SPEED * e.prefill_scale
    ]
    if len(same) < 2:
        return first
    clock = sum(e.tpot_ms for e in same) / len(same)
    best = first
    most = first.window_on_clock(clock)
    for e in same[1:]:
        load = e.window_on_clock(clock)
        # (equal loads: the lowest position)
        if load > most or (load == most and e.position < best.position):
            best, most = e, load
    return best


class _Balance:
    """The tie-break without ``spread_by_traffic``: the least outstanding work, then the
    fewest in flight, then the lowest recent request rate."""

    __slots__ = ("now",)

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self, s: _Scored) -> tuple[float, int, float]:
        ev = s.ev
        return (ev.load_ms, ev.inflight, recent_rate(ev, self.now))


class _Traffic:
    """The tie-break among equally cheap engines holding equally much of the key: the engines
    with room for the rest of the key first, by the least recent traffic for their speed
    (recent request rate x this request's prefill there), then the others by the least
    outstanding work. The part of the key no engine holds yet lands where the request goes,
    and the requests that later share it follow; the traffic an engine has been taking says
    more about where they will queue than the work in flight at this instant (measured on the
    routing matrix's quick slice over 3 seeds when it came in: +0.25 points of attainment,
    seed-to-seed spread 0.41 -> 0.35 points). But it sends every new prefix to the quietest
    engine, and once caches are full each one there evicts the last: on three vLLM engines of
    64 KV blocks, the engine holding the rarest documents took up to half of the twelve, its
    cache thrashed, and about one cold run in four lost 0.03 to 0.07 of hit rate
    (docs/router.md). Engines without room are ordered by the work in flight, which spreads
    new prefixes evenly. Room is the free KV the engine announced less what the prefills routed
    there and not done yet will write (``unannounced_bytes``): their blocks are announced only
    once written, and counted as free, a burst of new documents all went to the engine that
    looked empty and overflowed it (on the same vLLM engines: 2 of 13 cold runs at 0.815 and
    0.828; with it, 13 of 13 at 0.847 to 0.857)."""

    __slots__ = ("key_len", "now")

    def __init__(self, now: float, key_len: int) -> None:
        self.now = now
        self.key_len = key_len

    def __call__(self, s: _Scored) -> tuple[bool, float, float, int]:
        ev = s.ev
        if s.overflow(self.key_len) + ev.unannounced_bytes > 0:
            return (True, 0.0, ev.load_ms, ev.inflight)
        return (False, recent_rate(ev, self.now) * s.est.own_ms, ev.load_ms, ev.inflight)


def _first_two(b: tuple[float, int, EngineView]) -> tuple[float, int]:
    return b[0], b[1]


def _first(p: tuple[int, _Scored]) -> int:
    return p[0]


def _fallback(best: _Scored | None, scored: Sequence[_Scored]) -> str | None:
    """The engine a shed request would have gone to: the best by its first token, else (none
    meets its TPOT SLO there) the cheapest where its decode alone could (None: nowhere)."""
    if best is None:
        best = min((s for s in scored if s.est.decode_fits), key=_cost, default=None)
    return best.ev.engine_id if best is not None else None


def _doomed(pool: list[_Scored], slo_ms: float) -> bool:
    """Whether no engine of ``pool`` (the tie band) is expected to give the request its first
    token within its TTFT SLO, and each would refuse it while it waits (S-EDF): then it costs
    the others nothing wherever it goes among them. An engine that serves in arrival order
    runs it, late, ahead of the requests behind it, so there the cost decides (sent to the
    holder, such requests queued there and delayed the rest: tool_use 4 homo x2 -3.2 points
    behind the bridge)."""
    return not any(_expected(s) <= slo_ms or s.ev.arrival_order for s in pool)


def _most_held(pool: list[_Scored], held: Callable[[_Scored], int]) -> list[_Scored]:
    """The engines of ``pool`` holding the most of the key by ``held`` (bytes); all of them
    when none holds any."""
    most = max((held(s) for s in pool), default=0)
    if most <= 0:
        return pool
    return [s for s in pool if held(s) == most]


def _credited(s: _Scored) -> int:
    """The key bytes cached for the request there (routed ones only behind their computer)."""
    return s.matched


def _soonest(s: _Scored) -> float:
    """The soonest its first token could come there (``Estimate.ttft_floor_ms``: nothing
    overtaking it, of the work ahead only what can still start in time). A doomed request's
    best chance: the expected TTFT counts the doomed requests queued ahead, which the engine
    refuses before they run; on the engine taking a burst of short requests, short requests
    predicted late there met their SLO seven times in ten (docs/router.md, *Sixty-fourth
    session*)."""
    return s.est.ttft_floor_ms


def _expected(s: _Scored) -> float:
    return s.est.ttft_ms


def _cost(s: _Scored) -> float:
    return s.cost


def _with_delay(s: _Scored) -> float:
    """``s``'s cost and the misses its decode makes of the engine's prefills."""
    return s.cost + s.est.decode_delay_ms


def _base(s: _Scored) -> float:
    return s.base


class _Listing:
    """The decision's candidates (a ``router.api.Listing``), built when first read: the chosen,
    the cheapest scored and the engines holding the most of the key, with their predicted
    queueing (``load_ms``), own prefill (``prefill_ms``, both divided by the prefill share plus
    any admission wait) and eviction cost. The scored list is the decision's own."""

    __slots__ = ("chosen", "key_len", "limit", "matched", "scored")

    def __init__(
        self,
        chosen: EngineView,
        scored: Sequence[_Scored],
        matched: Mapping[str, int],
        key_len: int,
        limit: int,
    ) -> None:
        self.chosen = chosen
        self.scored = scored
        self.matched = matched
        self.key_len = key_len
        self.limit = limit

    def candidates(self) -> tuple[Candidate, ...]:
        by_id = {s.ev.engine_id: s for s in self.scored}
        listed = [self.chosen.engine_id]
        listed += [s.ev.engine_id for s in sorted(self.scored, key=_cost)[: self.limit]]
        listed += [e for e, _ in top_matched(self.matched, self.limit)]
        out: dict[str, Candidate] = {}
        for eid in listed:
            s = by_id.get(eid)
            if s is None or eid in out:
                continue
            est = s.est
            out[eid] = Candidate(
                eid,
                s.matched,
                load_ms=est.queue_ms / est.share + est.admit_ms,
                eviction_ms=s.eviction,
                prefill_ms=est.own_ms / est.share,
                feasible=est.tpot_ok,
            )
        return tuple(out.values())
