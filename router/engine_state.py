"""The cluster's per-engine and per-request records (cluster-internal: policies get
:class:`router.policies.base.EngineView` snapshots), kept apart from the code that folds events
and decisions into them (:mod:`router.cluster`) and the code that reads them
(:mod:`router.cluster_state`, :mod:`router.view`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from broker.events import LoadHeartbeat
from kvgate.cost_model import CostProfile, SpeedFit, TtftFit
from router.policies.base import EngineView


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
    # key bytes counted as cached there when it was routed (the router's entries included):
    # it prefills the rest of its key, unless another request computes it first
    matched_bytes: int = 0
    # its prompt's tokens in those whole blocks: while it decodes, KV memory it shares with the
    # requests of its prefix group decoding there (the engine pins a cached block once)
    cached_tokens: int = 0
    # on an engine whose prefill speed only the gateway's TTFTs show (Cluster._fit_ttft): the
    # TTFT the router predicted there, the log of the prefill factor that prediction used, and
    # the sample's weight (its own prefill's share of the prefill it waited for)
    ttft_pred_ms: float = 0.0
    ttft_factor_log: float = 0.0
    ttft_weight: float = 0.0
    # it holds KV memory on its engine (counted in ``_Engine.held_kv``): from the start
    # of its prefill (the engine's RequestStarted: it reserves the request's memory then), or
    # from its first token where the engine does not say when it starts
    holds_memory: bool = False

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
        matched_bytes: int = 0,
        cached_tokens: int = 0,
        ttft_pred_ms: float = 0.0,
        ttft_factor_log: float = 0.0,
        ttft_weight: float = 0.0,
        holds_memory: bool = False,
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
        self.matched_bytes = matched_bytes
        self.cached_tokens = cached_tokens
        self.ttft_pred_ms = ttft_pred_ms
        self.ttft_factor_log = ttft_factor_log
        self.ttft_weight = ttft_weight
        self.holds_memory = holds_memory


class _GroupWork:
    """One prefix group's work on one engine in the window: what rebalancing weighs and moves
    (typed fields, not a list: the rebalancing check reads them after most decisions)."""

    __slots__ = (
        "entries",
        "key_bytes",
        "out_tokens",
        "prefill_ms",
        "requests",
    )

    def __init__(self) -> None:
        self.prefill_ms = 0.0
        self.out_tokens = 0
        self.requests = 0
        self.key_bytes = 0  # its longest key routed: the cache it takes where it lives
        self.entries: deque[list] = deque()  # its entries of ClusterState._load, oldest first

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
    load_requests: int = 0  # the requests in the windowed load (moves included)
    open_prefill_ms: float = 0.0  # prefill of in-flight requests without a first token yet
    open_out_tokens: int = 0  # output tokens of in-flight requests
    open_ctx_tokens: float = 0.0  # sum of in-flight requests' ctx_tokens
    # in-flight requests without a first token: request id -> (deadline, missed tokens, their
    # prefill time at the engine's speed in s, when it presumably ended: read only while the
    # engine has sent no request event (routed before its first one: a guess; after: inf))
    open_prefill: dict[str, tuple[float, int, float, float]] = field(default_factory=dict)
    reports_requests: bool = False  # it sends request events (enqueued, first token, ...)
    reports_prefill_steps: bool = False  # its heartbeats time its prefill work (speed fit)
    open_prefill_tokens: int = 0  # their sum of missed tokens
    groups: dict[int, _GroupWork] = field(default_factory=dict)
    tpots: deque = field(default_factory=deque)  # (when, TPOT ms) of its recent samples
    tpot_ms: float = 150.0
    hit_matched: int = 0
    hit_total: int = 0
    view: EngineView | None = None
    seq: int = 0  # registration order: the order of the eligible sets (ties break on it)
    # the heaviest group in ``groups`` by (load, lower id), kept as work is added (see
    # ClusterState._note_group); None with top_known: no group; not top_known: find it by a scan
    top_work: _GroupWork | None = None
    top_group: int = 0
    top_known: bool = True
    load_key: float | None = None  # the L it is filed under in ClusterState._by_load
    window_key: float | None = None  # ... in ClusterState._by_window
    speed: SpeedFit = field(default_factory=SpeedFit)  # its fitted prefill/decode speed
    # the gateway's TTFTs of its answers against the router's predictions (engines that report
    # no prefill timings: the fleet-relative prefill fit, Cluster._fit_ttft)
    ttft_fit: TtftFit = field(default_factory=TtftFit)
    # behind the bridge: its steps (inter-token latencies) against the profile's, the same way
    step_fit: TtftFit = field(default_factory=TtftFit)
    # the router's requests decoding there (past their first token): what the engine's decode
    # step runs, so what prefill's share of the GPU is (router.policies.feasibility)
    decoding: dict[str, _Inflight] = field(default_factory=dict)
    decode_ctx: float = 0.0  # their summed context
    # the KV memory the router's requests hold there, in tokens (those decoding, and those
    # whose prefill has started: ``_Inflight.holds_memory``): each one's context past its
    # cached prefix, plus once per prefix group the longest cached prefix of its holders there
    # (kept until the group's last one ends); group -> [requests, that prefix]
    held_kv: float = 0.0
    held_prefixes: dict[int, list[float]] = field(default_factory=dict)
    kv_holders: int = 0  # how many of them hold it
    # the engine's last reported held memory less the router's count then (tokens)
    held_offset: float = 0.0
    decode_tpots: dict[float, int] = field(default_factory=dict)  # their TPOT SLOs, counted
    # the TPOT SLOs of all its in-flight requests, counted: their virtual batch (SCORPIO's VBS,
    # router.policies.base.virtual_batch) is what the decode step will run
    open_tpots: dict[float, int] = field(default_factory=dict)
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
    # ... and that prefill over each one's TTFT SLO (ms / ms) per s: over ``prefill_rate``, the
    # mean 1 / TTFT SLO of the prefill work routed there, weighted by that work
    prefill_slo_rate: float = 0.0
    rate_t: float = 0.0
    role: str = "both"  # prefill, decode or both (its heartbeat's, or configured)
    # key bytes and blocks of the blocks it announced (its block size in the key's bytes)
    stored_key_bytes: int = 0
    stored_blocks: int = 0

    def block_bytes(self) -> float:
        """Key bytes one of its KV blocks holds: as its block events show, else its profile's
        (a profile's bytes a token guess the tokenizer; the key's vary with it and with the
        text: the vLLM routing benchmark's documents take 2.17 bytes a token, the tiny
        profile says 2, and the engines' caches read 8% short)."""
        if self.stored_blocks:
            return self.stored_key_bytes / self.stored_blocks
        return float(self.profile.block_bytes)

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
