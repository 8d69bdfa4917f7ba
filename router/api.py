"""What a gateway asks the router and what it gets back; shared by the embedded and remote router.

Pure data: no I/O here. ``router.service`` serves these over HTTP; ``router.client`` speaks to it;
``router.core.Router`` answers them in-process. Fields may be added (with defaults); none renamed.

The per-decision values (:class:`RouteRequest`, :class:`Candidate`, :class:`Decision`, and the
policies' ``EngineView``/``RequestContext``/``GroupLoad``/``Move``, the tree's ``Match``) are
slotted dataclasses that are *not* ``frozen``, though nothing ever assigns to them (values, not
state), and that spell out their ``__init__``: under mypyc (:mod:`kvgate.native`) the
``__init__`` that ``dataclasses`` generates stays interpreted (~0.25 us per object; a frozen
one's, which sets every field through ``object.__setattr__``, 1 to 2 us), while a written one is
compiled (~0.03 us), and a decision builds 10 to 25 of them. ``dataclasses`` keeps a class's own
``__init__``; the fields stay declared for ``repr``, ``==`` and ``dataclasses.fields``, and
``tests/test_foundation.py`` checks that each written ``__init__`` takes exactly the declared
fields, in order, with the same defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvgate.slo import SLO_CLASSES, Slo

Reason = Literal[
    "exploit",  # E2: most of the key is cached; the least-loaded holder of the longest match
    "explore",  # E2: cheapest by load + eviction + prefill-of-missed cost
    "rebalance",  # E2: moved off an overloaded engine
    "replicate",  # E2: hot prefix copied to the least-busy engine
    "pd_balance",  # E2: prefill-heavy request sent to a decode-heavy engine
    "cache_match",  # cache_aware: best match above the threshold
    "least_load",  # least-loaded engine (baseline, or fallback)
    "round_robin",
    "power_of_two",
    "affinity",  # session affinity (consistent hashing)
    "shed",  # no engine can meet the SLO: the gateway answers 429
    # shed, and no engine serving the model could ever hold it (its prompt and max_tokens
    # beyond each one's KV in all): the gateway answers 400 context_length_exceeded
    "too_long",
    "decode",  # a decode retry of a disaggregated request: only its decode engine was chosen
]

Outcome = Literal["ok", "failed", "cancelled"]


@dataclass(slots=True)  # immutable by convention (module docstring)
class RouteRequest:
    """One request to place. ``key`` is the routing key (kvgate.openai_request)."""

    request_id: str
    model: str
    key: bytes
    input_tokens: int
    max_tokens: int
    slo: Slo = SLO_CLASSES["relaxed"]
    session: str | None = None
    exclude: frozenset[str] = frozenset()  # engines not to pick (failed on a retry, drained)
    # set on a decode retry of a disaggregated request: its prompt's KV waits on this prefill
    # engine, so only a decode engine is chosen (router.pd)
    prefilled_on: str | None = None

    def __init__(
        self,
        request_id: str,
        model: str,
        key: bytes,
        input_tokens: int,
        max_tokens: int,
        slo: Slo = SLO_CLASSES["relaxed"],
        session: str | None = None,
        exclude: frozenset[str] = frozenset(),
        prefilled_on: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.key = key
        self.input_tokens = input_tokens
        self.max_tokens = max_tokens
        self.slo = slo
        self.session = session
        self.exclude = exclude
        self.prefilled_on = prefilled_on


@dataclass(slots=True)  # immutable by convention (module docstring)
class Candidate:
    """How one engine scored for a request; cost terms in ms (Preble's L, M, P)."""

    engine_id: str
    matched_bytes: int
    load_ms: float = 0.0
    eviction_ms: float = 0.0
    prefill_ms: float = 0.0
    feasible: bool = True

    def __init__(
        self,
        engine_id: str,
        matched_bytes: int,
        load_ms: float = 0.0,
        eviction_ms: float = 0.0,
        prefill_ms: float = 0.0,
        feasible: bool = True,
    ) -> None:
        self.engine_id = engine_id
        self.matched_bytes = matched_bytes
        self.load_ms = load_ms
        self.eviction_ms = eviction_ms
        self.prefill_ms = prefill_ms
        self.feasible = feasible

    @property
    def total_ms(self) -> float:
        return self.load_ms + self.eviction_ms + self.prefill_ms


class Listing(Protocol):
    """A decision's candidates, worked out when first read (see :class:`Decision`)."""

    def candidates(self) -> tuple[Candidate, ...]: ...


@dataclass(slots=True)  # immutable by convention (module docstring)
class Decision:
    """Where a request goes, and why. ``engine_id`` is None only when ``reason == "shed"``.

    ``candidates`` (the engines listed with their matched bytes and cost terms) is read from
    ``listing``: the candidates themselves, or a :class:`Listing` that holds the decision-time
    inputs (immutable snapshots) and builds them on first read. Why lazily: only the debug
    header and the remote router's answer read them, and building them (the engines holding
    the most of the key, one Candidate each) was ~20% of a decision's time, measured."""

    engine_id: str | None
    url: str | None
    reason: Reason
    policy: str
    matched_bytes: int = 0
    listing: tuple[Candidate, ...] | Listing = field(default=(), compare=False, repr=False)
    retry_after_s: float | None = None
    detail: str = ""
    fallback: str | None = None  # shed: the engine it would have gone to (for measurement)
    # prefill/decode disaggregation (router.pd): ``engine_id`` prefills and hands the KV to
    # this engine, which decodes; None: ``engine_id`` runs the whole request
    decode_engine_id: str | None = None
    decode_url: str | None = None
    kv_transfer_ms: float = 0.0  # the predicted time to move the prompt's KV there

    def __init__(
        self,
        engine_id: str | None,
        url: str | None,
        reason: Reason,
        policy: str,
        matched_bytes: int = 0,
        listing: tuple[Candidate, ...] | Listing = (),
        retry_after_s: float | None = None,
        detail: str = "",
        fallback: str | None = None,
        decode_engine_id: str | None = None,
        decode_url: str | None = None,
        kv_transfer_ms: float = 0.0,
    ) -> None:
        self.engine_id = engine_id
        self.url = url
        self.reason = reason
        self.policy = policy
        self.matched_bytes = matched_bytes
        self.listing = listing
        self.retry_after_s = retry_after_s
        self.detail = detail
        self.fallback = fallback
        self.decode_engine_id = decode_engine_id
        self.decode_url = decode_url
        self.kv_transfer_ms = kv_transfer_ms

    @property
    def disaggregated(self) -> bool:
        """Two phases: prefill on ``engine_id``, decode on ``decode_engine_id``."""
        return self.decode_engine_id is not None and self.decode_engine_id != self.engine_id

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        listing = self.listing
        if isinstance(listing, tuple):
            return listing
        built = listing.candidates()
        self.listing = built  # (a memo: the same value on every read)
        return built

    @property
    def shed(self) -> bool:
        return self.engine_id is None

    def header_value(self) -> str:
        """Compact form for the ``x-kvgate-route`` response header."""
        parts = [
            f"policy={self.policy}",
            f"reason={self.reason}",
            f"engine={self.engine_id or '-'}",
            f"matched={self.matched_bytes}",
        ]
        if self.disaggregated:
            parts[2:3] = [
                f"prefill={self.engine_id}",
                f"decode={self.decode_engine_id}",
                f"kv_ms={self.kv_transfer_ms:.2f}",
            ]
        best = next((c for c in self.candidates if c.engine_id == self.engine_id), None)
        if best is not None:
            parts.append(
                f"cost_ms={best.total_ms:.2f}(L={best.load_ms:.2f},M={best.eviction_ms:.2f},"
                f"P={best.prefill_ms:.2f})"
            )
        return ";".join(parts)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """An engine as the router knows it (from heartbeats, or from static configuration)."""

    engine_id: str
    url: str
    models: tuple[str, ...]
    alive: bool
    draining: bool = False
    profile: str = "mistral-7b-a6000"
    static: bool = False  # configured by hand, not (only) known from the broker
    role: str = "both"  # prefill, decode or both (broker.events.ROLES)


class RoutingService(Protocol):
    """What the gateway needs from a router, embedded or remote."""

    async def route(self, request: RouteRequest) -> Decision:
        """Pick an engine (or shed) for ``request``, recording it as in flight there."""
        ...

    async def report(
        self,
        request_id: str,
        engine_id: str,
        outcome: Outcome,
        output_tokens: int = 0,
        max_tokens: int = 0,
    ) -> None:
        """Tell the router how a routed request ended from the gateway's side (a failed
        engine frees its in-flight work at once instead of waiting for a timeout), and, when
        known (0: not), its answer's length and the cap its request stated."""
        ...

    async def first_token(self, request_id: str, engine_id: str, ttft_ms: float) -> None:
        """Tell the router when the first token of a streamed answer came, ``ttft_ms`` after
        the request went to ``engine_id`` (for an engine that sends no request events: its
        prefill is done, and an idle engine's TTFT fits its speed)."""
        ...

    async def engines(self) -> list[EngineInfo]:
        """Every engine the router knows, for ``/v1/models``, health checks and admin."""
        ...
