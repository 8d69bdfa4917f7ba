"""The simulated cluster: one real router, N real engine cores, a modeled event link, a clock.

Nothing here models routing or scheduling: the world drives the very objects the live processes
run (``router.core.Router`` and ``engine.core.EngineCore``) on the virtual clock of
:class:`bench.sim.loop.EventLoop`, and only models what sits between them:

* a client request reaches the router ``ingress_s + ingress_s_per_mb x MB of key`` after its
  arrival (``ARRIVAL``; both 0 by default) and is routed at once; a shed decision is a 429;
  latencies count from the arrival; a conversation's turn that resends an earlier turn's
  answer (``Request.after``) is sent only when that answer has ended, its gap in the workload
  later, and the engine caches that answer (``EngineRequest.answer_key``);
* a routed request reaches its engine ``network_delay_s`` later (``SUBMIT``), as the gateway's
  HTTP call would;
* each engine's step ends are ``ENGINE_WAKE`` events at :meth:`EngineCore.next_event_time`
  (re-read after every submit and advance; a stale wake is recognised by its version and ignored);
* engine events travel to the router as :class:`broker.events.Envelope` s with the engine's epoch
  and consecutive sequence numbers, ``link_delay_s`` (plus optional seeded jitter) later, in order
  per engine, one batch per engine step (``DELIVER``), as the reporter's stream entries would;
* every engine sends a load heartbeat each ``heartbeat_s`` (``HEARTBEAT``) through the same link;
  an engine that joins late (``join_at``: a fleet scaled out while traffic runs) sends its first
  when it joins, and the router learns of it only from that heartbeat, as in production;
* when a request finishes (or the engine rejects it) the router gets the gateway's outcome report,
  and at its first token the TTFT the gateway saw (``gateway_ttft``: as of a streamed answer);
* ``request_events`` off, the engines report as a plain vLLM behind the bridge does: KV events
  and heartbeats without prefill timings, no request events (the router then knows a request's
  prefill ended only from the gateway's TTFTs, and how fast the engine prefills only from them
  with ``ClusterConfig.fit_gateway_ttft``; its TPOT and decode steps from the heartbeats, as the
  bridge reads them off vLLM's /metrics);
* a disaggregated decision (``router.pd``) runs as the gateway runs it: the prefill on its
  engine with one output token, then the prompt's KV crosses the link (``TRANSFER``,
  ``kv_ms_per_token`` x prompt tokens after the prefill's token, plus the network delay) into
  the decode engine's prefix cache (``EngineCore.receive_kv``), then the decode request (its
  arrival the client's, so its TTFT deadline is the request's own). The client's first token
  is the decode engine's.
* an engine may go down and come back (``outages``: a crash and a restart, as a fleet's
  deploys, OOMs and lost nodes do): its requests in flight fail (502: their streams break), its
  heartbeats and events stop, and what the router sends it meanwhile is refused when it gets
  there; it comes back cold (an empty cache, a new epoch: the router's tree forgets what it held
  from its first event). The gateway's part is the gateway's own code: its circuit breakers
  (``gateway.pool.EnginePool``: an engine that fails ``failures`` times in a row is excluded
  from routing until a cooldown's trial or a health probe, every ``health_interval_s``, finds
  it back), and a refused request retried on another engine up to ``max_retries`` times;
  without outages nothing of it changes a decision.

So the world doubles as an integration harness of router and engine: every event they exchange
crosses the same contract as in production, with the delays made explicit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from bench.metrics import STATUS_OK, STATUS_SHED, RequestRecord
from bench.sim.loop import EventLoop, Kind
from bench.workloads import Request
from broker.events import AllCleared, BlockRemoved, BlockStored, Envelope, Event, LoadHeartbeat
from gateway.config import BreakerConfig, StaticEngine
from gateway.pool import EnginePool
from kvgate.cost_model import CostProfile
from router.api import Decision, RouteRequest
from router.pd import decode_id


class Rng(Protocol):
    """The part of ``random.Random`` the world uses (injected: pure cores import no random)."""

    def random(self) -> float: ...


class RouterLike(Protocol):
    """The part of ``router.core.Router`` the world drives (the agreed interface)."""

    def route(self, req: RouteRequest, now: float) -> Decision: ...
    def apply(self, env: Envelope, now: float) -> None: ...
    def report(
        self,
        request_id: str,
        engine_id: str,
        outcome: str,
        now: float,
        output_tokens: int = 0,
        max_tokens: int = 0,
    ) -> object: ...
    def first_token(self, request_id: str, engine_id: str, ttft_ms: float, now: float) -> bool: ...


class EngineLike(Protocol):
    """The part of ``engine.core.EngineCore`` the world drives (the agreed interface)."""

    engine_id: str
    busy_s: float  # time spent in steps: the GPU's busy time
    itl_s_total: float  # inter-token latencies of its decoded tokens, summed (s) ...
    itl_tokens: int  # ... and counted, as vLLM's histogram holds them

    def submit(self, req: Any, now: float) -> None: ...
    def cancel(self, request_id: str, now: float) -> None: ...
    def next_event_time(self) -> float | None: ...
    def advance(self, now: float) -> list[Any]: ...
    def drain_events(self) -> list[Event]: ...
    def heartbeat(self, url: str, models: tuple[str, ...]) -> Event: ...
    def receive_kv(self, key: bytes, now: float) -> bool: ...


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """What sits between the parts (seconds)."""

    link_delay_s: float = 0.002  # engine event -> router (reporter flush + XREAD)
    link_jitter_s: float = 0.0  # extra uniform [0, jitter) per batch, order kept per engine
    network_delay_s: float = 0.0005  # gateway -> engine request
    heartbeat_s: float = 1.0
    seed: int = 0
    # client -> router: the body's transfer and parsing before the routing decision; a big
    # prompt is routed later than a small one sent at the same instant, as over HTTP
    ingress_s: float = 0.0
    ingress_s_per_mb: float = 0.0
    # a request the router sheds runs anyway on the engine it would have chosen (the decision's
    # ``fallback``), marked ``shed_run``: measures whether shedding was right (the router does
    # not count it as in flight there, as with another router's request)
    run_shed: bool = False
    # the engines send request events (kvgate's engine does; off: a plain vLLM behind the
    # bridge, see the module docstring)
    request_events: bool = True
    # the gateway tells the router when each answer's first token came (as for a streamed one)
    gateway_ttft: bool = True

    def __post_init__(self) -> None:
        for name in (
            "link_delay_s",
            "link_jitter_s",
            "network_delay_s",
            "ingress_s",
            "ingress_s_per_mb",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not self.heartbeat_s > 0:
            raise ValueError("heartbeat_s must be positive")


STATUS_UPSTREAM = 502  # the engine failed the request (it went down) or none could be reached


@dataclass(frozen=True, slots=True)
class Outage:
    """Engine ``engine`` (its index) goes down at ``down_at`` and comes back cold at ``up_at``
    (virtual s; None: it stays down)."""

    engine: int
    down_at: float
    up_at: float | None = None

    def __post_init__(self) -> None:
        if self.engine < 0 or not self.down_at >= 0:
            raise ValueError("outage: an engine index and a down time >= 0")
        if self.up_at is not None and not self.up_at > self.down_at:
            raise ValueError("outage: the engine must come back after it went down")


@dataclass(slots=True)
class _EngineSlot:
    """The world's bookkeeping for one engine (the core itself is untouched)."""

    index: int
    core: EngineLike
    url: str
    epoch: str
    join_at: float = 0.0  # when it joins the fleet (its first heartbeat), virtual s
    seq: int = 0
    wake_at: float | None = None
    wake_version: int = 0
    last_delivery: float = 0.0
    routed: int = 0
    # its core's inter-token latency counters at its last heartbeat (s, tokens): a bridged
    # engine's heartbeat reports the interval's mean, as the bridge reads the difference of
    # two scrapes of vLLM's vllm:inter_token_latency_seconds
    itl_s_seen: float = 0.0
    itl_tokens_seen: int = 0
    down: bool = False  # its process is gone (an outage)
    restarts: int = 0
    busy_before_s: float = 0.0  # the GPU time of its earlier processes

    @property
    def busy_s(self) -> float:
        """Its GPU's busy time over the run, earlier processes included."""
        return self.busy_before_s + self.core.busy_s


@dataclass(slots=True)
class _Flight:
    """A request between routing and its end."""

    req: Request
    record: RequestRecord
    engine: int
    decode_engine: int | None = None  # disaggregated: where it decodes (None: colocated)
    ereq: Any = None  # ... the engine request, kept for the decode phase
    key: bytes = b""
    prefill_cached: int = 0  # ... its prompt tokens the prefill engine had cached
    sent: float = 0.0  # when the gateway sent it to its engine
    submitted: bool = False  # it reached that engine (else it is on the way)
    tried: frozenset[str] = frozenset()  # engines that refused it (the gateway's retries)


@dataclass(slots=True)
class WorldStats:
    """Counts of what the world did, for the result file and profiling."""

    routed: int = 0
    shed: int = 0
    envelopes: int = 0
    deliveries: int = 0
    heartbeats: int = 0
    wakes: int = 0
    stale_wakes: int = 0
    route_calls: int = 0
    extra: dict = field(default_factory=dict)


class World:
    """Wires one router and N engine cores on one event loop; see the module docstring."""

    def __init__(
        self,
        router: RouterLike,
        engines: Sequence[EngineLike],
        *,
        profile: CostProfile,
        make_engine_request: Callable[[Request, bytes, float], Any],
        rng: Rng,
        link: LinkConfig | None = None,
        models: tuple[str, ...] = ("kvgate-sim",),
        url_prefix: str = "sim://",
        predictions: bool = False,
        kv_ms_per_token: float = 0.0,
        join_at: Sequence[float] | None = None,
        outages: Sequence[Outage] = (),
        restart: Callable[[int], EngineLike] | None = None,
        breaker: BreakerConfig | None = None,
        max_retries: int = 2,
        health_interval_s: float = 2.0,
    ) -> None:
        """``predictions``: record the router's predicted TTFT on the chosen engine (its
        decision's candidate: queueing + own prefill) in each request's record. ``join_at``:
        each engine's join time (virtual s; None: every engine from the start). ``outages``:
        engines that go down and come back as ``restart(index)`` makes them (a new process);
        ``breaker``, ``max_retries`` and ``health_interval_s`` the gateway's settings."""
        self.router = router
        self.profile = profile
        self.link = link or LinkConfig()
        self.models = models
        self.loop = EventLoop()
        self._make_engine_request = make_engine_request
        self._rng = rng  # link jitter only; seeded by the caller
        joins = list(join_at) if join_at is not None else [0.0] * len(engines)
        if len(joins) != len(engines) or not all(t >= 0 for t in joins):
            raise ValueError("join_at: one time >= 0 per engine")
        self.slots = [
            _EngineSlot(i, e, f"{url_prefix}{e.engine_id}", f"sim{self.link.seed}", joins[i])
            for i, e in enumerate(engines)
        ]
        self._by_id = {s.core.engine_id: s for s in self.slots}
        self.outages = tuple(outages)
        if any(o.engine >= len(self.slots) for o in self.outages):
            raise ValueError("outage: no such engine")
        if any(o.up_at is not None for o in self.outages) and restart is None:
            raise ValueError("outages that end need a restart factory")
        self._restart = restart
        self.max_retries = max_retries
        self.health_interval_s = health_interval_s
        # the gateway's view of the engines: circuit breakers and in-flight counts
        self.pool = EnginePool(breaker or BreakerConfig())
        self.pool.add_static(StaticEngine(s.core.engine_id, s.url, models) for s in self.slots)
        self.records: list[RequestRecord] = []
        self.predictions = predictions
        self._flights: dict[str, _Flight] = {}
        self.kv_ms_per_token = kv_ms_per_token  # the KV link's time per prompt token
        self.transfers_ms: list[float] = []
        self.stats = WorldStats()
        self._horizon = 0.0
        # conversations (``Request.after``): the arrival in the workload of each request a later
        # turn waits for, when each of those ended, and the turns waiting, by the one they wait
        # for (nothing for a workload without conversations)
        self._scheduled: dict[str, float] = {}
        self._ended: dict[str, float] = {}
        self._waiting: dict[str, list[Request]] = {}
        loop = self.loop
        loop.on(Kind.ARRIVAL, self._on_arrival)
        loop.on(Kind.SUBMIT, self._on_submit)
        loop.on(Kind.ENGINE_WAKE, self._on_wake)
        loop.on(Kind.DELIVER, self._on_deliver)
        loop.on(Kind.HEARTBEAT, self._on_heartbeat)
        loop.on(Kind.TRANSFER, self._on_transfer)
        loop.on(Kind.OUTAGE, self._on_outage)
        loop.on(Kind.PROBE, self._on_probe)

    # ------------------------------------------------------------------ running

    def run(self, requests: Sequence[Request], *, drain_s: float | None = None) -> None:
        """Simulate ``requests`` (sorted by arrival) until every one has ended.

        Heartbeats run while requests are open; ``drain_s`` bounds the time after the last
        arrival (None: until all finish).
        """
        if not requests:
            return
        awaited = {req.after for req in requests if req.after is not None}
        self._scheduled = {r.request_id: r.arrival for r in requests if r.request_id in awaited}
        for req in requests:
            self.loop.schedule(self._routed_at(req), Kind.ARRIVAL, req)
        last = requests[-1].arrival
        self._horizon = last
        for slot in self.slots:
            if slot.join_at > 0.0:  # a late engine's first heartbeat makes it known
                self.loop.schedule(slot.join_at, Kind.HEARTBEAT, slot.index)
                continue
            # initial heartbeats make the engines known and alive before the first request
            self._send_heartbeat(slot, 0.0)
            self.loop.schedule(self.link.heartbeat_s, Kind.HEARTBEAT, slot.index)
        for o in self.outages:
            self.loop.schedule(o.down_at, Kind.OUTAGE, (o.engine, False))
            if o.up_at is not None:
                self.loop.schedule(o.up_at, Kind.OUTAGE, (o.engine, True))
        if self.outages:
            self.loop.schedule(self.health_interval_s, Kind.PROBE, None)
        until = None if drain_s is None else last + drain_s
        self.loop.run(until=until)
        # whatever is still open when the bound hits ends as a timeout, and so does a turn
        # still waiting for the answer before it
        for flight in list(self._flights.values()):
            flight.record.error = "still running when the simulation stopped"
            flight.record.status = 504
        self._flights.clear()
        for waiting in self._waiting.values():
            for req in waiting:
                rec = self._record(req)
                rec.error = "still waiting for the answer before it when the simulation stopped"
                rec.status = 504
                self.records.append(rec)
        self._waiting.clear()

    # ------------------------------------------------------------------ handlers

    def _record(self, req: Request) -> RequestRecord:
        return RequestRecord.for_request(req, prompt_tokens=req.input_tokens)

    def _routed_at(self, req: Request) -> float:
        """When ``req``, sent at its arrival, reaches the router (its body's ingress)."""
        fixed, per_byte = self.link.ingress_s, self.link.ingress_s_per_mb / 1e6
        return req.arrival + fixed + per_byte * req.key_len if fixed or per_byte else req.arrival

    def _waits(self, req: Request, now: float) -> bool:
        """Whether ``req``, a conversation's turn, waits for the answer to the turn before it
        (``Request.after``, when that turn is in this run): until that answer ends, and then
        the gap between the two turns in the workload (the user reads, thinks, types). It is
        sent then, and its latencies count from then."""
        before = req.after
        if before is None or before not in self._scheduled:
            return False
        ended = self._ended.get(before)
        if ended is None:
            self._waiting.setdefault(before, []).append(req)
            return True
        if ended + self._gap(req) <= req.arrival:
            return False  # (the answer came in time: it goes at its own arrival)
        self._send_after(req, ended)
        return True

    def _gap(self, req: Request) -> float:
        """The time between ``req`` and the turn before it in the workload."""
        return max(req.arrival - self._scheduled[req.after or ""], 0.0)

    def _send_after(self, req: Request, ended: float) -> None:
        sent = req.with_(arrival=max(ended + self._gap(req), req.arrival), after=None)
        at = self._routed_at(sent)
        self._horizon = max(self._horizon, at)
        self.loop.schedule(at, Kind.ARRIVAL, sent)

    def _ended_request(self, request_id: str, now: float) -> None:
        """``request_id`` has its answer, or its refusal: the turns waiting for it are sent."""
        if request_id not in self._scheduled:
            return  # (no turn waits for it)
        self._ended[request_id] = now
        for req in self._waiting.pop(request_id, ()):
            self._send_after(req, now)

    def _on_arrival(self, req: Request, now: float) -> None:
        if self._waits(req, now):
            return
        rec = self._record(req)
        self.records.append(rec)
        self._dispatch(req, rec, now, frozenset())

    def _dispatch(
        self, req: Request, rec: RequestRecord, now: float, tried: frozenset[str]
    ) -> None:
        """Route ``req`` (not to the engines the gateway's breakers exclude, nor to those that
        refused it already) and send it on."""
        key = req.key()
        blocked = self.pool.blocked(now)
        decision = self.router.route(
            RouteRequest(
                request_id=req.request_id,
                model=req.model,
                key=key,
                input_tokens=req.input_tokens,
                max_tokens=req.stated_tokens,
                slo=req.slo,
                session=req.session,
                exclude=blocked | tried if tried else blocked,
            ),
            now,
        )
        self.stats.route_calls += 1
        rec.reason = decision.reason
        rec.matched_bytes = decision.matched_bytes
        engine_id = decision.engine_id
        if engine_id is None:
            self.stats.shed += 1
            if self.link.run_shed and decision.fallback is not None:
                engine_id = decision.fallback
                rec.shed_run = True
            else:
                rec.status = STATUS_SHED
                rec.error = decision.detail or "shed by the router"
                rec.e2e_s = 0.0
                self._ended_request(req.request_id, now)
                return
        slot = self._by_id.get(engine_id)
        if slot is None:
            rec.status = 502
            rec.error = f"router chose unknown engine {engine_id}"
            self._ended_request(req.request_id, now)
            return
        rec.engine = engine_id
        if self.predictions and decision.engine_id is not None:
            for cand in decision.candidates:
                if cand.engine_id == engine_id:
                    rec.predicted_ttft_ms = cand.load_ms + cand.prefill_ms
        slot.routed += 1
        self.stats.routed += 1
        self.pool.started(engine_id, now)
        flight = self._flights[req.request_id] = _Flight(
            req, rec, slot.index, sent=now, tried=tried
        )
        ereq = self._make_engine_request(req, key, now + self.link.network_delay_s)
        dec = decision.decode_engine_id
        if decision.disaggregated and dec in self._by_id:
            flight.decode_engine = self._by_id[dec].index
            flight.ereq, flight.key = ereq, key
            # the prefill phase: one token (the answer is the decode engine's to cache)
            ereq = replace(ereq, output_tokens=1, answer_key=b"")
            self.stats.extra["disaggregated"] = self.stats.extra.get("disaggregated", 0) + 1
        self.loop.schedule(now + self.link.network_delay_s, Kind.SUBMIT, (slot.index, ereq))

    def _on_submit(self, payload: tuple[int, Any], now: float) -> None:
        index, ereq = payload
        slot = self.slots[index]
        flight = self._flights.get(ereq.request_id)
        if slot.down:  # the connection is refused: the gateway tries another engine
            if flight is not None:
                self._refused(flight, slot, now)
            return
        if flight is not None:
            flight.submitted = True
        slot.core.submit(ereq, now)
        self._after_engine_call(slot, now)

    def _refused(self, flight: _Flight, slot: _EngineSlot, now: float) -> None:
        """``flight`` could not reach its engine: a failure for the breaker and the router,
        and a retry elsewhere while the gateway's attempts last."""
        eid = slot.core.engine_id
        rid = flight.req.request_id
        del self._flights[rid]
        self.pool.finished(eid, False, now, "connect")
        self.router.report(rid, eid, "failed", now)
        tried = flight.tried | {eid}
        if len(tried) <= self.max_retries:
            self.stats.extra["retried"] = self.stats.extra.get("retried", 0) + 1
            flight.record.engine = None
            self._dispatch(flight.req, flight.record, now, tried)
            return
        self._failed(flight, now, f"engine {eid} refused the connection (no attempt left)")

    def _failed(self, flight: _Flight, now: float, error: str) -> None:
        rec = flight.record
        rec.status = STATUS_UPSTREAM
        rec.error = error
        rec.e2e_s = now - flight.req.arrival
        self._ended_request(flight.req.request_id, now)

    def _on_wake(self, payload: tuple[int, int], now: float) -> None:
        index, version = payload
        slot = self.slots[index]
        if version != slot.wake_version:
            self.stats.stale_wakes += 1
            return
        self.stats.wakes += 1
        slot.wake_at = None
        outputs = slot.core.advance(now)
        for out in outputs:
            self._on_output(slot, out, now)
        self._after_engine_call(slot, now)

    def _on_output(self, slot: _EngineSlot, out: Any, now: float) -> None:
        flight = self._flights.get(out.request_id)
        if flight is None:
            return
        rec = flight.record
        arrival = flight.req.arrival
        if out.rejected is not None:
            rec.status = STATUS_SHED
            rec.error = out.rejected
            rec.e2e_s = now - arrival
            del self._flights[out.request_id]
            if out.request_id == flight.req.request_id:  # (the gateway sent this one)
                self.pool.finished(slot.core.engine_id, True, now)
            self.router.report(flight.req.request_id, slot.core.engine_id, "ok", now)
            self._ended_request(flight.req.request_id, now)
            return
        if flight.decode_engine is not None and out.request_id == flight.req.request_id:
            if out.usage is not None:  # the prefill phase ended: the KV moves
                del self._flights[out.request_id]
                self.pool.finished(slot.core.engine_id, True, now)
                flight.prefill_cached = out.usage.cached_tokens
                ms = self.kv_ms_per_token * out.usage.prompt_tokens
                self.transfers_ms.append(ms)
                at = now + ms / 1000.0 + self.link.network_delay_s
                self.loop.schedule(at, Kind.TRANSFER, (flight, ms))
            return
        if out.index == 0 and out.times and rec.ttft_s is None:
            rec.ttft_s = out.times[0] - arrival
            if self.link.gateway_ttft and flight.decode_engine is None:
                ttft_ms = (out.times[0] - flight.sent) * 1000.0
                self.router.first_token(out.request_id, slot.core.engine_id, ttft_ms, now)
        if out.usage is not None:
            u = out.usage
            last = out.times[-1] if out.times else now
            rec.status = STATUS_OK
            rec.e2e_s = last - arrival
            rec.completion_tokens = u.completion_tokens
            rec.prompt_tokens = u.prompt_tokens
            # (disaggregated: the prefix cache's hits are the prefill engine's; the decode
            # engine's "cached" prompt is the KV it was handed)
            rec.cached_tokens = (
                u.cached_tokens if flight.decode_engine is None else flight.prefill_cached
            )
            rec.tpot_s = u.tpot_ms / 1000.0 if u.completion_tokens > 1 else None
            del self._flights[out.request_id]
            if flight.decode_engine is None:
                self.pool.finished(slot.core.engine_id, True, now)
            # (with the answer's length against its cap, as the gateway reads it off the answer)
            self.router.report(
                flight.req.request_id,
                slot.core.engine_id,
                "ok",
                now,
                u.completion_tokens,
                flight.req.stated_tokens,
            )
            self._ended_request(flight.req.request_id, now)

    def _on_transfer(self, payload: tuple[_Flight, float], now: float) -> None:
        """The prompt's KV is on the decode engine: the decode request arrives there."""
        flight, ms = payload
        assert flight.decode_engine is not None
        slot = self.slots[flight.decode_engine]
        if slot.down:
            self.router.report(flight.req.request_id, slot.core.engine_id, "failed", now)
            self._failed(flight, now, f"decode engine {slot.core.engine_id} is down")
            return
        slot.core.receive_kv(flight.key, now)
        ereq = replace(
            flight.ereq,
            request_id=decode_id(flight.req.request_id),
            kv_transfer_ms=ms,
            kv_transfer_tokens=flight.ereq.input_tokens,
        )
        self._flights[ereq.request_id] = flight
        flight.submitted = True
        slot.core.submit(ereq, now)
        self._after_engine_call(slot, now)

    def _on_outage(self, payload: tuple[int, bool], now: float) -> None:
        index, back = payload
        slot = self.slots[index]
        if back:
            self._come_back(slot, now)
        else:
            self._go_down(slot, now)

    def _go_down(self, slot: _EngineSlot, now: float) -> None:
        """The engine's process dies: what it was serving fails (the streams break), its
        unsent events are lost, its wake-up and heartbeats stop."""
        if slot.down:
            return
        slot.down = True
        slot.busy_before_s += slot.core.busy_s
        slot.wake_version += 1
        slot.wake_at = None
        slot.core.drain_events()
        eid = slot.core.engine_id
        self.stats.extra["outages"] = self.stats.extra.get("outages", 0) + 1
        for rid, flight in list(self._flights.items()):
            decode_phase = rid != flight.req.request_id
            here = flight.decode_engine if decode_phase else flight.engine
            if here != slot.index or not flight.submitted:
                continue  # (one on its way finds the engine gone when it gets there)
            del self._flights[rid]
            if not decode_phase:
                self.pool.finished(eid, False, now, "stream broken")
            self.router.report(flight.req.request_id, eid, "failed", now)
            self._failed(flight, now, f"engine {eid} went down")

    def _come_back(self, slot: _EngineSlot, now: float) -> None:
        """A new process on the same hardware: an empty cache and a new epoch, announced by
        its first heartbeat."""
        if not slot.down or self._restart is None:
            return
        slot.core = self._restart(slot.index)
        slot.restarts += 1
        slot.epoch = f"sim{self.link.seed}.{slot.restarts}"
        slot.seq = 0
        slot.itl_s_seen, slot.itl_tokens_seen = 0.0, 0
        slot.down = False
        self._send_heartbeat(slot, now)

    def _on_probe(self, _: None, now: float) -> None:
        """The gateway's health probes: an engine that is down fails its probe, one that is
        back passes it (and is readmitted)."""
        for slot in self.slots:
            self.pool.health_result(slot.core.engine_id, not slot.down, now)
        if now < self._horizon or self._flights:
            self.loop.schedule(now + self.health_interval_s, Kind.PROBE, None)

    def _after_engine_call(self, slot: _EngineSlot, now: float) -> None:
        """Ship the engine's new events and (re)arm its wake-up."""
        events = slot.core.drain_events()
        if events:
            self._ship(slot, events, now)
        t = slot.core.next_event_time()
        if t is None:
            if slot.wake_at is not None:
                slot.wake_version += 1  # cancel the armed wake
                slot.wake_at = None
            return
        t = max(t, now)
        if slot.wake_at == t:
            return
        slot.wake_version += 1
        slot.wake_at = t
        self.loop.schedule(t, Kind.ENGINE_WAKE, (slot.index, slot.wake_version))

    def _ship(self, slot: _EngineSlot, events: list[Event], now: float) -> None:
        """Wrap events in envelopes (epoch, consecutive seq) and deliver them later, in order."""
        eid = slot.core.engine_id
        envs = []
        seq = slot.seq
        if not self.link.request_events:
            events = [self._as_bridged(slot, ev) for ev in events if isinstance(ev, BRIDGED_EVENTS)]
            if not events:
                return
        for ev in events:
            envs.append(Envelope(eid, slot.epoch, seq, now, ev))
            seq += 1
        slot.seq = seq
        delay = self.link.link_delay_s
        if self.link.link_jitter_s:
            delay += self._rng.random() * self.link.link_jitter_s
        at = max(now + delay, slot.last_delivery)
        slot.last_delivery = at
        self.stats.envelopes += len(envs)
        self.loop.schedule(at, Kind.DELIVER, envs)

    def _as_bridged(self, slot: _EngineSlot, ev: Event) -> Event:
        """``ev`` as the bridge would report it (:mod:`engine_reporter.vllm.metrics`): a
        heartbeat without the prefill timings vLLM does not export, its decode step the mean
        inter-token latency of the tokens decoded since the previous one (what vLLM exports:
        each token's time since its request's previous token, a step's prefill mixed in). With
        the batch and context: for an interval of pure decode (no prefill in it, nothing
        waiting) that latency is the decode step; for one with prefill in it, also the tokens
        decoded and the profile's time for the prefill done (the bridge prices the prompt
        tokens vLLM computed), which the router spreads over the interval's steps."""
        if not isinstance(ev, LoadHeartbeat):
            return ev
        core = slot.core
        tokens = core.itl_tokens - slot.itl_tokens_seen
        itl = 1000.0 * (core.itl_s_total - slot.itl_s_seen) / tokens if tokens > 0 else None
        slot.itl_s_seen, slot.itl_tokens_seen = core.itl_s_total, core.itl_tokens
        pure = ev.prefill_ms is None and ev.waiting == 0 and ev.decode_step_ms is not None
        if pure:
            return replace(ev, prefill_plan_ms=None)
        if itl is not None and ev.decode_batch:
            return replace(ev, prefill_ms=None, decode_step_ms=itl, decode_tokens=tokens)
        return replace(
            ev,
            prefill_ms=None,
            prefill_plan_ms=None,
            decode_step_ms=itl,
            decode_batch=None,
            decode_context=None,
        )

    def _on_deliver(self, envs: list[Envelope], now: float) -> None:
        self.stats.deliveries += 1
        apply = self.router.apply
        for env in envs:
            apply(env, now)

    def _send_heartbeat(self, slot: _EngineSlot, now: float) -> None:
        self.stats.heartbeats += 1
        self._ship(slot, [slot.core.heartbeat(slot.url, self.models, now)], now)

    def _on_heartbeat(self, index: int, now: float) -> None:
        slot = self.slots[index]
        if not slot.down:
            self._send_heartbeat(slot, now)
        if now < self._horizon or self._flights:
            self.loop.schedule(now + self.link.heartbeat_s, Kind.HEARTBEAT, index)

    # ------------------------------------------------------------------ results

    def per_engine(self) -> dict[str, int]:
        return {s.core.engine_id: s.routed for s in self.slots}


# what a plain vLLM behind the bridge reports (engine_reporter.vllm): its KV events, and
# heartbeats read off its /metrics
BRIDGED_EVENTS = (BlockStored, BlockRemoved, AllCleared, LoadHeartbeat)
