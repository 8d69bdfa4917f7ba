"""What a policy reads for one decision: :class:`View`, over the cluster state
(:class:`router.cluster_state.ClusterState`), never changing it beyond its read caches."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from kvgate.cost_model import CostProfile
from router.cluster_state import ClusterState
from router.engine_state import _GroupWork, _Inflight
from router.policies.base import EngineView, GroupLoad, Rng
from router.tree import lcp_at


class View:
    """Read-only access for one decision (implements ``router.policies.base.ClusterView``)."""

    __slots__ = (
        "_cluster",
        "_eligible",
        "_exclude",
        "_model",
        "_now",
        "confirmed",
        "engines",
        "matched",
        "rng",
    )

    def __init__(
        self,
        cluster: ClusterState,
        engines: list[EngineView],
        matched: Mapping[str, int],
        rng: Rng,
        *,
        model: str = "",
        exclude: frozenset[str] = frozenset(),
        now: float = 0.0,
        confirmed: Mapping[str, int] | None = None,
    ) -> None:
        self._cluster = cluster
        self.engines = engines
        self.matched = matched
        self.confirmed = matched if confirmed is None else confirmed
        self.rng = rng
        self._eligible = cluster.eligible(model, now)
        self._exclude = exclude
        self._model = model
        self._now = now

    def engine(self, engine_id: str) -> EngineView | None:
        eng = self._eligible.get(engine_id)
        if eng is None or engine_id in self._exclude:
            return None
        return eng.view or self._cluster.engine_view(eng)

    def by_load(self, window: bool = False) -> Iterator[EngineView]:
        """Candidates by ``(load_ms, position)`` (``window``: ``window_ms``), ascending
        (``position`` is the registration order, the order of :attr:`engines`). Lazy: reading
        the first few costs a few steps, not a pass over every engine (the most loaded:
        :meth:`most_loaded`)."""
        cl = self._cluster
        cl._sync_loads()
        eligible = self._eligible
        exclude = self._exclude
        view = cl.engine_view
        for engine_id in (cl._by_window if window else cl._by_load).ids:
            eng = eligible.get(engine_id)
            if eng is not None and engine_id not in exclude:
                yield eng.view or view(eng)

    def most_loaded(self, count: int, window: bool = False) -> list[EngineView]:
        """The ``count`` most loaded candidates by ``load_ms`` (``window``: ``window_ms``),
        the most loaded first: a walk from the end of the sorted order (equal loads come the
        highest position first), a few steps rather than a pass over every engine (rebalancing
        asks after every decision)."""
        cl = self._cluster
        cl._sync_loads()
        ids = (cl._by_window if window else cl._by_load).ids
        eligible = self._eligible
        exclude = self._exclude
        out: list[EngineView] = []
        for j in range(len(ids) - 1, -1, -1):
            if len(out) >= count:
                break
            eng = eligible.get(ids[j])
            if eng is not None and (not exclude or ids[j] not in exclude):
                out.append(eng.view or cl.engine_view(eng))
        return out

    def routed_total(self) -> int:
        """The requests ever routed, to any engine (E2's warm-up)."""
        return self._cluster.routed_total

    def window_means(self, clock_ms: float) -> tuple[float, float]:
        """The candidates' mean windowed load (output tokens priced at a TPOT of ``clock_ms``)
        and mean windowed requests (E2's rebalancing trigger). Where every engine the router
        knows is a candidate (one model, no roles, none draining or gone), the cluster's running
        sums; else a pass over the candidates (their views as this decision read them)."""
        engines = self.engines
        n = len(engines)
        if n == 0:
            return 0.0, 0.0
        cl = self._cluster
        if n == len(cl.engines):
            return cl.window_load_ms(clock_ms) / n, cl.window_requests() / n
        load = 0.0
        requests = 0
        for e in engines:
            load += e.window_on_clock(clock_ms)
            requests += e.window_requests
        return load / n, requests / n

    def profiles(self) -> tuple[CostProfile, ...]:
        """The distinct cost profiles among the candidates (or a superset)."""
        return self._cluster.eligible_profiles(self._model, self._now)

    def kv_transfer_ms(self, tokens: float) -> float:
        return self._cluster.kv.transfer_ms(tokens)

    def share_due_sooner(self, ttft_slo_ms: float) -> float:
        """The share of the fleet's recent prefill work with a TTFT SLO shorter than this
        (:class:`router.slo_mix.SloMix`): what overtakes such a request in an S-EDF queue."""
        return self._cluster.slo_mix.share_sooner(ttft_slo_ms)

    def prefill_ahead_ms(self, ev: EngineView, deadline: float) -> float:
        """Prefill time of what ``ev``'s S-EDF prefill scheduler serves before a request due at
        ``deadline``: this router's open requests there (no first token yet) due no later that
        can still make their own deadline (S-EDF runs a request whose slack is negative last,
        and rejects it while it waits: under overload most of a queue is such work), plus the
        queued work it cannot attribute to them (``_Engine.foreign_prefill_tokens``: another
        router's requests), charged in full."""
        eng = self._cluster.engines.get(ev.engine_id)
        if eng is None:
            return ev.queued_prefill_ms
        return self.prefill_queue(ev, deadline)[0]

    def prefill_queue(
        self, ev: EngineView, deadline: float, share: float = 1.0
    ) -> tuple[float, int, float]:
        """:meth:`prefill_ahead_ms`; how many of the router's requests queued there are due
        later (a request due at ``deadline`` would delay them by its own prefill); and the part
        of the work ahead that will run: in deadline order, a request that cannot start in
        time behind the ones before it (at ``share`` of the GPU for prefill) is rejected by the
        engine while it waits, and never runs. An engine serving in arrival order
        (``EngineView.arrival_order``: vLLM's own scheduler) runs all of its queue first and
        drops none: every open request there is ahead, none behind, all of it runs."""
        eng = self._cluster.engines.get(ev.engine_id)
        if eng is None:
            return ev.queued_prefill_ms, 0, ev.queued_prefill_ms
        now = self._now
        scale = ev.prefill_scale
        prof = ev.profile
        behind = 0
        foreign = eng.foreign_prefill_tokens
        tokens_ahead = foreign
        ahead: list[tuple[float, int, float]] = []
        fifo = ev.arrival_order
        for due, tokens, prefill_s, done in eng.open_prefill.values():
            if done <= now and not eng.reports_requests:
                # an engine without request events: presumably prefilled by now (one that has
                # sent any says when: a request routed before its first event, set to end at a
                # guess, stays open until its first token; expired, the first long prefills of
                # a cold fleet looked done while later requests due sooner overtook them)
                continue
            if fifo:
                tokens_ahead += tokens
            elif due <= deadline:
                if due - now >= prefill_s:
                    tokens_ahead += tokens
                    ahead.append((due, tokens, prefill_s))
            else:
                behind += 1
        ahead_ms = prof.prefill_ms(tokens_ahead) * scale if tokens_ahead > 0 else 0.0
        if len(ahead) <= 1:  # (in arrival order it stays empty: all of the queue runs)
            return ahead_ms, behind, ahead_ms
        ahead.sort()
        tokens_run = foreign
        run_ms = prof.prefill_ms(foreign) * scale if foreign > 0 else 0.0
        for due, tokens, prefill_s in ahead:
            if now + (run_ms / 1000.0 + prefill_s) / share <= due:
                tokens_run += tokens
                run_ms = prof.prefill_ms(tokens_run) * scale
        return ahead_ms, behind, run_ms

    def routed_ahead(self, ev: EngineView, key: bytes, deadline: float, since: int) -> int:
        """The longest prefix of ``key`` that the requests the router sent to ``ev`` have
        written or write before a request due at ``deadline`` starts there, in whole blocks:
        one past its prefill (its blocks are written, perhaps not yet announced), or one queued
        due no later that can still make its deadline (S-EDF runs it first) and prefills the
        key from at most ``since`` bytes (what is cached there for this one). A queued request
        routed on a longer match waits for another to compute that part, and a request due
        later, or one the engine will reject, does not compute it first. (The speculative tree
        answers which engine a key was routed to, not by whom: this asks the requests in flight
        there.)"""
        eng = self._cluster.engines.get(ev.engine_id)
        if eng is None:
            return 0
        now = self._now
        fifo = ev.arrival_order
        queued = [
            request_id
            for request_id, (due, _, prefill_s, _) in eng.open_prefill.items()
            if _starts_first(due, prefill_s, deadline, now, fifo)
        ]
        block = eng.profile.block_bytes
        # what is cached for this request (``since``: whole blocks) and the first block past
        # it: a key without both adds no whole block, and one memcmp tells most keys apart
        head = key[: since + block]
        if len(head) <= since:
            return 0
        best = max(
            self._shared_prefix(eng.decoding, key, head, None),
            self._shared_prefix(queued, key, head, since),
        )
        return best - best % block

    def _shared_prefix(
        self, request_ids: Iterable[str], key: bytes, head: bytes, since: int | None
    ) -> int:
        """The longest prefix of ``key`` that the keys routed with these in-flight requests
        share, among those starting with ``head`` (0: none does); with ``since``, only the
        requests routed on at most that many cached bytes (the ones that prefill the rest)."""
        cl = self._cluster
        inflight = cl._inflight
        spec = cl.spec
        h = len(head)
        n = len(key)
        best = 0
        for request_id in request_ids:
            rec = inflight.get(request_id)
            if rec is None or (since is not None and rec.matched_bytes > since):
                continue
            other = spec.key_of(rec.spec)
            if other is None or not other.startswith(head):
                continue
            m = min(n, len(other))
            k = h + lcp_at(other, h, key, h, m - h) if m > h else h
            if k > best:
                best = k
        return best

    def decode_release_ms(self, ev: EngineView, now: float, count: int = 1) -> float:
        """How long until ``count`` of the router's requests decoding on ``ev`` have finished
        (freeing room in SCORPIO's VBS admission): each one's remaining output tokens at the
        engine's measured TPOT, the ``count``-th soonest; beyond the requests decoding now,
        each further one takes a mean decode time divided by the batch (0: none decodes)."""
        eng = self._cluster.engines.get(ev.engine_id)
        if eng is None or not eng.decoding or count <= 0:
            return 0.0
        tpot = eng.tpot_ms
        left = sorted(_output_left_ms(rec, tpot, now) for rec in eng.decoding.values())
        if count <= len(left):
            return left[count - 1]
        n = len(left)
        mean_ms = sum(rec.out_tokens for rec in eng.decoding.values()) * tpot / n
        return left[-1] + (count - n) * mean_ms / n

    def kv_releases(
        self, ev: EngineView, now: float, deadline: float
    ) -> list[tuple[float, float, bool]] | None:
        """The KV memory the router's requests on ``ev`` hold, or will take before a request
        due at ``deadline`` starts there, and when each part frees: ``(ms from now, tokens,
        held now)``, soonest first. A request decoding frees its own memory after its output
        left at the engine's measured TPOT; one whose prefill has started, after that prefill
        (at most its whole prefill time) and its output; a prefix group's cached prefix, which
        the engine pins once for all its readers there, when the last of them frees its own.
        The memory held now sums to ``ev.held_kv_tokens`` (the engine's own count at its last
        heartbeat, the difference spread over the requests' own parts). On an engine that
        reports its requests' starts, a request queued ahead of it (S-EDF: due no later and
        able to start in time; in arrival order: every one queued) takes its whole context past
        its cached prefix when it starts and frees it after the prefills before it, its own and
        its output. None for an engine that does not report its requests' starts (plain vLLM
        behind the bridge): it cannot tell a started prefill from a queued one, and the held
        count it reports has the started ones."""
        eng = self._cluster.engines.get(ev.engine_id)
        if eng is None:
            return []
        if not eng.reports_requests:
            return None
        tpot = eng.tpot_ms
        inflight = self._cluster._inflight
        own: list[tuple[float, float]] = []  # (frees at, tokens) of the requests holding memory
        last: dict[int, float] = {}  # prefix group -> when its last holder frees its own
        for dec in eng.decoding.values():
            left = _output_left_ms(dec, tpot, now)
            own.append((left, dec.ctx_tokens - dec.cached_tokens))
            last[dec.group] = max(last.get(dec.group, 0.0), left)
        fifo = ev.arrival_order
        # (in the order the engine starts them: deadlines, or arrival, the routing order)
        queued: list[tuple[float, float, float, float, int, bool]] = []
        for position, (request_id, (due, _, prefill_s, _)) in enumerate(eng.open_prefill.items()):
            rec = inflight.get(request_id)
            if rec is None or rec.first_token:
                continue
            if rec.holds_memory:  # its prefill has started: it runs before anything queued
                own_tokens = rec.ctx_tokens - rec.cached_tokens
                queued.append((-1.0, prefill_s, rec.out_tokens, own_tokens, rec.group, True))
            elif _starts_first(due, prefill_s, deadline, now, fifo):
                whole = rec.ctx_tokens + rec.out_tokens / 2.0 - rec.cached_tokens
                order = float(position) if fifo else due
                queued.append((order, prefill_s, rec.out_tokens, whole, rec.group, False))
        queued.sort()
        out: list[tuple[float, float, bool]] = []
        start_ms = 0.0
        for _, prefill_s, out_tokens, tokens, group, holds in queued:
            start_ms += prefill_s * 1000.0
            frees = start_ms + out_tokens * tpot
            if holds:
                own.append((frees, tokens))
                last[group] = max(last.get(group, 0.0), frees)
            else:
                out.append((frees, tokens, False))
        prefixes = 0.0
        for group, (_, shared) in eng.held_prefixes.items():
            if group in last:
                out.append((last[group], shared, True))
                prefixes += shared
        counted = sum(tokens for _, tokens in own)
        scale = max(ev.held_kv_tokens - prefixes, 0.0) / counted if counted > 0.0 else 0.0
        out += [(frees, tokens * scale, True) for frees, tokens in own]
        out.sort()
        return out

    def pins(self, ev: EngineView, group: int) -> bool:
        """Whether a request of ``group`` is in flight on ``ev``: holding memory there
        (``_Engine.held_prefixes``) or queued there."""
        eng = self._cluster.engines.get(ev.engine_id)
        if eng is None:
            return False
        if group in eng.held_prefixes:
            return True
        inflight = self._cluster._inflight
        for request_id in eng.open_prefill:
            rec = inflight.get(request_id)
            if rec is not None and rec.group == group:
                return True
        return False

    def tpot_pushed(
        self, ev: EngineView, now: float, start_ms: float, stall_ms: float, tpot_ms: float
    ) -> int:
        """How many of the router's requests decoding on ``ev`` a prefill of ``stall_ms``
        starting ``start_ms`` from now would push past their TPOT SLO, decoding at ``tpot_ms``
        otherwise (an arrival-order engine runs prefill chunks inside its decode steps, so a
        prefill stalls every request decoding there); those that miss it anyway do not count."""
        eng = self._cluster.engines.get(ev.engine_id)
        if eng is None or not eng.decoding or stall_ms <= 0.0:
            return 0
        pushed = 0
        for rec in eng.decoding.values():
            if rec.tpot_slo_ms <= 0.0 or rec.out_tokens <= 1:
                continue
            elapsed = (now - rec.first_at) * 1000.0
            left = max(rec.out_tokens * tpot_ms - elapsed, tpot_ms)
            slack = (rec.out_tokens - 1) * rec.tpot_slo_ms - elapsed - left
            if 0.0 <= slack < min(stall_ms, left - start_ms):
                pushed += 1
        return pushed

    def eviction_ms(self, engine_id: str, need_bytes: int, now: float, max_scan: int = 64) -> float:
        """Preble's M_i: walk the engine's LRU (its likely eviction order) until ``need_bytes``
        are freed; each evicted prefix costs ``hit count (decayed over the window) x miss rate x
        the prefill time its tokens add``, the miss rate being ``1 / holders`` (a prefix other
        engines also hold is cheaper to lose here), at most once (the next request that wants
        it there recomputes it once: the window's hits are not each a miss). What its tokens
        add (:meth:`CostProfile.extra_prefill_ms`), not a prefill of their own: that request
        prefills them with its own part and pays a prefill's fixed cost either way (priced as a
        prefill alone, a 288-token document on the vLLM replica's model cost 7.2 ms to lose
        where recomputing it adds 2.6, and requests left its holder for an engine with free
        memory, copying it).
        A node is priced whole even when the walk needs only its tail: the LRU takes the rest
        of it next (priced by the blocks freed, 2-engine cells past the knee lost hits and up to
        1.8 points; docs/router.md). Beyond ``max_scan`` nodes the cost of the scanned part is
        extrapolated."""
        if need_bytes <= 0:
            return 0.0
        cl = self._cluster
        eng = cl.engines.get(engine_id)
        if eng is None:
            return 0.0
        p = eng.profile
        speed = eng.speed.prefill
        tree = cl.tree
        tau = tree.hit_tau_s
        freed = 0
        cost = 0.0
        for i, node in enumerate(tree.lru_nodes(engine_id)):
            if i >= max_scan:
                return cost * need_bytes / max(freed, 1)
            size = node.coverage(engine_id)
            holders = (len(node.full) if node.full else 0) + (
                len(node.partial) if node.partial else 0
            )
            hits = node.hit_count(now, tau)
            if hits > 0.0:
                tokens = p.cached_tokens_for_bytes(size)
                context = p.cached_tokens_for_bytes(node.start)
                # the next request that wants it here prefills it again with its own part and
                # caches it anew: once at most, not once per hit of the window
                misses = hits / max(holders, 1)
                extra = p.extra_prefill_ms(tokens, context)
                cost += (misses if misses < 1.0 else 1.0) * extra * speed
            freed += size
            if freed >= need_bytes:
                break
        return cost

    def override(self, group: int) -> str | None:
        o = self._cluster._overrides.get(group)
        return o[0] if o is not None else None

    def replicas(self, group: int) -> frozenset[str]:
        r = self._cluster._replicas.get(group)
        return r[0] if r is not None else frozenset()

    def groups_on(self, engine_id: str, min_requests: int = 1) -> Iterator[GroupLoad]:
        """Heaviest first (equal loads: the lower group id first), a GroupLoad only for each
        group read. Groups rebalanced to another engine are left out (their work here is
        history: new requests go there), and so are groups under ``min_requests``. Why: a hot
        prefix spread over many engines and moved from one leaves history on all the others;
        the busiest of them then lists only such groups, and rebalancing, which runs after
        every decision while it stays the busiest, popped them all each time (~30 us a
        decision at 70 groups, measured)."""
        eng = self._cluster.engines.get(engine_id)
        if eng is None:
            return
        tpot = eng.tpot_ms
        overrides = self._cluster._overrides

        def listed(g: int, w: _GroupWork) -> bool:
            return _lives_here(overrides, engine_id, g, w, min_requests)

        # the heaviest: usually known without reading the groups (a scan of 80 groups cost
        # ~30 us when they were out of the CPU's caches); rebalancing usually reads one
        # group and stops
        found = False
        best = 0
        best_load = 0.0
        top = self._cluster.heaviest_group(eng)
        if top is not None and listed(top[0], top[1]):
            found, best, best_load = True, top[0], top[1].load_ms(tpot)
        if not found:  # the heaviest is left out: one typed pass, no allocation
            for g, w in eng.groups.items():
                if listed(g, w):
                    load = w.load_ms(tpot)
                    if not found or load > best_load or (load == best_load and g < best):
                        found, best, best_load = True, g, load
        if not found:
            return
        top_work = eng.groups[best]
        yield GroupLoad(best, best_load, top_work.requests, top_work.key_bytes)
        # the rest, if read: two C sorts of indices (ints, then floats: CPython compares them
        # without generic rich comparisons), group id ascending, then stably by load descending
        groups: list[int] = []
        loads: list[float] = []
        requests: list[int] = []
        sizes: list[int] = []
        for g, w in eng.groups.items():
            if g != best and listed(g, w):
                groups.append(g)
                loads.append(w.load_ms(tpot))
                requests.append(w.requests)
                sizes.append(w.key_bytes)
        order = sorted(range(len(groups)), key=groups.__getitem__)
        order.sort(key=loads.__getitem__, reverse=True)
        for i in order:
            yield GroupLoad(groups[i], loads[i], requests[i], sizes[i])

    def cache_room(self, engine_id: str, min_requests: int) -> int:
        """Key bytes of ``engine_id``'s KV cache not needed by the prefixes reused there: its
        capacity, less the longest key of each prefix group with at least ``min_requests``
        requests there in the window (groups rebalanced elsewhere left out: their requests no
        longer come here)."""
        cl = self._cluster
        eng = cl.engines.get(engine_id)
        if eng is None:
            return 0
        overrides = cl._overrides
        hot = 0
        for g, w in eng.groups.items():
            if _lives_here(overrides, engine_id, g, w, min_requests):
                hot += w.key_bytes
        return cl.capacity_bytes(eng) - hot

    def ttft_halves(self, group: int, now: float) -> tuple[float, float]:
        dq = self._cluster._ttfts.get(group)
        if not dq:
            return 0.0, 0.0
        mid = now - self._cluster.config.window_s / 2
        first = [v for t, v in dq if t < mid]
        second = [v for t, v in dq if t >= mid]
        if len(first) < 2 or len(second) < 2:
            return 0.0, 0.0
        return sum(first) / len(first), sum(second) / len(second)


def _lives_here(
    overrides: dict[int, tuple[str, float]],
    engine_id: str,
    g: int,
    w: _GroupWork,
    min_requests: int,
) -> bool:
    """Whether group ``g`` (its work ``w`` on ``engine_id``) has at least ``min_requests``
    requests there in the window and was not rebalanced to another engine."""
    if w.requests < min_requests or w.requests <= 0:
        return False
    o = overrides.get(g) if overrides else None
    return o is None or o[0] == engine_id


def _starts_first(due: float, prefill_s: float, deadline: float, now: float, fifo: bool) -> bool:
    """Whether a request queued on an engine (due at ``due``, its prefill ``prefill_s``) starts
    before one due at ``deadline``: in arrival order every one queued does; under S-EDF one due
    no later that can still make its own deadline (the engine rejects the rest while they wait)."""
    return fifo or (due <= deadline and due - now >= prefill_s)


def _output_left_ms(rec: _Inflight, tpot_ms: float, now: float) -> float:
    """How long until a decoding request ends: its output left at ``tpot_ms`` (at least one
    token's time)."""
    return max(rec.out_tokens * tpot_ms - (now - rec.first_at) * 1000.0, tpot_ms)
