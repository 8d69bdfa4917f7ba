"""The router's latency model: when a request would get its first token on an engine, and
whether that engine can meet the request's SLO. Shared by E2's cost and every policy's SLO
filter, so routing and shedding see the same numbers.

From the router's own records of what it sent where (exact, and known at once) and the engines'
heartbeats (for queued work it cannot attribute), on each engine's cost profile corrected by its
fitted speed (``EngineView.prefill_scale`` / ``decode_scale``, :class:`kvgate.cost_model.SpeedFit`):

* ``queue``: prefill time of the work the engine's S-EDF scheduler serves before this request:
  the router's open requests there due no later than this one, plus queued work it cannot
  attribute (another router's, charged in full). Not the whole queue: S-EDF lets an earlier
  deadline overtake;
* ``own``: prefill time of this request's tokens after its cached prefix (whole blocks only:
  :meth:`router.tree.RadixTree.match`);
* ``share``: the part of the GPU that prefill gets. While requests decode, the engine runs a
  decode step of ``D`` ms in every step and cuts each step to ``0.9 x T_min`` (the tightest
  decoding TPOT SLO; ``engine.scheduler.slo``), so prefill runs at ``1 - D / (0.9 T_min)`` of
  full speed (:func:`kvgate.cost_model.prefill_share`, which the engine's S-EDF uses too),
  ``D`` being the decode step of the router's requests there (at most the batch SCORPIO's
  admission lets start; the rest wait for a place). A busy decoder
  prefills slowly: an engine with a short queue but a large decode batch is not a fast choice;
* ``admit``: if SCORPIO's VBS admission would hold the request back (one more request would push
  the decode step past its TPOT SLO, ``EstTPOT(VBS + 1, L) x 1.3 >= 0.99 x TPOT``), the time
  until a decoding request finishes and frees room, in a line of the requests in flight there
  that S-EDF starts before it (not those queued due later, which it overtakes: counted in line,
  a short request beside a queue of long-context ones was predicted seconds of wait it never
  had, observed / predicted TTFT 0.016 at the 10th percentile on held-out hot_prompt; the place
  it takes still delays them, which its harm charges); and where the requests holding KV memory
  there (from their prefill's start), and those queued ahead of it, hold so much that this
  one's whole context does not fit beside them, the time until enough of it is freed
  (:func:`kv_wait_ms`); the memory it holds while it decodes is part of its harm to others
  (:func:`kv_harm_ms`);
* ``decode``: the decode iteration of the step in which its prefill starts (each step decodes
  first), ``D``;
* ``stretch``: S-EDF lets a request that arrives later but is due sooner overtake, so the wait
  is a busy period that the work queued ahead starts and the overtakers feed: ``1 / (1 - busy x
  sooner)``, ``busy`` the engine's recent prefill utilization and ``sooner`` the share of the
  fleet's recent prefill work whose TTFT SLO is shorter than this request's minus half its
  unstretched wait (:mod:`router.slo_mix`; at most 10x): a request arriving ``t`` ms later
  overtakes it only when due sooner, with an SLO shorter by ``t``; averaged over the wait, half
  of it. Comparing with the whole SLO (an upper bound) lost 0.35 points of attainment on the
  quick slice.
  Without it the router predicted half the TTFT of a request with a long SLO on a busy engine;
* ``decode_delay``: what its decode does to the engine's prefills. Each step decodes before its
  prefill slice, so every ms of its decode is a ms the prefills there wait, the ones due sooner
  too (S-EDF lets them overtake a prefill, not a decode step): ``decode_ms x busy / (1 -
  busy)`` of delay (the prefills waiting meanwhile), a delay ``d`` to a prefill of TTFT SLO
  ``s`` making it miss with a chance of about ``d / s``, each miss priced at this request's own
  SLO (as E2 prices its own miss): ``x SLO x`` the mean ``1 / SLO`` of the engine's prefill work
  (``EngineView.prefill_slo_rate / prefill_rate``). A long-context decode with a long SLO is
  dear where the prefills are due soon;
* ``TTFT = (queue + own) / share x stretch + admit + decode``; its floor
  ``(runs + own) / share_now + admit_now + decode_now``, ``runs`` the part of ``queue`` that
  can still start in time behind the work before it, and the decode batch only the requests
  decoding now (the queued ones are behind a request that overtakes them).

All of that is S-EDF (kvgate's scheduler). An engine whose heartbeat says it serves prefill in
arrival order (``LoadHeartbeat.queue_order``: vLLM's own scheduler, kvgate's ``fcfs``) runs its
whole queue first and drops none: ``queue`` and ``runs`` are every open request there,
``behind`` is 0, ``stretch`` is 1, there is no VBS admission wait (vLLM starts what its KV
memory holds) and the floor is the expected TTFT (nothing overtakes it). Read as S-EDF, an
FCFS engine holding a long queue of late or later-due work looked cheap (docs/router.md).
Nor does such an engine hold a request back for its TPOT: it decodes every request it holds in
every step and runs the prefill chunks of new ones inside those steps, so a request's TPOT there
is its whole batch's, stretched by the prefill routed there (:func:`arrival_order_tpot_ms`),
and its own prefill stalls every request decoding there (``ClusterView.tpot_pushed``).

An engine is *feasible* for a request when the soonest its first token could come there
(``ttft_floor``: nothing overtakes it, and of the work queued ahead only what can still start
in time behind the work before it counts, as the engine rejects the rest while it waits) is
within the TTFT SLO and the request's own decode step (alone, at the engine's speed, times
SCORPIO's margin on an S-EDF engine, whose admission applies it) fits its TPOT SLO; when it
does not, the engine would reject it at once. On an arrival-order engine the batch's TPOT must
fit it too (the lower of the router's forecast and the engine's measured TPOT, read for the
request's own context: :func:`measured_tpot_ms`), and the request's prefill must push none of
the requests decoding there past their own TPOT SLO (admitting it would trade theirs for its
own). Shedding is final, so it is judged on that optimistic figure: judged on the stretched
TTFT, only 66% of the requests e2 shed on the ``--quick --run-shed`` slice would have missed
their SLO; counting the doomed work ahead too, 86% (93.5% without it). Routing keeps the whole
queue of individually feasible work ahead: routing on the shorter one lost 0.4 points of
attainment on the quick slice (an engine holding doomed work is past its capacity, and more
work there makes more of it late).
A policy sheds (429) only when no engine is feasible; E2 further requires the best prediction to
miss by a margin (:class:`router.policies.e2.E2Config`).
"""

from __future__ import annotations

import math

from broker.events import LoadHeartbeat
from kvgate.cost_model import CostProfile
from kvgate.cost_model import prefill_share as cost_prefill_share
from router.api import Decision
from router.policies.base import (
    ClusterView,
    EngineView,
    PrefillCache,
    RequestContext,
    prefill_cost_ms,
)

TPOT_SAFETY = 1.3  # SCORPIO's margin on the decode-time estimate
TPOT_HEADROOM = 0.99
UNBOUNDED_BATCH = 1 << 30  # a decode batch no TPOT SLO bounds (a step that does not grow)
STEP_BUDGET = 0.9  # the engine cuts a step to this x the tightest decoding TPOT SLO
MIN_RETRY_S, MAX_RETRY_S = 0.5, 30.0
RATE_TAU_S = 10.0  # EngineView.rate_per_s decays with this time constant
CONGESTED = 0.95  # a decode batch this full (or fuller) is as congested as it gets
MAX_OVERTAKEN = 0.9  # at most this share of a busy engine's time goes to overtakers (10x)
SPARE = 0.5  # an engine whose prefill and decode are both less busy than this has room to spare
TPOT_MISS_RETRY_MS = 1000.0


def queued_prefill_tokens(hb: LoadHeartbeat | None, pending: int) -> int:
    """The engine's reported prefill queue plus what the router sent it since (``pending``)."""
    return pending + (hb.queued_prefill_tokens if hb is not None else 0)


def queued_prefill_ms(profile: CostProfile, hb: LoadHeartbeat | None, pending: int) -> float:
    """Time to work through the engine's queued prefill and what the router sent since (on the
    profile; callers scale by the engine's fitted speed)."""
    return profile.prefill_ms(queued_prefill_tokens(hb, pending))


def next_decode_step_ms(
    profile: CostProfile,
    hb: LoadHeartbeat | None,
    ctx_tokens: float,
    requests: int,
) -> float:
    """SCORPIO's EstTPOT with one more request in the virtual batch (0: unknown), on the profile:
    the batch is the heartbeat's VBS + 1 and the context the mean of ``input + output / 2`` over
    ``requests`` (the engine's own admission rule), from the router's in-flight records
    (``ctx_tokens`` is their sum; the request itself included when the caller adds it). Not the
    KV blocks in use: those include every idle cached prefix, so a full prefix cache would look
    like a huge context and make an engine with one running request 'infeasible'."""
    if hb is None:
        return 0.0
    mean_ctx = ctx_tokens / requests if requests > 0 else 0.0
    return profile.decode_step_ms(hb.vbs + 1.0, mean_ctx)


class Estimate:
    """One engine's predicted latency for one request (ms; see the module docstring)."""

    __slots__ = (
        "admit_ms",
        "arrivals",
        "behind",
        "busy",
        "credited",
        "decode_delay_ms",
        "decode_fits",
        "decode_harm",
        "fill",
        "own_ms",
        "own_work_ms",
        "queue_ms",
        "share",
        "tpot_ok",
        "ttft_floor_ms",
        "ttft_ms",
    )

    def __init__(
        self,
        queue_ms: float,
        own_ms: float,
        share: float,
        admit_ms: float,
        tpot_ok: bool,
        behind: int = 0,
        rate_per_s: float = 0.0,
        credited: int = 0,
        decode_harm: float = 0.0,
        busy: float = 0.0,
        sooner: float = 0.0,
        queue_runs_ms: float | None = None,
        floor_share: float | None = None,
        floor_admit_ms: float | None = None,
        own_work_ms: float | None = None,
        place_ms: float = 0.0,
        decode_fits: bool | None = None,
        fill: float = 0.0,
        decode_delay_ms: float = 0.0,
        overtaken_ms: float = 0.0,  # how much longer the line it overtakes waits for a place
    ) -> None:
        # the misses its decode's GPU time makes of the engine's prefills, priced at its own SLO
        self.decode_delay_ms = decode_delay_ms
        self.busy = busy  # the engine's recent prefill utilization (of prefill's GPU share)
        self.fill = fill  # its decode batch's share of the places SCORPIO's admission allows
        # ms its decode will add to later requests (their prefill, or their wait for a place in
        # the decode batch or for KV memory)
        self.decode_harm = decode_harm
        self.credited = credited  # key bytes counted as cached there
        self.behind = behind  # queued requests due later, which its prefill would delay
        self.queue_ms = queue_ms
        self.own_ms = own_ms
        # the prefill it adds to the engine's work: less than ``own_ms`` when it prefills a
        # routed prefix that an open request it overtakes would otherwise prefill
        self.own_work_ms = own_ms if own_work_ms is None else own_work_ms
        self.share = share
        self.admit_ms = admit_ms
        self.tpot_ok = tpot_ok
        # its decode step alone fits its TPOT SLO there (``tpot_ok`` asks more of an
        # arrival-order engine: the batch's TPOT, and the requests decoding there)
        self.decode_fits = tpot_ok if decode_fits is None else decode_fits
        wait = (queue_ms + own_ms) / share
        overtaken = busy * sooner
        stretch = 1.0 / (1.0 - (overtaken if overtaken < MAX_OVERTAKEN else MAX_OVERTAKEN))
        self.ttft_ms = wait * stretch + admit_ms
        # the soonest it could come (what shedding is judged on): nothing overtakes it, and of
        # the work ahead only what can still make its deadline runs (the engine rejects the
        # rest while it waits)
        runs = queue_ms if queue_runs_ms is None else queue_runs_ms
        f_share = share if floor_share is None else floor_share
        f_admit = admit_ms if floor_admit_ms is None else floor_admit_ms
        self.ttft_floor_ms = (runs + own_ms) / f_share + f_admit
        # requests expected to arrive there before its queue drains (a busy period stretches
        # by 1 / (1 - utilization), overtakers or not): its prefill delays them too
        self.arrivals = rate_per_s * (wait + admit_ms) / 1000.0 / (1.0 - busy)
        if place_ms > 0.0:
            # requests wait there for a place in the decode batch (SCORPIO's admission): the
            # place this one takes delays every request that arrives before that line drains,
            # as its prefill delays those arriving before the prefill queue drains (a busy
            # period of the places, their utilization the rate x the time each one adds)
            places_busy = min(rate_per_s * place_ms / 1000.0, CONGESTED)
            waiting = rate_per_s * (admit_ms + overtaken_ms) / 1000.0 / (1.0 - places_busy)
            self.decode_harm = max(decode_harm, place_ms * (1.0 + waiting))

    def spare(self) -> bool:
        """Whether the engine has room of every kind now: no prefill queued there, and its
        prefill utilization and decode batch both under ``SPARE``. Extra work there (a prefill
        that a cached copy elsewhere would have saved) delays nobody."""
        return self.queue_ms <= 0.0 and not self.behind and self.busy < SPARE and self.fill < SPARE

    def excess_ms(self, ttft_slo_ms: float) -> float:
        """By how much the request would miss its SLO here even if nothing overtook it (0: it
        could meet it). Shedding is final, so it is judged on the soonest the first token
        could come, not on the expected wait that routing compares."""
        if not self.tpot_ok:
            return TPOT_MISS_RETRY_MS
        return max(self.ttft_floor_ms - ttft_slo_ms, 0.0)


def rate_decay(ev: EngineView, now: float) -> float:
    """The factor ``ev``'s exponentially weighted rates (``rate_per_s``, ``prefill_rate``, as
    of ``rate_t``) have decayed by at ``now`` (0: nothing routed there yet)."""
    return math.exp(-(now - ev.rate_t) / RATE_TAU_S) if ev.rate_per_s else 0.0


def recent_rate(ev: EngineView, now: float) -> float:
    """Requests per second routed to ``ev`` lately (its exponentially weighted rate, decayed
    to ``now``)."""
    return ev.rate_per_s * rate_decay(ev, now)


def prefill_busy(ev: EngineView, decay: float, share: float = 1.0) -> float:
    """``ev``'s recent prefill utilization: the prefill routed there per second (its rate
    decayed by ``decay``, :func:`rate_decay`) over the ``share`` of the GPU prefill gets, at
    most :data:`CONGESTED`."""
    return min(ev.prefill_rate * decay / 1000.0 / share, CONGESTED)


def batch_capacity(ev: EngineView, mean_ctx: float, tpot_ms: float) -> int:
    """The virtual batch of requests of mean context ``mean_ctx`` (``L``) that ``ev`` can
    decode within ``tpot_ms`` by SCORPIO's admission rule (``EstTPOT(VBS, L) x 1.3 < 0.99 x
    TPOT``, at the engine's fitted decode speed): the largest whole VBS strictly within it, in
    requests decoding every step (:func:`virtual_batch`)."""
    prof = ev.profile
    per_request = prof.request_step_ms(mean_ctx)
    room = TPOT_HEADROOM * tpot_ms / (TPOT_SAFETY * ev.decode_scale)
    room -= prof.decode_d + prof.decode_c * mean_ctx
    if not room > 0:
        return 0
    if per_request <= 0 or room >= per_request * UNBOUNDED_BATCH:
        return UNBOUNDED_BATCH  # (the quotient would overflow, or divide by 0)
    return max(math.ceil(room / per_request) - 1, 0)


def virtual_batch(ev: EngineView, t_min_ms: float) -> float:
    """SCORPIO's virtual batch size of ``ev``'s in-flight requests at the step budget
    ``t_min_ms`` (at most their tightest TPOT SLO): each decodes in ``t_min / its TPOT SLO`` of
    the steps (its credit rate), so a request with a relaxed TPOT SLO fills a fraction of the
    batch. Counting every request as one overstated the decode step of an engine serving mixed
    classes, hence understated prefill's share of the GPU, and the router shed requests it
    would have served. Unknown SLOs (``open_inv_tpot`` 0): each counts one."""
    return _vbs(ev.open_inv_tpot, ev.inflight, t_min_ms)


def _vbs(inv_tpot: float, count: int, t_min_ms: float) -> float:
    """The virtual batch of ``count`` requests whose TPOT SLOs sum ``inv_tpot`` in 1 / ms, at
    the step budget ``t_min_ms`` (each one counts one when their SLOs are unknown)."""
    if inv_tpot <= 0.0 or not math.isfinite(t_min_ms):
        return float(count)
    return t_min_ms * inv_tpot


def _vbs_wait_ms(
    ev: EngineView,
    view: ClusterView,
    now: float,
    batch: float,
    members: int,
    capacity: int,
    t_min_ms: float,
    tpot_ms: float,
) -> float:
    """SCORPIO's VBS admission: a request (TPOT SLO ``tpot_ms``) starts only while the virtual
    batch it joins stays within ``capacity`` at the tightest TPOT SLO ``t_min_ms``; the wait
    until enough of the ``members`` requests making up ``batch`` finish, each freeing its
    credit rate (on average ``batch / members``)."""
    over = batch + t_min_ms / tpot_ms - capacity
    if over <= 0:
        return 0.0
    per = batch / members if members else 1.0
    return view.decode_release_ms(ev, now, math.ceil(over / per - 1e-9))


def decode_step_ms(ev: EngineView) -> float:
    """The decode step of ``ev``'s batch while a new request's prefill runs, at the engine's
    fitted speed (0: nothing decodes): every request the router has in flight there, not only
    those decoding now, as a virtual batch at their tightest TPOT SLO (:func:`virtual_batch`).
    The ones still queued decode by the time a new request's prefill runs (they are mostly
    ahead of it); counting only today's decoders made the router send a burst to the engine
    with the fewest of them, which only showed its load a prefill later. At most the batch
    SCORPIO's VBS admission lets start (:func:`batch_capacity`): the rest wait for a place
    (the admission wait, :func:`_vbs_wait_ms`) and do not slow the steps. Uncapped, an engine
    with a long queue of long-context requests looked to leave prefill the 5% floor of the
    GPU, a 20x wait on top of the admission wait, and e2 recomputed the prefixes it held
    elsewhere (held-out Mooncake synthetic trace, 8 engines: docs/router.md). So also when
    nothing decodes yet: in a burst the requests just routed there are all still queued, and
    every one ahead of a new request decodes while it prefills (taken as a full step at none,
    a programming flash crowd's TTFTs came out 2-3x the router's prediction)."""
    if ev.inflight <= 0:
        return 0.0
    t_min = ev.open_tpot_min_ms
    mean_ctx = ev.open_ctx_tokens / ev.inflight
    batch = virtual_batch(ev, t_min)
    budget = step_budget_tpot_ms(ev)
    if math.isfinite(budget):
        # SCORPIO's VBS admission starts no request past the batch it can decode in time:
        # the rest wait (the admission wait), they do not slow the steps
        decoding_now = _vbs(ev.decode_inv_tpot, ev.decoding, t_min)
        batch = min(batch, max(batch_capacity(ev, mean_ctx, budget), decoding_now))
    step = ev.profile.decode_step_ms(batch, mean_ctx)
    return step * ev.decode_scale


def step_budget_tpot_ms(ev: EngineView) -> float:
    """The TPOT SLO the engine's steps are cut to while ``ev``'s in-flight requests decode: the
    tightest of them (of those decoding now when the router has no in-flight SLOs there)."""
    return min(ev.open_tpot_min_ms, ev.decode_tpot_min_ms)


def prefill_share(ev: EngineView, step_ms: float | None = None) -> float:
    """The share of ``ev``'s GPU time its prefill gets while its decode batch runs (its decode
    step ``step_ms``, :func:`decode_step_ms` when not given): the batch its in-flight requests
    make once they decode, as they will while a new request's prefill runs."""
    if ev.inflight <= 0:
        return 1.0
    step = decode_step_ms(ev) if step_ms is None else step_ms
    return cost_prefill_share(step, STEP_BUDGET * step_budget_tpot_ms(ev))


def estimate(
    ev: EngineView,
    ctx: RequestContext,
    matched: int,
    view: ClusterView,
    now: float,
    cache: PrefillCache,
    confirmed: int | None = None,
) -> Estimate:
    """When ``ctx``'s request would get its first token on ``ev`` (see the module docstring).
    ``matched`` includes the router's speculative entries, ``confirmed`` not (None: the same):
    a routed key is cached only once its request's prefill is done, so the speculative part
    counts only as far as a request there computes it before this one starts
    (:meth:`ClusterView.routed_ahead <router.policies.base.ClusterView.routed_ahead>`; all of
    it when none is due later); a request due before the one computing it overtakes it
    (S-EDF) and prefills the prefix itself."""
    req = ctx.request
    slo = req.slo
    step = decode_step_ms(ev)
    share = prefill_share(ev, step)
    # which work ahead can still start in time (the TTFT floor's ``runs``) is judged at full
    # speed while nothing decodes yet: shedding is final, so the floor stays optimistic
    runs_share = share if ev.decoding > 0 else 1.0
    deadline = deadline_s(ctx, now)
    queue, behind, runs = view.prefill_queue(ev, deadline, runs_share)
    routed = matched
    if behind and confirmed is not None and confirmed < matched:
        # the routed part is cached for it if a request there computes it first
        ahead = view.routed_ahead(ev, req.key, deadline, confirmed)
        matched = confirmed if ahead <= confirmed else min(ahead, matched)
    if matched and not cached_at_start(ev, view, now, matched, ctx, deadline):
        matched = routed = 0
    own = prefill_cost_ms(ev, ctx.key_len, matched, cache)
    # prefilling the routed prefix itself, it spares the open request it overtakes there that
    # prefill (the engine prefills a shared prefix once): the work it adds is what that leaves
    own_work = prefill_cost_ms(ev, ctx.key_len, routed, cache) if routed > matched else own
    # a request arriving t ms from now overtakes it only if due sooner, with an SLO shorter
    # than its own minus t: over the wait (unstretched), the SLO half the wait shorter; in
    # arrival order nothing overtakes it
    fifo = ev.arrival_order
    sooner = 0.0 if fifo else view.share_due_sooner(slo.ttft_ms - (queue + own) / share / 2.0)
    prof = ev.profile
    decay = rate_decay(ev, now)
    if ev.role == "prefill":
        # prefill/decode disaggregation (router.pd): the request decodes on a decode engine,
        # so it takes no place in this engine's batch; its first token waits for its KV to
        # move there
        moved = view.kv_transfer_ms(prof.prompt_tokens(req.input_tokens, ctx.key_len))
        busy = prefill_busy(ev, decay, share)
        return Estimate(
            queue,
            own,
            share,
            step + moved,
            True,
            behind,
            ev.rate_per_s * decay,
            matched,
            0.0,
            busy,
            sooner,
            runs,
        )
    prompt = prof.prompt_tokens(req.input_tokens, ctx.key_len)
    mine = prompt + req.max_tokens / 2  # its mean context while it decodes
    limit = TPOT_HEADROOM * slo.tpot_ms
    # its decode step alone, with SCORPIO's margin where the engine's own admission applies it
    # (an S-EDF engine refuses the request without it; an arrival-order engine has none)
    lone_step = prof.decode_step_ms(1, mine) * ev.decode_scale
    alone = lone_step * (1.0 if fifo else TPOT_SAFETY)
    fits_alone = alone < limit
    tpot_ok = fits_alone
    if fifo and tpot_ok:
        # an arrival-order engine has no admission of its own: it decodes every request it
        # holds in every step and runs prefill chunks inside those steps, so the request's TPOT
        # is its whole batch's, and its prefill stalls every request decoding there. The
        # batch now is a forecast (a burst may drain before the request ends): it counts only
        # while the TPOT the engine has measured (for this request's context) agrees
        tpot = min(arrival_order_tpot_ms(ev, mine, decay), measured_tpot_ms(ev, mine, decay))
        tpot_ok = tpot < limit and not view.tpot_pushed(ev, now, queue / share, own, tpot)
    admit = 0.0
    t_min = min(slo.tpot_ms, step_budget_tpot_ms(ev))
    # SCORPIO's capacity at the mean context of its requests in flight there and this one
    mean_ctx = (ev.open_ctx_tokens + mine) / (ev.inflight + 1)
    capacity = batch_capacity(ev, mean_ctx, t_min)
    batch = virtual_batch(ev, t_min)
    line_wait = 0.0  # the wait for a place behind every request in flight there
    if fits_alone and not fifo:
        # every request in flight there holds or awaits a place in the virtual batch (an
        # arrival-order engine has no VBS admission: it starts what its KV memory holds) ...
        line_wait = _vbs_wait_ms(ev, view, now, batch, ev.inflight, capacity, t_min, slo.tpot_ms)
        admit = line_wait
        if line_wait > 0.0 and behind:
            # ... but S-EDF starts it before the ones queued due later: it waits behind the rest
            ahead = ev.inflight - min(behind, ev.inflight)
            admit = _vbs_wait_ms(
                ev, view, now, batch * ahead / ev.inflight, ahead, capacity, t_min, slo.tpot_ms
            )
    # where requests wait for a place (those it overtakes too), it will hold one for its
    # output's decode (max_tokens steps): of ``capacity`` places one frees every decode time /
    # capacity, the delay it adds to the line, for a place the size of its own share of a step
    # (a short context beside long ones takes a fraction of one of their places)
    place = 0.0
    if line_wait > 0.0 and capacity > 0:
        per = prof.request_step_ms(mean_ctx)
        size = prof.request_step_ms(mine) / per if per > 0.0 else 1.0
        place = req.max_tokens * step / capacity * size
    overtaken = line_wait - admit
    # its decode takes a place in the engine's decode batch for its output tokens, and a
    # share of every step: its GPU time there, made dearer as the batch fills up (an M/M/1-like
    # congestion factor of the batch's fill), for the requests that will need a place
    decode_ms = req.max_tokens * prof.request_step_ms(mine) * ev.decode_scale
    fill = min(batch / capacity, CONGESTED) if capacity > 0 else CONGESTED
    harm = decode_ms * fill / (1.0 - fill)
    # a step runs its decode iteration before its prefill slice: the first slice waits for one
    admit += step
    # ... and waits for KV memory where the requests holding it there leave too little for
    # its whole context, its output at the cap included (what the engine reserves for it)
    whole = prompt + req.max_tokens
    cached = prof.cached_tokens_for_bytes(matched)
    admit += kv_wait_ms(ev, view, now, whole, cached, deadline)
    # ... and holds that memory while it decodes, which the requests arriving meanwhile wait for
    harm += kv_harm_ms(ev, max(whole - cached, 0.0), req.max_tokens * max(step, lone_step))
    if fifo:  # nothing overtakes it: the soonest it could come is when it is expected
        floor_share, floor_admit = share, admit
    else:
        floor_share, floor_admit = _soonest_batch(ev, view, now, slo.tpot_ms, mine, fits_alone)
    # prefill's utilization there: the prefill routed there per second of the GPU time prefill
    # gets
    busy = prefill_busy(ev, decay, share)
    # its decode's GPU time, waited through by the prefills there (those due sooner too), each
    # delay a chance of a miss over that prefill's SLO, priced at this request's SLO
    tight = ev.prefill_slo_rate / ev.prefill_rate if ev.prefill_rate > 0.0 else 0.0
    decode_delay = decode_ms * busy / (1.0 - busy) * slo.ttft_ms * tight
    return Estimate(
        queue,
        own,
        share,
        admit,
        tpot_ok,
        behind,
        ev.rate_per_s * decay,
        matched,
        harm,
        busy,
        sooner,
        runs,
        floor_share,
        floor_admit,
        own_work,
        place,
        fits_alone,
        fill,
        decode_delay,
        overtaken,
    )


def kv_wait_ms(
    ev: EngineView,
    view: ClusterView,
    now: float,
    mine: float,
    cached: float = 0.0,
    deadline: float = math.inf,
) -> float:
    """How long a request of ``mine`` tokens of context, ``cached`` of them in blocks cached on
    ``ev``, waits for KV memory there (``estimate`` asks with its whole context, its output at
    its cap: what kvgate's engine reserves when its prefill starts, and what a vLLM engine
    must find before the request ends or preempt it; asked at its mean context, half its
    output, a quarter of the KV failed one cell more and `vllm-cpu-tiny` four, docs/router.md):
    the requests whose prefill has started there (the engine's RequestStarted; else from their
    first token) hold their memory, the requests queued there ahead of it (due no later, or
    all of them in arrival order) take theirs before it starts, and where all that and this
    one's new blocks pass the engine's KV capacity, it starts once enough of it is freed, each
    part when its request ends and a cached prefix with its last reader there
    (:meth:`ClusterView.kv_releases`); its capacity is the engine's own
    (:meth:`EngineView.kv_tokens`). Counting only the memory held, and freeing a shared
    prefix's part with each reader, a tool prompt's readers on `vllm-cpu-tiny` engines (2,048
    tokens of KV) were sent where the queue ahead would take the memory, predicted at 48 ms
    and refused after 232 ms of waiting for it (tool_use 4 mixed x1, docs/router.md). The
    router's count is corrected at each heartbeat to the
    memory the engine says its requests hold (``LoadHeartbeat.kv_blocks_held``: their output
    reserved whole, blocks shared across prefix groups, other routers' requests): counted from
    first tokens alone, and uncorrected, it left out a long prompt whose prefill holds a small
    engine's memory for seconds, and short requests sent where it saw room waited there for
    memory and were refused (qwen_mix on 4 engines of 3,500 blocks at twice the knee: 4.0
    points behind round robin, 2.8 with it, passing with :func:`kv_harm_ms` too;
    docs/router.md). A cached prefix they share is
    held once (``EngineView.held_kv_tokens``: the engine pins a cached block once for all
    its readers), and this request's cached prefix takes no new memory; cached prefixes nothing
    uses are evicted for it and cost no wait. Without the wait, on engines whose memory binds
    before their compute (the live benchmark's `vllm-cpu-tiny`, 2,048 tokens of KV an engine)
    the router saw the fast engines of a mixed fleet free and sent them nearly every request,
    which waited there for memory and were refused (tool_use 4 mixed x1: 40 of 616 requests
    on the slow engines, 51 refused for their TTFT; docs/BENCHMARKS.md). Counting each
    reader's whole context instead (its first form) priced an engine that holds a hot document
    as full, and sent the document's readers elsewhere to prefill it again (docs/router.md)."""
    held = ev.held_kv_tokens
    need = max(mine - cached, 0.0)
    room = ev.kv_tokens()
    # (a queued request's whole context is at most twice its mean one: nothing can be short)
    if held + need + 2.0 * ev.open_ctx_tokens <= room:
        return 0.0
    releases = view.kv_releases(ev, now, deadline)
    if releases is None:
        # (an engine that does not report its requests' starts, plain vLLM behind the bridge,
        # cannot tell a started prefill from a queued one, and the held memory it reports has
        # the started ones: the memory held alone, freed as the requests decoding there end,
        # each a mean share of it)
        n = ev.kv_holders
        short = held + need - room
        if short <= 0.0 or n <= 0 or held <= 0.0:
            return 0.0
        return view.decode_release_ms(ev, now, math.ceil(short * n / held))
    ahead = sum(tokens for _, tokens, held_now in releases if not held_now)
    short = held + ahead + need - room
    if short <= 0.0:
        return 0.0
    freed = 0.0
    for at_ms, tokens, _ in releases:
        freed += tokens
        if freed >= short:
            return at_ms
    return releases[-1][0] if releases else 0.0


def mostly_cached(matched: int, key_len: int) -> bool:
    """Whether ``matched`` bytes are at least half of a ``key_len``-byte key: the request
    prefills less than half of its prompt there (a tool prompt, a document, a conversation's
    history; not a system prompt or a trace's common opening). P/D balance's mostly cached
    request, the holder's lane's prefix and the prefixes whose eviction the cost foresees."""
    return key_len > 0 and matched * 2 >= key_len


def cached_at_start(
    ev: EngineView,
    view: ClusterView,
    now: float,
    matched: int,
    ctx: RequestContext,
    deadline: float,
) -> int:
    """How much of the ``matched`` bytes of ``ctx``'s key cached on ``ev`` is still cached
    when the request starts there (due at ``deadline``): none where its prefix is most of its
    prompt (:func:`mostly_cached`), no request of its prefix group is in flight there (to pin
    the prefix, or to compute it again before it), and the memory the requests there hold and
    the ones queued ahead of it take (:meth:`ClusterView.kv_releases`) leave no room for the
    prefix beside them: an engine short of memory evicts the cached blocks no request pins
    before a request waits for memory. The router counts a cached prefix from the engine's
    last block events; credited whole, a tool prompt's readers on `vllm-cpu-tiny` engines
    (2,048 tokens of KV) were sent to its holder, where 13 of 20 of those refused while
    waiting for memory found fewer than 20 of its 46 to 53 blocks cached (docs/router.md,
    *Sixtieth session*). A prefix that is a small part of its prompts (a system prompt) is
    left credited: the request prefills most of its prompt wherever it goes, and dropping the
    credit only where no request of the group is in flight drew the group to the engines
    where it is (qwen_mix's image requests on four `vllm-cpu-tiny` engines, -2.4 points at
    twice the knee; docs/router.md, *Sixty-first session*)."""
    if not mostly_cached(matched, ctx.key_len):
        return matched
    room = ev.kv_tokens()
    held = ev.held_kv_tokens
    cached = ev.profile.cached_tokens_for_bytes(matched)
    if held + cached + 2.0 * ev.open_ctx_tokens <= room or view.pins(ev, ctx.group):
        return matched
    releases = view.kv_releases(ev, now, deadline)
    if releases is None:
        return matched
    ahead = sum(tokens for _, tokens, held_now in releases if not held_now)
    return 0 if held + ahead + cached > room else matched


def kv_harm_ms(ev: EngineView, need: float, hold_ms: float) -> float:
    """What holding ``need`` tokens of ``ev``'s KV memory for ``hold_ms`` (a request's decode)
    costs the requests that arrive meanwhile: its share of the engine's memory for that long,
    made dearer as the memory fills, by the congestion factor ``fill / (1 - fill)`` its place in
    the decode batch is priced by (``fill``: the memory held there and this request's over the
    engine's capacity, at most :data:`CONGESTED`). Where memory binds, a request's prefill and
    decode time were its whole price, and a hot long document stayed on a small engine whose
    memory it filled: the short requests sent there waited for memory and were refused (the
    quick slice on small cards, qwen_mix 4 engines x2: 6.2 points behind `cache_aware`; two GPU
    generations, the small engines' every cell; docs/router.md, *Forty-fourth session*). On
    engines with memory to spare it is small."""
    cap = ev.kv_tokens()
    if cap <= 0.0 or need <= 0.0:
        return 0.0
    fill = min((ev.held_kv_tokens + need) / cap, CONGESTED)
    return need / cap * hold_ms * fill / (1.0 - fill)


def arrival_order_tpot_ms(ev: EngineView, mine: float, decay: float) -> float:
    """The TPOT a request (mean context ``mine``) would get on an arrival-order engine (vLLM's
    scheduler, kvgate's ``fcfs``): no admission holds a request back, so every request in
    flight there decodes in every step with it, and the prefill chunks of the requests arriving
    run inside those steps, stretching each by ``1 / (1 - prefill utilization)``
    (``decay``: :func:`rate_decay` of ``ev``'s rates now)."""
    n = ev.inflight + 1
    step = ev.profile.decode_step_ms(n, (ev.open_ctx_tokens + mine) / n) * ev.decode_scale
    return step / (1.0 - prefill_busy(ev, decay))


def measured_tpot_ms(ev: EngineView, mine: float, decay: float) -> float:
    """The TPOT ``ev`` measured lately (the median of its requests' own), for a request of mean
    context ``mine`` on an arrival-order engine: those requests decoded in batches of about
    the mean context of the ones in flight, so a longer context lengthens every step of the
    batch it joins by what the extra context costs (stretched by the prefill routed there, as
    in :func:`arrival_order_tpot_ms`); a shorter one is taken at the measured figure. Read
    unadjusted (and without SCORPIO's margin, which used to refuse them), the TPOT measured on
    shorter requests let prompts of tens of thousands of tokens into batches that then
    decoded past the SLO, every request in them late (Mooncake, 16 mixed engines 3x slower
    than the default profile: 149 TPOT misses of 640 requests; 95 with the margin; adjusted,
    75; docs/router.md)."""
    n = ev.inflight
    if n <= 0:
        return ev.tpot_ms
    prof = ev.profile
    ctx = ev.open_ctx_tokens
    step = prof.decode_step_ms
    longer = step(n + 1, (ctx + mine) / (n + 1)) - step(n + 1, ctx / n)
    if longer <= 0.0:
        return ev.tpot_ms
    return ev.tpot_ms + longer * ev.decode_scale / (1.0 - prefill_busy(ev, decay))


def _soonest_batch(
    ev: EngineView, view: ClusterView, now: float, tpot_ms: float, mine: float, fits: bool
) -> tuple[float, float]:
    """Prefill's share and the admission wait the soonest first token meets (the TTFT floor
    shedding is judged on): S-EDF serves a request due sooner before the ones queued there,
    so only the requests decoding now share the GPU and VBS admission with it. Counting every
    request in flight (as routing does: most queue ahead of a typical request) made the floor
    of an urgent request on a saturated engine seconds of admission wait that the engine never
    imposed: on mooncake 4 homo x2, half of what e2 shed met its SLO when run anyway."""
    if ev.decoding <= 0:
        return 1.0, 0.0
    t_now = ev.decode_tpot_min_ms
    n = ev.decoding
    batch = _vbs(ev.decode_inv_tpot, n, t_now)
    step = ev.profile.decode_step_ms(batch, ev.decode_ctx_tokens / n) * ev.decode_scale
    share = cost_prefill_share(step, STEP_BUDGET * t_now)
    admit = 0.0
    if fits:
        t_min = min(tpot_ms, t_now)
        capacity = batch_capacity(ev, (ev.decode_ctx_tokens + mine) / (n + 1), t_min)
        vbs = _vbs(ev.decode_inv_tpot, n, t_min)
        admit = _vbs_wait_ms(ev, view, now, vbs, n, capacity, t_min, tpot_ms)
    return share, admit + step


def check(
    ev: EngineView,
    ctx: RequestContext,
    matched: int,
    view: ClusterView,
    now: float,
    cache: PrefillCache,
) -> float:
    """0 when ``ev`` can meet the request's SLO, else by how many ms it would miss."""
    confirmed = view.confirmed.get(ev.engine_id, 0)
    est = estimate(ev, ctx, matched, view, now, cache, confirmed)
    return est.excess_ms(ctx.request.slo.ttft_ms)


def deadline_s(ctx: RequestContext, now: float) -> float:
    """When the request's first token is due (router time)."""
    return now + ctx.request.slo.ttft_ms / 1000.0


def feasible_engines(
    ctx: RequestContext,
    view: ClusterView,
    now: float,
    cache: PrefillCache | None = None,
) -> tuple[list[EngineView], float]:
    """Engines that can meet the request's SLO, and (when none can) the retry-after seconds."""
    cache = {} if cache is None else cache
    out: list[EngineView] = []
    min_excess_ms = math.inf
    matched = view.matched
    for ev in view.engines:
        excess = check(ev, ctx, matched.get(ev.engine_id, 0), view, now, cache)
        if excess > 0:
            min_excess_ms = min(min_excess_ms, excess)
        else:
            out.append(ev)
    return out, retry_after(min_excess_ms)


def retry_after(min_excess_ms: float) -> float:
    return min(max(min_excess_ms / 1000.0, MIN_RETRY_S), MAX_RETRY_S)


def shed(
    policy: str,
    ctx: RequestContext,
    retry_after_s: float,
    detail: str,
    fallback: str | None = None,
) -> Decision:
    """The decision when nobody can serve the request in time: the gateway answers 429.
    ``fallback`` names the engine it would have gone to (the simulator can run it there anyway
    to measure whether shedding was right)."""
    return Decision(
        engine_id=None,
        url=None,
        reason="shed",
        policy=policy,
        retry_after_s=retry_after_s,
        detail=detail,
        fallback=fallback,
    )


def candidates_or_shed(
    policy: str,
    ctx: RequestContext,
    view: ClusterView,
    now: float,
    enabled: bool,
) -> list[EngineView] | Decision:
    """The engines a policy may pick from (all of them when the filter is off), or the shed
    decision when the filter leaves none."""
    if not enabled:
        return list(view.engines)
    ok, retry = feasible_engines(ctx, view, now)
    return ok if ok else shed(policy, ctx, retry, "no engine can meet the SLO")
