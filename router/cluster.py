"""Cluster state folded from broker events and the router's own decisions. Pure: takes ``now``.

What it keeps and why:

* engines: liveness by heartbeat TTL (router receipt time, so engine clock skew does not
  matter), epoch, cost profile, the latest :class:`LoadHeartbeat` (also how an engine's URL and
  models are learned), draining, static;
* the cache map (:class:`router.tree.RadixTree`) and the router's own speculative/approximate
  entries (:class:`Speculative`): a routed key counts as cached on its engine at once, for a
  short TTL on engines that report KV events (so a burst of one prefix is not explored N times)
  or a long one on engines that do not (approximate mode);
* in-flight requests, recorded at routing time and released by the engine's RequestFinished or
  RequestRejected (matched by request id), the gateway's ``report``, or a timeout;
* sliding windows (3 minutes by default): per engine, the work routed there (Preble's L: prefill
  of missed tokens, output tokens to be multiplied by the engine's TPOT), per prefix group and
  engine (what E2 moves), per prefix group the TTFTs (hot-prefix detection); 30 s of matched
  vs. key bytes per engine (prefill/decode balance);
* TPOT: median of each engine's last 200 measured TPOTs, seeded at 150 ms.

Policies see it through :class:`View` (read-only) and immutable :class:`EngineView` snapshots,
rebuilt only for engines whose state changed.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from statistics import median

from broker.events import (
    ROLES,
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
from kvgate.cost_model import (
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_KV_LINK_GBPS,
    CostProfile,
    KvLink,
    ProfileError,
    SpeedFit,
    default_profile,
    load_profile,
)
from router.api import EngineInfo, RouteRequest
from router.keytree import KeyNode, KeyTree
from router.policies.base import LOAD_MODES, EngineView, GroupLoad, Move, Rng
from router.policies.feasibility import (
    RATE_TAU_S,
    next_decode_step_ms,
    queued_prefill_tokens,
)
from router.tree import Match, RadixTree


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Windows, TTLs and budgets of the cluster state (seconds, bytes)."""

    window_s: float = 180.0  # Preble's load and prefix-statistics window
    hit_window_s: float = 30.0  # prefill/decode balance window
    heartbeat_ttl_s: float = 15.0  # an engine with no heartbeat for this long is dead
    inflight_timeout_s: float = 600.0  # forget a routed request nobody reported on
    tree_budget_bytes: int = 1 << 30
    speculative_ttl_s: float = 10.0  # routed key assumed cached on a reporting engine
    # ... and once its request ended (its KV events may still be on their way), this long
    speculative_grace_s: float = 1.0
    approximate_ttl_s: float = 600.0  # ... on an engine without KV events (approximate mode)
    approximate: bool = False  # treat every engine as reporter-less (tree from decisions)
    speculative_max_entries: int = 100_000
    group_bytes: int = 1024  # prefix group = hash of the key's first bytes
    tpot_samples: int = 200
    tpot_seed_ms: float = 150.0
    default_profile: str = "mistral-7b-a6000"
    # fit each engine's real prefill/decode speed from its reports (kvgate.cost_model.SpeedFit);
    # off: trust the announced profiles (the ablation of docs/router.md)
    fit_speed: bool = True
    # prefill/decode disaggregation: the fleet's KV size per token and the link between a
    # prefill and a decode engine (kvgate.cost_model.KvLink; fitted online with fit_speed)
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    kv_link_gbps: float = DEFAULT_KV_LINK_GBPS


@dataclass(slots=True)  # __init__ written out: see router.api's docstring
class _Inflight:
    """A request the router sent and has not seen finish."""

    engine_id: str
    t: float
    group: int
    missed_tokens: int
    pending: bool = True  # not yet seen in the engine's queue
    first_token: bool = False
    prefill_ms: float = 0.0  # its L entry's prefill part (outstanding until the first token)
    out_tokens: int = 0  # its output tokens (outstanding until it ends)
    ctx_tokens: float = 0.0  # input + output / 2: its mean context while decoding (EstTPOT)
    spec: int = 0  # its speculative entry (settled when it ends, on engines reporting KV)
    deadline: float = 0.0  # when its first token is due (router time: S-EDF's order)
    tpot_slo_ms: float = 0.0  # its TPOT SLO (the engine's decode step budget while it decodes)
    first_at: float = 0.0  # router time of its first token
    engine_tokens: int = 0  # its prefill tokens as the engine counted them (RequestEnqueued)
    # its prefill time on the engine's profile when it found nothing ahead of it there (its
    # TTFT then shows the engine's prefill speed, for engines that do not report it); else 0
    idle_prefill_ms: float = 0.0

    def __init__(
        self,
        engine_id: str,
        t: float,
        group: int,
        missed_tokens: int,
        pending: bool = True,
        first_token: bool = False,
        prefill_ms: float = 0.0,
        out_tokens: int = 0,
        ctx_tokens: float = 0.0,
        spec: int = 0,
        deadline: float = 0.0,
        tpot_slo_ms: float = 0.0,
        first_at: float = 0.0,
        engine_tokens: int = 0,
        idle_prefill_ms: float = 0.0,
    ) -> None:
        self.engine_id = engine_id
        self.t = t
        self.group = group
        self.missed_tokens = missed_tokens
        self.pending = pending
        self.first_token = first_token
        self.prefill_ms = prefill_ms
        self.out_tokens = out_tokens
        self.ctx_tokens = ctx_tokens
        self.spec = spec
        self.deadline = deadline
        self.tpot_slo_ms = tpot_slo_ms
        self.first_at = first_at
        self.engine_tokens = engine_tokens
        self.idle_prefill_ms = idle_prefill_ms


class _GroupWork:
    """One prefix group's work on one engine in the window: what rebalancing weighs and moves
    (typed fields, not a list: the rebalancing check reads them after most decisions)."""

    __slots__ = ("entries", "out_tokens", "prefill_ms", "requests")

    def __init__(self) -> None:
        self.prefill_ms = 0.0
        self.out_tokens = 0
        self.requests = 0
        self.entries: deque[list] = deque()  # its entries of Cluster._load, oldest first

    def load_ms(self, tpot_ms: float) -> float:
        """Its share of Preble's windowed L on an engine decoding at ``tpot_ms``."""
        return self.prefill_ms + self.out_tokens * tpot_ms


@dataclass(slots=True)
class _Engine:
    """Mutable per-engine state (cluster-internal; policies get :class:`EngineView`)."""

    engine_id: str
    profile: CostProfile
    url: str = ""
    models: tuple[str, ...] = ()
    epoch: str = ""
    static: bool = False
    draining: bool = False
    heartbeat: LoadHeartbeat | None = None
    last_heartbeat: float = -1e18
    reports_kv: bool = False
    inflight: int = 0
    pending_prefill_tokens: int = 0
    routed_total: int = 0
    load_prefill_ms: float = 0.0
    load_out_tokens: float = 0.0
    open_prefill_ms: float = 0.0  # prefill of in-flight requests without a first token yet
    open_out_tokens: int = 0  # output tokens of in-flight requests
    open_ctx_tokens: float = 0.0  # sum of in-flight requests' ctx_tokens
    # in-flight requests without a first token: request id -> (deadline, missed tokens, their
    # prefill time at the engine's speed in s, when it presumably ended (engines that send no
    # request events; else inf))
    open_prefill: dict[str, tuple[float, int, float, float]] = field(default_factory=dict)
    reports_requests: bool = False  # it sends request events (enqueued, first token, ...)
    open_prefill_tokens: int = 0  # their sum of missed tokens
    groups: dict[int, _GroupWork] = field(default_factory=dict)
    tpots: deque = field(default_factory=deque)
    tpot_ms: float = 150.0
    hit_matched: int = 0
    hit_total: int = 0
    view: EngineView | None = None
    seq: int = 0  # registration order: the order of the eligible sets (ties break on it)
    # the heaviest group in ``groups`` by (load, lower id), kept as work is added (see
    # Cluster._note_group); None with top_known: no group; not top_known: find it by a scan
    top_work: _GroupWork | None = None
    top_group: int = 0
    top_known: bool = True
    load_key: float | None = None  # the L it is filed under in Cluster._by_load
    window_key: float | None = None  # ... in Cluster._by_window
    speed: SpeedFit = field(default_factory=SpeedFit)  # its fitted prefill/decode speed
    # the router's requests decoding there (past their first token): what the engine's decode
    # step runs, so what prefill's share of the GPU is (router.policies.feasibility)
    decoding: dict[str, _Inflight] = field(default_factory=dict)
    decode_ctx: float = 0.0  # their summed context
    decode_tpots: dict[float, int] = field(default_factory=dict)  # their TPOT SLOs, counted
    # queued prefill the last heartbeat reported beyond this router's requests queued there
    # at that moment (another router's): charged to every request until the next heartbeat.
    # (Not "reported queue minus open requests now": a heartbeat is up to a period old, and
    # the requests whose prefill ended since would count as someone else's work.) Counted in
    # the engine's own tokens (``enqueued_tokens``: its RequestEnqueued), which differ from the
    # router's where the router credits a prefix the engine has not cached yet.
    foreign_prefill_tokens: int = 0
    enqueued_tokens: int = 0
    rate: float = 0.0  # requests/s routed here recently (RATE_TAU_S), as of rate_t
    prefill_rate: float = 0.0  # ms of their prefill (at its speed) per s, as of rate_t
    rate_t: float = 0.0
    role: str = "both"  # prefill, decode or both (its heartbeat's, or configured)

    def window_ms(self) -> float:
        """Preble's L_i as defined: windowed prefill work + windowed output tokens x TPOT_i."""
        return max(self.load_prefill_ms, 0.0) + max(self.load_out_tokens, 0) * self.tpot_ms

    def outstanding_ms(self) -> float:
        """L_i over the work still to do: prefill of the in-flight requests that have no first
        token yet + their output tokens x TPOT_i (the same terms, only for open requests)."""
        return max(self.open_prefill_ms, 0.0) + max(self.open_out_tokens, 0) * self.tpot_ms

    def alive(self, now: float, ttl: float) -> bool:
        return bool(self.url) and (self.static or now - self.last_heartbeat <= ttl)

    def serves(self, model: str) -> bool:
        return not model or not self.models or model in self.models


MAX_LANES = 8  # distinct durations given a lane; more go to the heap


class _ExpiryQueue:
    """``(expiry, handle)`` records, earliest first. Every record comes with its duration
    (expiry = now + duration) and the router's durations are a few constants with a clock that
    never goes back, so the records of one duration arrive in expiry order: each duration is a
    FIFO lane, pushed and popped in O(1), where a heap paid ~26 tuple comparisons per record at
    the benchmark's ~10,000 records. A record that would break its lane's order (a clock that
    went back) goes to a heap. Equal expiries pop by handle."""

    __slots__ = ("_heap", "_lanes", "_order", "_size")

    def __init__(self) -> None:
        self._lanes: dict[float, deque[tuple[float, int]]] = {}  # duration -> its lane
        self._order: list[deque[tuple[float, int]]] = []  # the lanes, for a typed scan
        self._heap: list[tuple[float, int]] = []
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, expires: float, handle: int, duration: float) -> None:
        lane = self._lanes.get(duration)
        if lane is None and len(self._lanes) < MAX_LANES:
            lane = self._lanes[duration] = deque()
            self._order.append(lane)
        if lane is None or (lane and lane[-1][0] > expires):
            heapq.heappush(self._heap, (expires, handle))
        else:
            lane.append((expires, handle))
        self._size += 1

    def _first(self) -> deque[tuple[float, int]] | None:
        """The lane holding the earliest record (None: the heap does, or nothing is held);
        compares the expiries as floats, the handles only on a tie."""
        best: deque[tuple[float, int]] | None = None
        best_t = math.inf
        best_h = 0
        for lane in self._order:
            if lane:
                t, h = lane[0]
                if best is None or t < best_t or (t == best_t and h < best_h):
                    best, best_t, best_h = lane, t, h
        heap = self._heap
        if heap:
            t, h = heap[0]
            if best is None or t < best_t or (t == best_t and h < best_h):
                return None
        return best

    def first_expiry(self) -> float:
        """The earliest expiry held (infinity when empty)."""
        if not self._size:
            return math.inf
        lane = self._first()
        return lane[0][0] if lane is not None else self._heap[0][0]

    def pop_due(self, now: float) -> tuple[float, int] | None:
        """Remove and return the earliest record if it expires at or before ``now`` (one scan
        of the lanes, not one to look and one to pop)."""
        if not self._size:
            return None
        lane = self._first()
        if lane is not None:
            if lane[0][0] > now:
                return None
            self._size -= 1
            return lane.popleft()
        if self._heap[0][0] > now:
            return None
        self._size -= 1
        return heapq.heappop(self._heap)

    def pop(self) -> tuple[float, int]:
        """Remove and return the earliest record (the queue must not be empty)."""
        record = self.pop_due(math.inf)
        if record is None:
            raise IndexError("pop from an empty expiry queue")
        return record

    def keep(self, wanted: Callable[[float, int], bool]) -> None:
        """Drop every record for which ``wanted(expiry, handle)`` is false."""
        for duration, lane in list(self._lanes.items()):
            self._lanes[duration] = deque(r for r in lane if wanted(r[0], r[1]))
        self._order = list(self._lanes.values())
        self._heap = [r for r in self._heap if wanted(r[0], r[1])]
        heapq.heapify(self._heap)
        self._size = len(self._heap) + sum(len(lane) for lane in self._lanes.values())


class Speculative:
    """Keys the router routed, counted as cached on their engine until they expire.

    A :class:`KeyTree` (whole keys, reference-counted), the live entries and a queue of
    expiries; bounded by ``max_entries`` (the earliest-expiring go first). An entry's expiry
    can be brought forward (:meth:`settle`: its request ended, so the engine's own KV events
    take over); the queue then holds a superseded record, skipped when it comes up."""

    def __init__(self, max_entries: int) -> None:
        self.tree = KeyTree()
        self._queue = _ExpiryQueue()  # (expiry, handle), superseded ones included
        # handle -> (expiry, engine, key, the node the key ends at)
        self._live: dict[int, tuple[float, str, bytes, KeyNode | None]] = {}
        self._stale = 0  # superseded records in the queue
        self._seq = 0
        self.max_entries = max_entries

    def __len__(self) -> int:
        return len(self._live)

    def add(self, engine: str, key: bytes, ttl: float, now: float) -> int:
        """Count ``key`` as cached on ``engine`` for ``ttl`` seconds; returns the entry's handle
        (0: nothing added)."""
        if not key:
            return 0
        end = self.tree.add(engine, key)
        self._seq += 1
        expires = now + ttl
        self._live[self._seq] = (expires, engine, key, end)
        self._queue.push(expires, self._seq, ttl)
        while len(self._live) > self.max_entries:
            self._pop()
        return self._seq

    def settle(self, handle: int, grace: float, now: float) -> None:
        """Bring entry ``handle``'s expiry forward to ``now + grace`` (never later)."""
        entry = self._live.get(handle)
        expires = now + grace
        if entry is None or expires >= entry[0]:
            return
        self._live[handle] = (expires, entry[1], entry[2], entry[3])
        self._queue.push(expires, handle, grace)
        self._stale += 1  # the record with the old expiry
        if self._stale > 1024 and self._stale > 2 * len(self._live):  # amortised O(1)
            self._queue.keep(self._current)
            self._stale = 0

    def _current(self, expires: float, handle: int) -> bool:
        entry = self._live.get(handle)
        return entry is not None and entry[0] == expires

    def _pop(self, now: float = math.inf) -> bool:
        """Remove the queue's first record if it expires by ``now`` (False: none does); drop
        its entry if the record is the current one."""
        record = self._queue.pop_due(now)
        if record is None:
            return False
        expires, handle = record
        entry = self._live.get(handle)
        if entry is not None and entry[0] == expires:
            del self._live[handle]
            self.tree.drop(entry[1], entry[2], entry[3])
        elif self._stale:
            self._stale -= 1
        return True

    def expire(self, now: float) -> None:
        while self._pop(now):
            pass

    def clear_engine(self, engine: str) -> None:
        for handle in [h for h, entry in self._live.items() if entry[1] == engine]:
            _, _, key, end = self._live.pop(handle)
            self.tree.drop(engine, key, end)
        self._queue.keep(self._current)
        self._stale = 0


class Cluster:
    """Everything the router knows; see the module docstring."""

    def __init__(self, config: ClusterConfig | None = None, *, load_mode: str = "window") -> None:
        """``load_mode``: which L the engines are ordered and viewed by (``EngineView.load_ms``):
        ``window`` (Preble's 3-minute history) or ``outstanding`` (in-flight work only);
        ``EngineView.window_ms`` is always the windowed one (rebalancing moves window work)."""
        if load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode must be one of {LOAD_MODES}, not {load_mode!r}")
        self.config = config or ClusterConfig()
        self.load_mode = load_mode
        self._load_of = _Engine.window_ms if load_mode == "window" else _Engine.outstanding_ms
        c = self.config
        self.tree = RadixTree(budget_bytes=c.tree_budget_bytes, idle_ttl_s=c.window_s)
        self.tree.hit_tau_s = c.window_s
        self.spec = Speculative(c.speculative_max_entries)
        self.engines: dict[str, _Engine] = {}
        self._inflight: dict[str, _Inflight] = {}  # insertion order = routing order
        self._load: deque[list] = deque()  # [t, engine, group, prefill_ms, out_tokens]
        self._ttfts: dict[int, deque] = {}  # group -> (t, ttft_ms)
        self._ttft_order: deque[tuple[float, int]] = deque()
        self._hits: deque[tuple[float, str, int, int]] = deque()  # (t, engine, matched, key len)
        self._next_sweep = 0.0
        # model -> (eligible engines, valid until, membership version, their cost profiles)
        self._eligible: dict[str, tuple[dict[str, _Engine], float, int, tuple]] = {}
        self._membership = 0  # bumped whenever the eligible sets may change
        # model -> (its eligible set, those engines, their views): candidates() patches the
        # few views that changed instead of re-reading every engine from the set
        self._candidate_views: dict[str, tuple[dict[str, _Engine], list[_Engine], list]] = {}
        # every engine by (L_i, seq), kept sorted: explore and rebalancing read the few least
        # (or most) loaded engines instead of scoring all; re-keyed lazily (_load_dirty)
        self._by_load = _LoadOrder()
        # the same by the windowed L (rebalancing); the same order when that is L
        self._by_window = self._by_load if load_mode == "window" else _LoadOrder()
        self._load_dirty: dict[str, _Engine] = {}
        # model -> (eligible set, exclude, the engine with the fewest routed, its count)
        self._min_routed: dict[str, tuple[dict, frozenset[str], _Engine, int]] = {}
        self._overrides: dict[int, tuple[str, float]] = {}
        self._replicas: dict[int, tuple[frozenset[str], float]] = {}
        self.events: dict[str, int] = {}
        self.unknown_profiles = 0
        self.moves = 0
        self.replications = 0
        self.released_by: dict[str, int] = {"event": 0, "report": 0, "timeout": 0}
        self.kv = KvLink(c.kv_bytes_per_token, c.kv_link_gbps)
        self.roled = 0  # engines whose role is not "both": 0 is a colocated fleet
        # model -> (its eligible set, decode-only ids, prefill-only ids among it)
        self._role_split: dict[str, tuple[dict[str, _Engine], frozenset[str], frozenset[str]]] = {}

    # ------------------------------------------------------------------ engines

    @property
    def inflight_count(self) -> int:
        """Requests routed and not yet finished, rejected or timed out."""
        return len(self._inflight)

    def _engine(self, engine_id: str) -> _Engine:
        eng = self.engines.get(engine_id)
        if eng is None:
            eng = _Engine(engine_id, self._profile(self.config.default_profile))
            eng.tpot_ms = self.config.tpot_seed_ms
            eng.seq = len(self.engines)
            self.engines[engine_id] = eng
            self._load_dirty[engine_id] = eng
        return eng

    def _profile(self, name: str) -> CostProfile:
        try:
            return load_profile(name)
        except ProfileError:
            self.unknown_profiles += 1
            return default_profile()

    def add_static_engine(
        self, engine_id: str, url: str, models: Iterable[str], profile: str, role: str = "both"
    ) -> None:
        eng = self._engine(engine_id)
        self._set_role(eng, role)
        eng.static = True
        eng.url = url
        eng.models = tuple(models)
        eng.profile = self._profile(profile)
        eng.view = None
        self._membership += 1  # (also: the eligible set's profiles are cached with it)

    def _set_role(self, eng: _Engine, role: str) -> None:
        if role == eng.role:
            return
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        self.roled += (role != "both") - (eng.role != "both")
        eng.role = role
        eng.view = None
        self._membership += 1

    def role_split(self, model: str, now: float) -> tuple[frozenset[str], frozenset[str]]:
        """The eligible engines that only decode and those that only prefill (cached with the
        eligible set)."""
        eligible = self.eligible(model, now)
        kept = self._role_split.get(model)
        if kept is None or kept[0] is not eligible:
            decode = frozenset(e for e, eng in eligible.items() if eng.role == "decode")
            prefill = frozenset(e for e, eng in eligible.items() if eng.role == "prefill")
            kept = self._role_split[model] = (eligible, decode, prefill)
        return kept[1], kept[2]

    def set_draining(self, engine_id: str, draining: bool) -> None:
        eng = self._engine(engine_id)
        eng.draining = draining
        eng.view = None
        self._membership += 1

    def reset_engine(self, engine_id: str, now: float) -> None:
        """Forget what ``engine_id`` caches (its events will rebuild it)."""
        self.tree.clear_engine(engine_id)
        self.spec.clear_engine(engine_id)
        eng = self.engines.get(engine_id)
        if eng is not None:
            eng.view = None

    def infos(self, now: float) -> list[EngineInfo]:
        ttl = self.config.heartbeat_ttl_s
        return [
            EngineInfo(
                engine_id=e.engine_id,
                url=e.url,
                models=e.models,
                alive=e.alive(now, ttl),
                draining=e.draining,
                profile=e.profile.name,
                static=e.static,
                role=e.role,
            )
            for e in sorted(self.engines.values(), key=lambda e: e.engine_id)
            if e.url
        ]

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
        if isinstance(ev, BlockStored):
            eng.reports_kv = True
            self.tree.apply_stored(env.engine_id, ev.parent_hash, ev.hashes, ev.blocks, now)
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
                self._membership += 1  # the eligible sets cache their profiles
            if now - eng.last_heartbeat > self.config.heartbeat_ttl_s:
                self._membership += 1  # (re)joins the eligible sets
            if ev.role != eng.role:
                self._set_role(eng, ev.role)
            eng.heartbeat = ev
            eng.last_heartbeat = now
            own = eng.enqueued_tokens if eng.reports_requests else eng.open_prefill_tokens
            eng.foreign_prefill_tokens = max(ev.queued_prefill_tokens - own, 0)
            if ev.decode_step_ms is not None and ev.decode_batch and self.config.fit_speed:
                predicted = eng.profile.decode_step_ms(ev.decode_batch, ev.decode_context or 0.0)
                eng.speed.observe_decode(predicted, ev.decode_step_ms)
            if (not eng.static or not eng.url) and (eng.url, eng.models) != (ev.url, ev.models):
                eng.url = ev.url
                eng.models = ev.models
                self._membership += 1
            eng.view = None
        elif isinstance(ev, RequestEnqueued):
            eng.reports_requests = True
            self._not_pending(ev.request_id)
            rec = self._inflight.get(ev.request_id)
            if rec is not None and rec.engine_id == eng.engine_id and not rec.engine_tokens:
                # the engine's own count of its prefill (it may not see a prefix the router
                # credits yet): what its heartbeats' queue holds of this request
                cached = ev.cached_bytes * ev.input_tokens // ev.key_bytes if ev.key_bytes else 0
                rec.engine_tokens = max(ev.input_tokens - cached, 1)
                eng.enqueued_tokens += rec.engine_tokens
        elif isinstance(ev, (RequestStarted, RequestPreempted)):
            eng.reports_requests = True
            self._not_pending(ev.request_id)
        elif isinstance(ev, FirstToken):
            eng.reports_requests = True
            self._not_pending(ev.request_id)
            rec = self._inflight.get(ev.request_id)
            self._fit_prefill(eng, ev, rec)
            if ev.kv_transfer_ms is not None and ev.kv_transfer_tokens and self.config.fit_speed:
                self.kv.observe(ev.kv_transfer_tokens, ev.kv_transfer_ms)
            if rec is not None and not rec.first_token:
                rec.first_token = True
                rec.first_at = now
                self._prefill_done(rec, ev.request_id)
                self._record_ttft(rec.group, ev.ttft_ms, now)
                if rec.engine_id == eng.engine_id:
                    self._start_decoding(eng, ev.request_id, rec)
        elif isinstance(ev, RequestFinished):
            rec = self._inflight.get(ev.request_id)
            if rec is not None and not rec.first_token:
                self._record_ttft(rec.group, ev.ttft_ms, now)
            if ev.output_tokens > 1:
                self._record_tpot(eng, ev.tpot_ms)
            self.release(ev.request_id, "event", now)
        elif isinstance(ev, RequestRejected):
            self.release(ev.request_id, "event", now)

    def _not_pending(self, request_id: str) -> None:
        rec = self._inflight.get(request_id)
        if rec is not None and rec.pending:
            rec.pending = False
            eng = self.engines.get(rec.engine_id)
            if eng is not None:
                eng.pending_prefill_tokens -= rec.missed_tokens
                eng.view = None

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
        if not self.config.fit_speed:
            return
        if ev.prefill_ms is not None and ev.prefill_tokens:
            predicted = eng.profile.prefill_ms(ev.prefill_tokens, ev.context_tokens or 0)
            eng.speed.observe_prefill(predicted, ev.prefill_ms)
        elif rec is not None and rec.idle_prefill_ms > 0 and not rec.first_token:
            eng.speed.observe_prefill(rec.idle_prefill_ms, ev.ttft_ms, weight=0.5)
        else:
            return
        eng.view = None
        self._load_dirty[eng.engine_id] = eng

    def _start_decoding(self, eng: _Engine, request_id: str, rec: _Inflight) -> None:
        eng.decoding[request_id] = rec
        eng.decode_ctx += rec.ctx_tokens
        t = rec.tpot_slo_ms
        eng.decode_tpots[t] = eng.decode_tpots.get(t, 0) + 1

    def _stop_decoding(self, eng: _Engine, request_id: str, rec: _Inflight) -> None:
        if eng.decoding.pop(request_id, None) is None:
            return
        eng.decode_ctx = eng.decode_ctx - rec.ctx_tokens if eng.decoding else 0.0
        t = rec.tpot_slo_ms
        left = eng.decode_tpots.get(t, 0) - 1
        if left > 0:
            eng.decode_tpots[t] = left
        else:
            eng.decode_tpots.pop(t, None)

    def _record_tpot(self, eng: _Engine, tpot_ms: float) -> None:
        eng.tpots.append(tpot_ms)
        if len(eng.tpots) > self.config.tpot_samples:
            eng.tpots.popleft()
        eng.tpot_ms = median(eng.tpots)
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
        return block_hash(None, key[: self.config.group_bytes])

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
        tokens = max(req.input_tokens, p.tokens_for_bytes(key_len))
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
        prefill = p.prefill_ms(missed, cached) + (p.prefill_ms(cached) / holders if cached else 0)
        prefill *= eng.speed.prefill
        entry = [now, engine_id, group, prefill, req.max_tokens]
        self._load.append(entry)
        eng.load_prefill_ms += prefill
        eng.load_out_tokens += req.max_tokens
        self._load_dirty[engine_id] = eng
        g = eng.groups.get(group)
        if g is None:
            g = eng.groups[group] = _GroupWork()
        g.prefill_ms += prefill
        g.out_tokens += req.max_tokens
        g.requests += 1
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
            idle_prefill_ms=p.prefill_ms(missed, cached) if idle else 0.0,
        )
        own_s = p.prefill_ms(missed, cached) * eng.speed.prefill / 1e3
        # an engine that sends no request events (a plain vLLM behind the bridge) never says
        # when a prefill ends: assume it ends when the work queued there would be done
        done = math.inf
        if not eng.reports_requests:
            done = now + p.prefill_ms(eng.open_prefill_tokens + missed) * eng.speed.prefill / 1e3
        eng.open_prefill[req.request_id] = (deadline, missed, own_s, done)
        eng.open_prefill_tokens += missed
        eng.inflight += 1
        eng.open_prefill_ms += prefill
        eng.open_out_tokens += req.max_tokens
        eng.open_ctx_tokens += ctx_tokens
        eng.pending_prefill_tokens += missed
        eng.routed_total += 1
        decay = math.exp(-(now - eng.rate_t) / RATE_TAU_S)
        eng.rate = eng.rate * decay + 1.0 / RATE_TAU_S  # (exponentially weighted rates)
        eng.prefill_rate = eng.prefill_rate * decay + own_s * 1e3 / RATE_TAU_S
        eng.rate_t = now
        eng.view = None
        ttl = c.approximate_ttl_s if c.approximate or not eng.reports_kv else c.speculative_ttl_s
        rec.spec = self.spec.add(engine_id, req.key, ttl, now)
        # a request that wanted the prefix counts in its hit count wherever it was served
        # (Preble's M prices an eviction by the requests that want what it evicts)
        self.tree.touch(match, engine_id, max(mine, match.depth), now)

    def _note_group(self, eng: _Engine, group: int, work: _GroupWork) -> None:
        """``work`` (group ``group`` of ``eng``) just grew: it leads if it now outweighs the
        heaviest (only a lighter or a removed leader, or a new TPOT, loses the answer)."""
        if not eng.top_known:
            return
        top = eng.top_work
        if top is not None and top is not work:
            load = work.load_ms(eng.tpot_ms)
            lead = top.load_ms(eng.tpot_ms)
            if load < lead or (load == lead and group > eng.top_group):
                return
        eng.top_work = work
        eng.top_group = group

    def heaviest_group(self, eng: _Engine) -> tuple[int, _GroupWork] | None:
        """``eng``'s heaviest group by (windowed load, lower id), from what was kept or, when
        that was lost, by one typed scan (which keeps it again)."""
        if not eng.top_known:
            tpot = eng.tpot_ms
            best: _GroupWork | None = None
            best_group = 0
            best_load = 0.0
            for g, w in eng.groups.items():
                load = w.load_ms(tpot)
                if best is None or load > best_load or (load == best_load and g < best_group):
                    best, best_group, best_load = w, g, load
            eng.top_work, eng.top_group, eng.top_known = best, best_group, True
        top = eng.top_work
        return None if top is None else (eng.top_group, top)

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
            eng = self.engines.get(engine_id)
            if eng is None:
                continue
            eng.load_prefill_ms -= prefill
            eng.load_out_tokens -= out
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

    # ------------------------------------------------------------------ views

    def engine_view(self, eng: _Engine) -> EngineView:
        v = eng.view
        if v is None:
            p = eng.profile
            hb = eng.heartbeat
            capacity = (hb.kv_blocks_total if hb else p.kv_blocks) * p.block_bytes
            used = hb.kv_blocks_used * p.block_bytes if hb else 0
            held = self.tree.held_bytes.get(eng.engine_id, 0)
            v = eng.view = EngineView(
                engine_id=eng.engine_id,
                url=eng.url,
                profile=p,
                inflight=eng.inflight,
                load_ms=self._load_of(eng),
                window_ms=eng.window_ms(),
                tpot_ms=eng.tpot_ms,
                hit_ratio=eng.hit_matched / eng.hit_total if eng.hit_total else 0.0,
                free_bytes=max(capacity - max(held, used), 0),
                pending_prefill_tokens=max(eng.pending_prefill_tokens, 0),
                routed_total=eng.routed_total,
                rate_per_s=eng.rate,
                prefill_rate=eng.prefill_rate,
                rate_t=eng.rate_t,
                heartbeat=hb,
                queued_prefill_ms=p.prefill_ms(
                    max(eng.open_prefill_tokens, 0) + eng.foreign_prefill_tokens
                )
                * eng.speed.prefill,
                next_decode_step_ms=next_decode_step_ms(
                    p, hb, eng.open_ctx_tokens, max(eng.inflight, 0)
                ),
                open_ctx_tokens=max(eng.open_ctx_tokens, 0.0),
                position=eng.seq,
                prefill_scale=eng.speed.prefill,
                decode_scale=eng.speed.decode,
                decoding=len(eng.decoding),
                decode_ctx_tokens=max(eng.decode_ctx, 0.0),
                decode_tpot_min_ms=min(eng.decode_tpots) if eng.decode_tpots else math.inf,
                role=eng.role,
            )
        return v

    def candidates(self, req: RouteRequest, now: float) -> list[EngineView]:
        """Engines that may take ``req``: alive, serving its model, not draining or excluded.

        The eligible set per model is cached until an engine joins, leaves, drains or could
        reach its heartbeat TTL (the earliest such moment), so a decision costs one cheap pass."""
        eligible = self.eligible(req.model, now)
        if req.exclude:
            return [
                e.view or self.engine_view(e)
                for e in eligible.values()
                if e.engine_id not in req.exclude
            ]
        kept = self._candidate_views.get(req.model)
        if kept is None or kept[0] is not eligible:  # the eligible set changed: start over
            engines = list(eligible.values())
            views = [e.view or self.engine_view(e) for e in engines]
            self._candidate_views[req.model] = (eligible, engines, views)
            return views.copy()
        _, engines, views = kept
        for i in range(len(engines)):  # typed: re-read only the views that changed
            v = engines[i].view
            if v is None:
                views[i] = self.engine_view(engines[i])
            elif v is not views[i]:
                views[i] = v
        return views.copy()  # (a decision keeps its list: a snapshot, never patched later)

    def eligible(self, model: str, now: float) -> dict[str, _Engine]:
        """Engines alive, serving ``model`` and not draining (cached, see :meth:`candidates`)."""
        return self._eligible_entry(model, now)[0]

    def eligible_profiles(self, model: str, now: float) -> tuple[CostProfile, ...]:
        """The distinct cost profiles of :meth:`eligible` (cached with it)."""
        return self._eligible_entry(model, now)[3]

    def _eligible_entry(
        self, model: str, now: float
    ) -> tuple[dict[str, _Engine], float, int, tuple[CostProfile, ...]]:
        entry = self._eligible.get(model)
        if entry is None or now > entry[1] or entry[2] != self._membership:
            ttl = self.config.heartbeat_ttl_s
            out = {}
            profiles: dict[str, CostProfile] = {}
            until = float("inf")
            for eng in self.engines.values():
                if eng.url and not eng.draining and eng.alive(now, ttl) and eng.serves(model):
                    out[eng.engine_id] = eng
                    profiles.setdefault(eng.profile.name, eng.profile)
                    if not eng.static:
                        until = min(until, eng.last_heartbeat + ttl)
            entry = (out, until, self._membership, tuple(profiles.values()))
            self._eligible[model] = entry
        return entry

    def _sync_loads(self) -> None:
        """Re-key the engines whose L changed since the last decision in ``_by_load`` (and
        ``_by_window``)."""
        dirty = self._load_dirty
        if not dirty:
            return
        by_load = self._by_load
        by_window = self._by_window
        load_of = self._load_of
        for eng in dirty.values():
            load = load_of(eng)
            key = eng.load_key
            if key is None or load != key:  # (a request routed and released: often equal)
                if key is not None:
                    by_load.remove(key, eng.seq, eng.engine_id)
                eng.load_key = load
                by_load.insert(load, eng.seq, eng.engine_id)
            if by_window is not by_load:
                load = eng.window_ms()
                key = eng.window_key
                if key is None or load != key:
                    if key is not None:
                        by_window.remove(key, eng.seq, eng.engine_id)
                    eng.window_key = load
                    by_window.insert(load, eng.seq, eng.engine_id)
        dirty.clear()


class _LoadOrder:
    """Engine ids sorted by ``(load, seq)`` (``seq``: registration order, unique), in three
    parallel lists searched by a typed binary search: a plain list with memmove inserts beats a
    tree at cluster sizes, and comparing two floats and two ints beats ``bisect`` over
    ``(load, seq, id)`` tuples (generic tuple comparisons), measured ~3 us a decision at 64
    engines."""

    __slots__ = ("ids", "loads", "seqs")

    def __init__(self) -> None:
        self.loads: list[float] = []
        self.seqs: list[int] = []
        self.ids: list[str] = []  # the order

    def _position(self, load: float, seq: int) -> int:
        """Index of the first entry not below ``(load, seq)`` (as ``bisect_left``)."""
        if load != load:  # NaN (a broken cost profile): filed last, as +inf, so it orders
            load = math.inf
        loads, seqs = self.loads, self.seqs
        lo, hi = 0, len(loads)
        while lo < hi:
            mid = (lo + hi) >> 1
            x = loads[mid]
            if x < load or (x == load and seqs[mid] < seq):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def insert(self, load: float, seq: int, engine_id: str) -> None:
        i = self._position(load, seq)
        self.loads.insert(i, load if load == load else math.inf)
        self.seqs.insert(i, seq)
        self.ids.insert(i, engine_id)

    def remove(self, load: float, seq: int, engine_id: str) -> None:
        """Remove ``engine_id``'s entry, filed under ``(load, seq)``."""
        i = self._position(load, seq)
        if i >= len(self.ids) or self.ids[i] != engine_id:  # (never: a lookup by id, then)
            i = self.ids.index(engine_id)
        del self.loads[i]
        del self.seqs[i]
        del self.ids[i]


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
        cluster: Cluster,
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

    def by_load(self) -> Iterator[EngineView]:
        """Candidates by ``(load_ms, position)``, ascending (``position`` is the registration
        order, the order of :attr:`engines`). Lazy: reading the first few costs a few steps, not
        a pass over every engine (the most loaded: :meth:`load_extremes`)."""
        cl = self._cluster
        cl._sync_loads()
        eligible = self._eligible
        exclude = self._exclude
        view = cl.engine_view
        for engine_id in cl._by_load.ids:
            eng = eligible.get(engine_id)
            if eng is not None and engine_id not in exclude:
                yield eng.view or view(eng)

    def load_extremes(self, window: bool = False) -> tuple[EngineView, EngineView] | None:
        """The least and the most loaded candidates by ``load_ms`` (``window``: ``window_ms``),
        equal loads resolved to the lowest position for both (as ``min``/``max`` over
        :attr:`engines`); None without candidates. Direct index walks from both ends of the
        sorted order: rebalancing asks after every decision, and two generators (one over a
        ``reversed`` list) cost more than the answer."""
        cl = self._cluster
        cl._sync_loads()
        order = cl._by_window if window else cl._by_load
        ids = order.ids
        loads = order.loads
        eligible = self._eligible
        exclude = self._exclude
        n = len(ids)
        i = 0
        least: _Engine | None = None
        while i < n:
            least = eligible.get(ids[i])
            if least is not None and (not exclude or ids[i] not in exclude):
                break
            least = None
            i += 1
        if least is None:
            return None
        j = n - 1
        busiest = least
        while j > i:
            eng = eligible.get(ids[j])
            if eng is not None and (not exclude or ids[j] not in exclude):
                busiest = eng
                break
            j -= 1
        top = loads[j]
        k = j - 1
        while k >= i and loads[k] == top:  # equal loads sort by position: the first of them
            eng = eligible.get(ids[k])
            if eng is not None and (not exclude or ids[k] not in exclude):
                busiest = eng
            k -= 1
        return (
            least.view or cl.engine_view(least),
            busiest.view or cl.engine_view(busiest),
        )

    def min_routed(self) -> int:
        """The fewest requests ever routed to one candidate (E2's warm-up). Counts only grow,
        so the minimum is cached per eligible set and recomputed only when its holder moved."""
        cl = self._cluster
        cached = cl._min_routed.get(self._model)
        if (
            cached is not None
            and cached[0] is self._eligible
            and cached[1] == self._exclude
            and cached[2].routed_total == cached[3]
        ):
            return cached[3]
        low: _Engine | None = None
        exclude = self._exclude
        for eng in self._eligible.values():
            if eng.engine_id not in exclude and (
                low is None or eng.routed_total < low.routed_total
            ):
                low = eng
        if low is None:
            return 0
        cl._min_routed[self._model] = (self._eligible, exclude, low, low.routed_total)
        return low.routed_total

    def profiles(self) -> tuple[CostProfile, ...]:
        """The distinct cost profiles among the candidates (or a superset)."""
        return self._cluster.eligible_profiles(self._model, self._now)

    def kv_transfer_ms(self, tokens: float) -> float:
        return self._cluster.kv.transfer_ms(tokens)

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

    def prefill_queue(self, ev: EngineView, deadline: float) -> tuple[float, int]:
        """:meth:`prefill_ahead_ms`, and how many of the router's requests queued there are
        due later (a request due at ``deadline`` would delay them by its own prefill)."""
        eng = self._cluster.engines.get(ev.engine_id)
        if eng is None:
            return ev.queued_prefill_ms, 0
        now = self._now
        scale = ev.prefill_scale
        ahead = eng.foreign_prefill_tokens
        behind = 0
        for due, tokens, prefill_s, done in eng.open_prefill.values():
            if done <= now:
                continue  # (an engine without request events: presumably prefilled by now)
            if due <= deadline:
                if due - now >= prefill_s:
                    ahead += tokens
            else:
                behind += 1
        return (ev.profile.prefill_ms(ahead) * scale if ahead > 0 else 0.0), behind

    def decode_release_ms(self, ev: EngineView, now: float, count: int = 1) -> float:
        """How long until ``count`` of the router's requests decoding on ``ev`` have finished
        (freeing room in SCORPIO's VBS admission): each one's remaining output tokens at the
        engine's measured TPOT, the ``count``-th soonest; beyond the requests decoding now,
        each further one takes a mean decode time divided by the batch (0: none decodes)."""
        eng = self._cluster.engines.get(ev.engine_id)
        if eng is None or not eng.decoding or count <= 0:
            return 0.0
        tpot = eng.tpot_ms
        left = sorted(
            max(rec.out_tokens * tpot - (now - rec.first_at) * 1000.0, tpot)
            for rec in eng.decoding.values()
        )
        if count <= len(left):
            return left[count - 1]
        n = len(left)
        mean_ms = sum(rec.out_tokens for rec in eng.decoding.values()) * tpot / n
        return left[-1] + (count - n) * mean_ms / n

    def eviction_ms(self, engine_id: str, need_bytes: int, now: float, max_scan: int = 64) -> float:
        """Preble's M_i: walk the engine's LRU (its likely eviction order) until ``need_bytes``
        are freed; each evicted prefix costs ``hit count (decayed over the window) x miss rate x
        prefill time of its tokens``, the miss rate being ``1 / holders`` (a prefix other
        engines also hold is cheaper to lose here). Beyond ``max_scan`` nodes the cost of the
        scanned part is extrapolated."""
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
                cost += hits / max(holders, 1) * p.prefill_ms(tokens, context) * speed
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
            if w.requests < min_requests or w.requests <= 0:
                return False
            o = overrides.get(g) if overrides else None
            return o is None or o[0] == engine_id

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
        yield GroupLoad(best, best_load, eng.groups[best].requests)
        # the rest, if read: two C sorts of indices (ints, then floats: CPython compares them
        # without generic rich comparisons), group id ascending, then stably by load descending
        groups: list[int] = []
        loads: list[float] = []
        requests: list[int] = []
        for g, w in eng.groups.items():
            if g != best and listed(g, w):
                groups.append(g)
                loads.append(w.load_ms(tpot))
                requests.append(w.requests)
        order = sorted(range(len(groups)), key=groups.__getitem__)
        order.sort(key=loads.__getitem__, reverse=True)
        for i in order:
            yield GroupLoad(groups[i], loads[i], requests[i])

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
