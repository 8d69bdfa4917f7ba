"""The one small interface every routing policy implements, and what policies are handed.

A policy is pure and synchronous: ``choose(ctx, view, now) -> Decision`` from an immutable
per-engine snapshot (:class:`EngineView`, rebuilt only when that engine's state changes) and a
read-only :class:`ClusterView`. It never mutates the cluster: feedback such as E2's rebalancing is
returned as :class:`Move` values from ``rebalance`` and applied by the router. Randomness comes
from the injected ``view.rng``. Adding a policy: one module in this package with a frozen config,
one line in :mod:`router.policies.registry`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, TypeVar

from broker.events import LoadHeartbeat
from kvgate.cost_model import CostProfile
from router.api import Candidate, Decision, Listing, Reason, RouteRequest

# E2's L_i: over the work still outstanding (in-flight requests) or Preble's 3-minute window
LOAD_MODES = ("outstanding", "window")
MAX_LISTED = 4  # candidates listed in a decision by matched bytes (building them costs time)


class Rng(Protocol):
    """The part of ``random.Random`` policies use (injected, seeded by the caller)."""

    def random(self) -> float: ...

    def randrange(self, start: int, stop: int | None = None, step: int = 1) -> int: ...


@dataclass(slots=True, eq=False)  # a snapshot: equal only to itself; see router.api's docstring
class EngineView:
    """One engine as policies see it at decision time. Loads in ms of work (Preble's L)."""

    engine_id: str
    url: str
    profile: CostProfile
    inflight: int  # requests routed there and not finished
    load_ms: float  # L_i (E2's load mode): prefill of missed tokens + output tokens x TPOT_i
    tpot_ms: float  # median of the last measured TPOTs (seeded)
    hit_ratio: float  # cached share of the keys routed there recently (prefill/decode mix)
    free_bytes: int  # KV capacity not holding cached prefixes, in key bytes
    pending_prefill_tokens: int  # routed, not yet in the engine's reported queue
    routed_total: int  # requests ever routed there
    heartbeat: LoadHeartbeat | None = None
    queued_prefill_ms: float = 0.0  # prefill time of all queued there (own open + foreign)
    next_decode_step_ms: float = 0.0  # EstTPOT with one more request in the virtual batch
    position: int = 0  # rank in the cluster's (registration) order: ClusterView.engines' order
    window_ms: float = 0.0  # L_i over Preble's window (what rebalancing moves), any load mode
    window_requests: int = 0  # the requests routed there in that window (moves included)
    window_out_tokens: float = 0.0  # ... and their output tokens (priced at TPOT in window_ms)
    open_ctx_tokens: float = 0.0  # sum over in-flight requests of input + output / 2 tokens
    # the engine's fitted speed (kvgate.cost_model.SpeedFit): multiply the profile's times
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    decoding: int = 0  # the router's requests there past their first token
    decode_ctx_tokens: float = 0.0  # their summed context (input + output / 2 tokens each)
    # the KV memory the router's requests hold there (those decoding, and those whose prefill
    # has started where the engine says so), in tokens: a cached prefix they share counted once
    held_kv_tokens: float = 0.0
    kv_holders: int = 0  # ... and how many requests hold it
    decode_tpot_min_ms: float = math.inf  # their tightest TPOT SLO (the engine's step budget)
    # the in-flight requests' tightest TPOT SLO and sum of 1 / TPOT SLO (ms): their virtual
    # batch (virtual_batch); a sum of 0 with requests in flight: unknown, each counts one
    open_tpot_min_ms: float = math.inf
    open_inv_tpot: float = 0.0
    decode_inv_tpot: float = 0.0  # ... and of those decoding now
    rate_per_s: float = 0.0  # requests routed there per second recently, as of rate_t ...
    prefill_rate: float = 0.0  # ... and ms of prefill (their own, at its speed) per second
    # ... and that prefill over each one's TTFT SLO (ms / ms) per second: over ``prefill_rate``,
    # the mean 1 / TTFT SLO of the engine's prefill work (how tight what a step delays is)
    prefill_slo_rate: float = 0.0
    rate_t: float = 0.0  # ... (exponentially weighted: decays by exp(-dt / 10 s) after)
    role: str = "both"  # prefill, decode or both (broker.events.ROLES)
    # the KV the prefills routed there and not done yet will write (in key bytes): not in
    # ``free_bytes``, which counts the blocks the engine announced
    unannounced_bytes: int = 0
    # the key bytes a token of its cache holds, as its block events show (0: its profile's
    # ``bytes_per_token``): the unit of ``free_bytes`` and ``unannounced_bytes``
    key_bytes_per_token: float = 0.0
    # its heartbeat says it serves prefill in arrival order (``LoadHeartbeat.queue_order``:
    # vLLM's own scheduler), not S-EDF: nothing overtakes a queued request, nothing is dropped
    arrival_order: bool = False
    # the most new tokens of one prompt it prefills in one piece (0: whole prompts; its
    # heartbeat's ``prefill_chunk_tokens``): P_i is priced piece by piece
    prefill_chunk_tokens: int = 0

    def __init__(
        self,
        engine_id: str,
        url: str,
        profile: CostProfile,
        inflight: int,
        load_ms: float,
        tpot_ms: float,
        hit_ratio: float,
        free_bytes: int,
        pending_prefill_tokens: int,
        routed_total: int,
        heartbeat: LoadHeartbeat | None = None,
        queued_prefill_ms: float = 0.0,
        next_decode_step_ms: float = 0.0,
        position: int = 0,
        window_ms: float = 0.0,
        window_requests: int = 0,
        window_out_tokens: float = 0.0,
        open_ctx_tokens: float = 0.0,
        prefill_scale: float = 1.0,
        decode_scale: float = 1.0,
        decoding: int = 0,
        decode_ctx_tokens: float = 0.0,
        held_kv_tokens: float = 0.0,
        kv_holders: int = 0,
        decode_tpot_min_ms: float = math.inf,
        open_tpot_min_ms: float = math.inf,
        open_inv_tpot: float = 0.0,
        decode_inv_tpot: float = 0.0,
        rate_per_s: float = 0.0,
        prefill_rate: float = 0.0,
        prefill_slo_rate: float = 0.0,
        rate_t: float = 0.0,
        role: str = "both",
        unannounced_bytes: int = 0,
        key_bytes_per_token: float = 0.0,
        arrival_order: bool = False,
        prefill_chunk_tokens: int = 0,
    ) -> None:
        self.engine_id = engine_id
        self.url = url
        self.profile = profile
        self.inflight = inflight
        self.load_ms = load_ms
        self.tpot_ms = tpot_ms
        self.hit_ratio = hit_ratio
        self.free_bytes = free_bytes
        self.pending_prefill_tokens = pending_prefill_tokens
        self.routed_total = routed_total
        self.heartbeat = heartbeat
        self.queued_prefill_ms = queued_prefill_ms
        self.next_decode_step_ms = next_decode_step_ms
        self.position = position
        self.window_ms = window_ms
        self.window_requests = window_requests
        self.window_out_tokens = window_out_tokens
        self.open_ctx_tokens = open_ctx_tokens
        self.prefill_scale = prefill_scale
        self.decode_scale = decode_scale
        self.decoding = decoding
        self.decode_ctx_tokens = decode_ctx_tokens
        self.held_kv_tokens = held_kv_tokens
        self.kv_holders = kv_holders
        self.decode_tpot_min_ms = decode_tpot_min_ms
        self.open_tpot_min_ms = open_tpot_min_ms
        self.open_inv_tpot = open_inv_tpot
        self.decode_inv_tpot = decode_inv_tpot
        self.rate_per_s = rate_per_s
        self.prefill_rate = prefill_rate
        self.prefill_slo_rate = prefill_slo_rate
        self.rate_t = rate_t
        self.role = role
        self.unannounced_bytes = unannounced_bytes
        self.key_bytes_per_token = key_bytes_per_token
        self.arrival_order = arrival_order
        self.prefill_chunk_tokens = prefill_chunk_tokens

    def kv_key_bytes(self, tokens: float) -> float:
        """``tokens`` of KV in the key bytes this engine's cache holds a token (the unit of
        ``free_bytes``): measured from its blocks, else its profile's guess."""
        return tokens * (self.key_bytes_per_token or self.profile.bytes_per_token)

    def kv_tokens(self) -> int:
        """Tokens its KV cache holds: the blocks its heartbeat counts (behind the vLLM bridge,
        the engine's real block count), else its profile's (:func:`kv_blocks`)."""
        return kv_blocks(self.profile, self.heartbeat) * self.profile.block_tokens

    def window_on_clock(self, clock_ms: float) -> float:
        """``window_ms`` with its output tokens priced at a TPOT of ``clock_ms`` instead of the
        engine's own measured one (engines compared on one clock: behind the vLLM bridge a
        measured TPOT counts the prefill chunks in the engine's steps)."""
        return self.window_ms + self.window_out_tokens * (clock_ms - self.tpot_ms)


def kv_blocks(profile: CostProfile, heartbeat: LoadHeartbeat | None) -> int:
    """An engine's KV blocks: its heartbeat's count, else its profile's guess."""
    return heartbeat.kv_blocks_total if heartbeat is not None else profile.kv_blocks


# (profile, key bytes, matched bytes, chunk tokens) -> ms
PrefillCache = dict[tuple[str, int, int, int], float]


def prefill_cost_ms(ev: EngineView, key_len: int, matched: int, cache: PrefillCache) -> float:
    """Preble's P_i: prefill time of the key's part not cached on ``ev`` (after the cached
    part), on ``ev``'s profile at its fitted speed; the profile's time is memoised in ``cache``
    (most engines share a value; a policy may keep one across decisions, as keys of one size
    recur)."""
    return (
        prefill_cost_ms_for(ev.profile, key_len, cache, matched, ev.prefill_chunk_tokens)
        * ev.prefill_scale
    )


def prefill_cost_ms_for(
    prof: CostProfile, key_len: int, cache: PrefillCache, matched: int = 0, chunk: int = 0
) -> float:
    """:func:`prefill_cost_ms` for a profile, on an engine that prefills a prompt in pieces of
    at most ``chunk`` new tokens (0: in one)."""
    ck = (prof.name, key_len, matched, chunk)
    p = cache.get(ck)
    if p is None:
        cached = prof.cached_tokens_for_bytes(matched)
        new = max(prof.tokens_for_bytes(key_len) - cached, 1)
        p = cache[ck] = prof.prompt_prefill_ms(new, cached, chunk)
    return p


@dataclass(slots=True)  # not frozen, __init__ written out: see router.api's docstring
class RequestContext:
    """The request plus what the router derived from it once, for every policy."""

    request: RouteRequest
    key_len: int
    group: int  # prefix group (hash of the key's first bytes): the unit E2 moves/replicates

    def __init__(
        self,
        request: RouteRequest,
        key_len: int,
        group: int,
    ) -> None:
        self.request = request
        self.key_len = key_len
        self.group = group


@dataclass(slots=True)  # not frozen, __init__ written out: see router.api's docstring
class GroupLoad:
    """A prefix group's windowed work on one engine, and the cache its longest key takes."""

    group: int
    load_ms: float
    requests: int
    key_bytes: int = 0

    def __init__(self, group: int, load_ms: float, requests: int, key_bytes: int = 0) -> None:
        self.group = group
        self.load_ms = load_ms
        self.requests = requests
        self.key_bytes = key_bytes


@dataclass(slots=True)  # not frozen, __init__ written out: see router.api's docstring
class Move:
    """Rebalancing feedback: send ``group`` to ``dst`` from now on (``move``), or add ``dst``
    as a replica of a hot ``group`` (``replicate``)."""

    group: int
    src: str
    dst: str
    kind: Literal["move", "replicate"] = "move"

    def __init__(
        self,
        group: int,
        src: str,
        dst: str,
        kind: Literal["move", "replicate"] = "move",
    ) -> None:
        self.group = group
        self.src = src
        self.dst = dst
        self.kind = kind


class ClusterView(Protocol):
    """Read-only access to cluster state for one decision."""

    @property
    def engines(self) -> Sequence[EngineView]:
        """The candidates: alive, serving the model, not excluded or draining."""
        ...

    @property
    def matched(self) -> Mapping[str, int]:
        """Engine -> leading key bytes it caches (absent: 0), including the router's
        speculative entries (keys it routed there whose blocks no event confirmed yet)."""
        ...

    @property
    def confirmed(self) -> Mapping[str, int]:
        """:attr:`matched` without the speculative entries: what the engines' block events
        say they hold (a routed key is cached only once its request's prefill is done)."""
        ...

    @property
    def rng(self) -> Rng: ...

    def engine(self, engine_id: str) -> EngineView | None:
        """The candidate ``engine_id`` (None when it is not one): cheap lookups by id."""
        ...

    def by_load(self, window: bool = False) -> Iterator[EngineView]:
        """The candidates by ``(load_ms, position)`` (``window``: ``window_ms``), ascending,
        lazily: policies read the first few instead of scoring all."""
        ...

    def most_loaded(self, count: int, window: bool = False) -> list[EngineView]:
        """The ``count`` most loaded candidates by ``load_ms`` (``window``: by ``window_ms``),
        the most loaded first (equal loads: the highest position first)."""
        ...

    def routed_total(self) -> int:
        """The requests ever routed, to any engine."""
        ...

    def window_means(self, clock_ms: float) -> tuple[float, float]:
        """The candidates' mean windowed load (``window_ms`` with every output token priced at
        a TPOT of ``clock_ms``: one clock, as measured TPOTs differ by contention) and their
        mean windowed requests."""
        ...

    def profiles(self) -> Sequence[CostProfile]:
        """Every distinct cost profile among the candidates (a superset is fine)."""
        ...

    def share_due_sooner(self, ttft_slo_ms: float) -> float:
        """The share of the fleet's recent prefill work whose TTFT SLO is shorter than this
        (in an S-EDF queue, that work overtakes a request with this SLO)."""
        ...

    def prefill_ahead_ms(self, ev: EngineView, deadline: float) -> float:
        """Prefill time of the work ``ev``'s S-EDF scheduler serves before a request due at
        ``deadline`` (router time, s): the router's open requests there due no later, plus
        queued work it cannot attribute (charged in full); at the engine's fitted speed."""
        ...

    def prefill_queue(
        self, ev: EngineView, deadline: float, share: float = 1.0
    ) -> tuple[float, int, float]:
        """:meth:`prefill_ahead_ms`; how many requests queued on ``ev`` are due later (the
        ones a request due at ``deadline`` would delay by its own prefill); and the part of the
        work ahead that will run (the rest cannot start in time behind the work before it, at
        ``share`` of the GPU, and the engine rejects it)."""
        ...

    def routed_ahead(self, ev: EngineView, key: bytes, deadline: float, since: int) -> int:
        """How many leading bytes of ``key`` (whole blocks of ``ev``'s profile) the requests
        the router sent to ``ev`` compute, from at most ``since`` bytes on, before a request
        due at ``deadline`` would start there: those past their prefill, and those queued due
        no later that can still make their deadline (S-EDF runs them first; the engine
        prefills a shared prefix once)."""
        ...

    def decode_release_ms(self, ev: EngineView, now: float, count: int = 1) -> float:
        """How long until ``count`` of the router's requests decoding on ``ev`` have finished
        (each frees room in SCORPIO's VBS admission), from their remaining output tokens at the
        engine's measured TPOT (0: none is decoding)."""
        ...

    def kv_releases(
        self, ev: EngineView, now: float, deadline: float
    ) -> list[tuple[float, float, bool]] | None:
        """The KV memory the router's requests on ``ev`` hold, or will take before a request
        due at ``deadline`` starts there, and when each frees it: ``(ms from now, tokens,
        holds now)``, soonest first (None: ``ev`` does not report its requests' starts)."""
        ...

    def pins(self, ev: EngineView, group: int) -> bool:
        """Whether a request of prefix group ``group`` is in flight on ``ev``: one holding KV
        memory there pins the group's cached prefix, and one queued there computes it again, if
        it was evicted, before a request queued after it starts."""
        ...

    def tpot_pushed(
        self, ev: EngineView, now: float, start_ms: float, stall_ms: float, tpot_ms: float
    ) -> int:
        """How many of the router's requests decoding on ``ev`` a prefill of ``stall_ms``
        starting ``start_ms`` from now would push past their TPOT SLO."""
        ...

    def eviction_ms(self, engine_id: str, need_bytes: int, now: float) -> float:
        """Preble's M_i: cost of what ``engine_id``'s LRU would evict to fit ``need_bytes``."""
        ...

    def kv_transfer_ms(self, tokens: float) -> float:
        """Predicted time to move ``tokens`` tokens of KV from a prefill engine to a decode
        engine (the fleet's link, fitted: :class:`kvgate.cost_model.KvLink`)."""
        ...

    def override(self, group: int) -> str | None:
        """Engine a rebalanced prefix group now goes to, if any."""
        ...

    def replicas(self, group: int) -> frozenset[str]:
        """Engines a hot prefix group is replicated on (empty: not replicated)."""
        ...

    def groups_on(self, engine_id: str, min_requests: int = 1) -> Iterable[GroupLoad]:
        """Prefix groups routed to ``engine_id`` in the window with at least ``min_requests``
        requests, heaviest first (lazily). May leave out groups rebalanced to another engine
        (their work here is history: no policy can move it)."""
        ...

    def ttft_halves(self, group: int, now: float) -> tuple[float, float]:
        """Mean TTFT (ms) of ``group`` over the first and second half of the window (0: too
        few samples)."""
        ...

    def cache_room(self, engine_id: str, min_requests: int) -> int:
        """Key bytes of the engine's KV cache not needed by its prefix groups with at least
        ``min_requests`` requests in the window: its capacity minus their longest keys
        (router.view.View.cache_room)."""
        ...


class Policy(Protocol):
    """What the router calls. ``name`` equals the module name and the registry key."""

    name: str

    def choose(self, ctx: RequestContext, view: ClusterView, now: float) -> Decision: ...

    def rebalance(self, ctx: RequestContext, view: ClusterView, now: float) -> tuple[Move, ...]:
        """Feedback after a decision (default: none)."""
        ...


class PolicyBase:
    """Defaults for the optional hook."""

    name: ClassVar[str] = "base"
    load_mode = "window"  # which L the cluster keeps as EngineView.load_ms (router.cluster)

    def rebalance(self, ctx: RequestContext, view: ClusterView, now: float) -> tuple[Move, ...]:
        return ()


# ---------------------------------------------------------------------- shared helpers


T = TypeVar("T")


def pick_min(engines: Iterable[T], key: Callable[[T], object], rng: Rng) -> T:
    """The engine (or scored engine) with the smallest ``key``; exact ties broken by the
    injected rng."""
    best: list[T] = []
    best_key: object = None
    for ev in engines:
        k = key(ev)
        if not best or k < best_key:  # type: ignore[operator]
            best, best_key = [ev], k
        elif k == best_key:
            best.append(ev)
    if not best:
        raise ValueError("no engines to pick from")
    return best[0] if len(best) == 1 else best[rng.randrange(len(best))]


def top_matched(matched: Mapping[str, int], k: int) -> list[tuple[str, int]]:
    """The ``k`` engines holding the most of the key, most first; equal lengths by engine id
    (``matched``'s own order follows the tree's sets, which changes with ``PYTHONHASHSEED``).
    One pass keeping the best ``k`` in a short sorted list: no sort of every engine (a system
    prompt held everywhere makes ``matched`` as long as the cluster)."""
    if k <= 0:
        return []
    top: list[tuple[str, int]] = []  # best first
    last_e = ""
    last_m = -1
    items: dict[str, int] = matched if isinstance(matched, dict) else dict(matched)  # typed loop
    for e, m in items.items():
        if len(top) == k and (m < last_m or (m == last_m and e > last_e)):
            continue  # not better than the k-th (the common case: one comparison)
        i = len(top)
        while i > 0:  # the insertion point (k is small)
            pe, pm = top[i - 1]
            if pm > m or (pm == m and pe < e):
                break
            i -= 1
        top.insert(i, (e, m))
        if len(top) > k:
            top.pop()
        last_e, last_m = top[-1]
    return top


def by_load(ev: EngineView) -> tuple[float, int]:
    """Least windowed work first, then fewest requests in flight."""
    return (ev.load_ms, ev.inflight)


def by_inflight(ev: EngineView) -> tuple[int, float]:
    """Fewest requests in flight first (the baselines' notion of load), then windowed work."""
    return (ev.inflight, ev.load_ms)


class MatchedListing:
    """The default listing (:class:`router.api.Listing`): the engines holding the most of the
    key (at most ``MAX_LISTED``, with matched bytes) and the chosen one. ``matched`` is the
    decision's own map, which nothing changes afterwards."""

    __slots__ = ("chosen", "matched")

    def __init__(self, matched: Mapping[str, int], chosen: str) -> None:
        self.matched = matched
        self.chosen = chosen

    def candidates(self) -> tuple[Candidate, ...]:
        matched = self.matched
        items = top_matched(matched, MAX_LISTED)  # (sorted: matched's order is not stable)
        listed = [Candidate(e, m) for e, m in items if m > 0]
        if not any(c.engine_id == self.chosen for c in listed):
            listed.append(Candidate(self.chosen, matched.get(self.chosen, 0)))
        return tuple(listed)


def decide(
    policy: str,
    reason: Reason,
    chosen: EngineView,
    view: ClusterView,
    *,
    candidates: Sequence[Candidate] = (),
    listing: Listing | None = None,
    detail: str = "",
) -> Decision:
    """A Decision for ``chosen``, listing ``candidates``, or what ``listing`` builds when read,
    or by default a :class:`MatchedListing`."""
    listed: tuple[Candidate, ...] | Listing
    if candidates:
        listed = tuple(candidates)
    elif listing is not None:
        listed = listing
    else:
        listed = MatchedListing(view.matched, chosen.engine_id)
    return Decision(
        engine_id=chosen.engine_id,
        url=chosen.url,
        reason=reason,
        policy=policy,
        matched_bytes=view.matched.get(chosen.engine_id, 0),
        listing=listed,
        detail=detail,
    )
