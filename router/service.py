"""The router's I/O shell: in-process (:class:`EmbeddedRouter`) and as the ``kvgate router`` HTTP
service (:func:`create_app`).

Both feed a pure :class:`router.core.Router` from a :class:`broker.consumer.Consumer` with
wall-clock time (the consumer's clock, so broker lag is measured against engine timestamps).
A restarted router or a second replica rebuilds its state the same way: the consumer loads each
engine's snapshot and replays the stream after it.

**Ready** (:meth:`EmbeddedRouter.ready`) once the consumer has caught up with the broker
(snapshots loaded, streams replayed to their end: ``Consumer.caught_up``) and the router knows
at least one live engine; it stays ready after that (a later outage is the degraded mode's
business). Before, ``POST /route`` waits up to ``READY_WAIT_S`` for it, then answers 503 with
``Retry-After``, and ``GET /ready`` answers 503: never a decision made on a half-rebuilt state.

With zero live engines: a router that never knew one is not ready (nothing to route to yet; a
gateway in front waits or answers 503 itself). One that knew engines stays ready when they all
go: every replica sees the same fleet, and taking them all out of a Kubernetes Service would
only turn the router's own answer (its decision without an engine, a shed) into connection
errors. ``GET /health`` and ``GET /ready`` answer 503 with a reason while the broker is
unreachable or the consumer has completed no round of reads for ``stall_s`` (``STALL_S``, 30 s:
reads that keep failing, say on a position the broker refuses, while discovery still works).

HTTP API (JSON; shapes in :mod:`router.wire`; bad input -> 400 ``{"error": {...}}``):

* ``POST /route``: a RouteRequest with the key base64-encoded in ``key_b64`` -> a Decision;
* ``POST /report``: ``{"request_id", "engine_id", "outcome"}`` -> ``{"released": bool}``;
* ``POST /first_token``: ``{"request_id", "engine_id", "ttft_ms"}`` (the gateway's TTFT of a
  streamed answer) -> ``{"folded": bool}`` (only for an engine that sends no request events);
* ``GET /engines``, ``GET /state``, ``GET /metrics`` (Prometheus), ``GET /health`` (200 while
  the broker is reachable and the consumer's reads complete; else 503 with ``reason``),
  ``GET /ready`` (200 once ready and while healthy: the readiness probe);
* ``POST /engines/{engine_id}/drain`` and ``/undrain``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from broker.consumer import Consumer
from router.api import Decision, EngineInfo, Outcome, RouteRequest
from router.core import Router
from router.wire import (
    WireError,
    decision_to_json,
    engine_to_json,
    first_token_from_json,
    report_from_json,
    request_from_json,
)

log = logging.getLogger("kvgate.router")

T = TypeVar("T")

MAX_BODY_BYTES = 96 << 20  # a 64 MiB key, base64-encoded, plus the envelope
READY_WAIT_S = 0.5  # /route before ready: wait this long (below a gateway's route timeout)
READY_POLL_S = 0.02
# /health and /ready: a consumer that completed no round of reads for this long is stalled (a
# round is bounded by the broker's blocking read, 5 s at most, and its 10-s socket timeout)
STALL_S = 30.0
LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 100e-3,
)  # fmt: skip


class EmbeddedRouter:
    """A Router fed by a Consumer, behind the ``RoutingService`` protocol (in-process use)."""

    def __init__(
        self,
        router: Router,
        broker: Any,
        *,
        clock: Callable[[], float] = time.time,
        consumer_options: dict[str, Any] | None = None,
        stall_s: float = STALL_S,
    ) -> None:
        self.router = router
        self.stall_s = stall_s
        self.broker = broker
        self.clock = clock
        # a retired epoch is taken back from a current one silent for as long as the router
        # would take the engine for dead anyway (a real restart's engine heartbeats far sooner)
        options: dict[str, Any] = {"epoch_reclaim_s": router.config.cluster.heartbeat_ttl_s}
        options.update(consumer_options or {})
        self.consumer = Consumer(broker, router, clock=clock, **options)
        self._ready = False

    def is_ready(self) -> bool:
        """Caught up with the broker and knowing a live engine (latched once true)."""
        if self._ready or not self.consumer.caught_up:
            return self._ready
        alive = sum(1 for e in self.router.engines(self.clock()) if e.alive)
        if alive:
            self._ready = True
            log.info("router ready: caught up with the broker, %d live engines", alive)
        return self._ready

    def problem(self) -> str | None:
        """Why the router's view of the engines is not live (its broker unreachable, or its
        consumer's reads failing for ``stall_s``), or None."""
        if not self.consumer.connected:
            return "the router's broker is unreachable"
        stalled = self.consumer.stalled_s(self.stall_s)
        if stalled is not None:
            return f"the router's consumer has completed no read of the broker for {stalled:.0f} s"
        return None

    async def ready(self) -> bool:
        """:meth:`is_ready` (the gateway's routing services answer this asynchronously)."""
        return self.is_ready()

    async def wait_ready(self, timeout_s: float) -> bool:
        """Whether the router is ready, waiting up to ``timeout_s`` for it."""
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(READY_POLL_S, left))
        return True

    async def start(self) -> None:
        await self.consumer.start()

    async def close(self) -> None:
        await self.consumer.close()

    async def route(self, request: RouteRequest) -> Decision:
        return self.router.route(request, self.clock())

    async def report(
        self,
        request_id: str,
        engine_id: str,
        outcome: Outcome,
        output_tokens: int = 0,
        max_tokens: int = 0,
    ) -> None:
        self.router.report(request_id, engine_id, outcome, self.clock(), output_tokens, max_tokens)

    async def first_token(self, request_id: str, engine_id: str, ttft_ms: float) -> None:
        self.router.first_token(request_id, engine_id, ttft_ms, self.clock())

    async def engines(self) -> list[EngineInfo]:
        return self.router.engines(self.clock())

    def state(self) -> dict:
        """The router's state plus the consumer's (``broker.lag_s`` etc.)."""
        out = self.router.state(self.clock())
        s = self.consumer.stats
        out["ready"] = self.is_ready()
        out["broker"] = {
            "connected": self.consumer.connected,
            "answered_s_ago": (
                round(time.monotonic() - answered, 3)
                if (answered := self.consumer.answered_at) is not None
                else None
            ),
            "round_s_ago": (
                round(time.monotonic() - last, 3)
                if (last := self.consumer.round_at) is not None
                else None
            ),
            "stalled": self.consumer.stalled_s(self.stall_s) is not None,
            "caught_up": self.consumer.caught_up,
            "lag_s": round(s.lag_s, 6),
            "entries": s.entries,
            "events": s.events,
            "blocks": s.blocks,
            "malformed": s.malformed,
            "duplicates": s.duplicates,
            "stale": s.stale,
            "resyncs": s.resyncs,
            "snapshots_loaded": s.snapshots_loaded,
            "new_epochs": s.new_epochs,
            "epochs_reclaimed": s.epochs_reclaimed,
            "reconnects": s.reconnects,
            "sink_errors": s.sink_errors,
        }
        return out


class _StateCollector(Collector):
    """Gauges and counters read from the router and consumer at scrape time."""

    def __init__(self, service: EmbeddedRouter) -> None:
        self.service = service

    def collect(self):  # type: ignore[no-untyped-def]
        router = self.service.router
        now = self.service.clock()
        st = router.cluster.tree.stats()
        yield GaugeMetricFamily("kvgate_router_tree_bytes", "Key bytes in the radix tree", st.bytes)
        yield GaugeMetricFamily(
            "kvgate_router_tree_budget_bytes",
            "Byte budget of the radix tree (nodes no engine holds are dropped above it)",
            router.cluster.tree.budget_bytes,
        )
        yield GaugeMetricFamily("kvgate_router_tree_nodes", "Radix tree nodes", st.nodes)
        yield GaugeMetricFamily(
            "kvgate_router_tree_index_entries", "Block hashes indexed", st.index_entries
        )
        yield GaugeMetricFamily(
            "kvgate_router_inflight",
            "Requests routed and not finished",
            router.cluster.inflight_count,
        )
        engines = GaugeMetricFamily("kvgate_router_engines", "Engines by state", labels=["state"])
        infos = router.engines(now)
        engines.add_metric(["alive"], sum(1 for e in infos if e.alive))
        engines.add_metric(["dead"], sum(1 for e in infos if not e.alive))
        engines.add_metric(["draining"], sum(1 for e in infos if e.draining))
        yield engines
        speed = GaugeMetricFamily(
            "kvgate_router_engine_speed_factor",
            "Each engine's fitted time factor against its cost profile (> 1: slower)",
            labels=["engine", "phase"],
        )
        tpot = GaugeMetricFamily(
            "kvgate_router_engine_tpot_seconds",
            "Each engine's TPOT as the router prices it (median of its recent measurements)",
            labels=["engine"],
        )
        window = GaugeMetricFamily(
            "kvgate_router_engine_window_load_seconds",
            "Each engine's windowed load as rebalancing weighs it (Preble's L: the prefill routed "
            "there in the window plus its output tokens x the engine's TPOT)",
            labels=["engine"],
        )
        for eid, eng in sorted(router.cluster.engines.items()):
            speed.add_metric([eid, "prefill"], eng.speed.prefill)
            speed.add_metric([eid, "decode"], router.cluster.decode_scale(eng))
            tpot.add_metric([eid], eng.tpot_ms / 1000.0)
            window.add_metric([eid], eng.window_ms() / 1000.0)
        yield speed
        yield tpot
        yield window
        events = CounterMetricFamily(
            "kvgate_router_events", "Broker events applied, by kind", labels=["kind"]
        )
        for kind, n in sorted(router.cluster.events.items()):
            events.add_metric([kind], n)
        yield events
        s = self.service.consumer.stats
        yield GaugeMetricFamily(
            "kvgate_router_broker_lag_seconds", "Worst per-engine event lag", s.lag_s
        )
        yield CounterMetricFamily(
            "kvgate_router_broker_malformed", "Malformed stream entries skipped", s.malformed
        )
        yield CounterMetricFamily("kvgate_router_broker_resyncs", "Engine resyncs", s.resyncs)
        for name, doc, value in (
            ("duplicates", "Events already applied, skipped (re-sent batches)", s.duplicates),
            (
                "stale",
                "Events of an engine's retired epoch, skipped (a zombie publisher, or a forged"
                " restart until its epoch is taken back)",
                s.stale,
            ),
            ("new_epochs", "Engine restarts seen (a new epoch from seq 0)", s.new_epochs),
            (
                "epochs_reclaimed",
                "Retired epochs taken back from a silent current epoch (a forged restart)",
                s.epochs_reclaimed,
            ),
            ("snapshots_loaded", "Engine snapshots loaded", s.snapshots_loaded),
            ("sink_errors", "Events the router failed to apply (logged)", s.sink_errors),
            (
                "loop_errors",
                "Rounds of the event feed that failed unexpectedly (logged)",
                s.loop_errors,
            ),
            ("reconnects", "Times the broker became reachable again", s.reconnects),
        ):
            yield CounterMetricFamily(f"kvgate_router_broker_{name}", doc, value)
        yield CounterMetricFamily(
            "kvgate_router_stale_outcomes",
            "Request events and gateway reports naming an engine the request is not on (a"
            " retried request's first engine, late), ignored",
            router.cluster.stale_outcomes,
        )
        yield CounterMetricFamily(
            "kvgate_router_unknown_profiles",
            "Engines' announcements of a cost profile this router cannot read (it predicts"
            " those engines with the default profile)",
            router.cluster.unknown_profiles,
        )


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _bad(message: str, field: str, status: int = 400) -> web.Response:
    return _json({"error": {"message": message, "type": "invalid_request", "param": field}}, status)


async def _parsed(request: web.Request, parse: Callable[[Any], T]) -> T | web.Response:
    """The request's JSON body read by ``parse`` (:mod:`router.wire`), or the 400 answer that
    says what is wrong with it."""
    try:
        return parse(orjson.loads(await request.read()))
    except orjson.JSONDecodeError:
        return _bad("body is not valid JSON", "body")
    except WireError as exc:
        return _bad(str(exc), exc.field)
    except ValueError as exc:
        return _bad(str(exc), "body")


def _not_ready(service: EmbeddedRouter) -> web.Response:
    """503 with Retry-After: the router's broker or consumer has a problem, the router is
    catching up with the broker, or it knows no engine yet."""
    caught_up = service.consumer.caught_up
    connected = service.consumer.connected
    why = (
        service.problem()
        or (caught_up and "the router knows no live engine yet")
        or "the router is catching up with the broker"
    )
    body = {
        "ready": False,
        "broker_connected": connected,
        "caught_up": caught_up,
        "error": {"message": why, "type": "not_ready", "param": None},
    }
    return web.Response(
        body=orjson.dumps(body),
        status=503,
        content_type="application/json",
        headers={"Retry-After": "1"},
    )


def create_app(service: EmbeddedRouter, *, manage_consumer: bool = True) -> web.Application:
    """The ``kvgate router`` HTTP app around ``service`` (starts/stops its consumer when
    ``manage_consumer``)."""
    registry = CollectorRegistry()
    decisions = Counter(
        "kvgate_router_decisions",
        "Routing decisions by policy and reason",
        ["policy", "reason"],
        registry=registry,
    )
    latency = Histogram(
        "kvgate_router_decision_seconds",
        "Time to make one routing decision (router core only)",
        buckets=LATENCY_BUCKETS,
        registry=registry,
    )
    registry.register(_StateCollector(service))
    router = service.router

    async def route(request: web.Request) -> web.Response:
        req = await _parsed(request, request_from_json)
        if isinstance(req, web.Response):
            return req
        if not service.is_ready() and not await service.wait_ready(READY_WAIT_S):
            return _not_ready(service)
        t0 = time.perf_counter()
        decision = router.route(req, service.clock())
        latency.observe(time.perf_counter() - t0)
        decisions.labels(decision.policy, decision.reason).inc()
        return _json(decision_to_json(decision))

    async def report(request: web.Request) -> web.Response:
        got = await _parsed(request, report_from_json)
        if isinstance(got, web.Response):
            return got
        rid, engine_id, outcome, output_tokens, max_tokens = got
        released = router.report(
            rid, engine_id, outcome, service.clock(), output_tokens, max_tokens
        )
        return _json({"released": released})

    async def first_token(request: web.Request) -> web.Response:
        got = await _parsed(request, first_token_from_json)
        if isinstance(got, web.Response):
            return got
        rid, engine_id, ttft_ms = got
        return _json({"folded": router.first_token(rid, engine_id, ttft_ms, service.clock())})

    async def engines(request: web.Request) -> web.Response:
        return _json([engine_to_json(e) for e in router.engines(service.clock())])

    async def state(request: web.Request) -> web.Response:
        return _json(service.state())

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def health(request: web.Request) -> web.Response:
        now = service.clock()
        alive = sum(1 for e in router.engines(now) if e.alive)
        problem = service.problem()
        body: dict[str, Any] = {
            "status": "degraded" if problem else "ok",
            "broker_connected": service.consumer.connected,
            "engines_alive": alive,
        }
        if problem:
            body["reason"] = problem
        return _json(body, 503 if problem else 200)

    async def ready(request: web.Request) -> web.Response:
        if service.is_ready() and service.problem() is None:
            return _json({"ready": True, "broker_connected": True})
        return _not_ready(service)

    async def drain(request: web.Request) -> web.Response:
        engine_id = request.match_info["engine_id"]
        draining = request.match_info["action"] == "drain"
        router.set_draining(engine_id, draining)
        return _json({"engine_id": engine_id, "draining": draining})

    async def lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
        if manage_consumer:
            await service.start()
        yield
        if manage_consumer:
            await service.close()

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/route", route)
    app.router.add_post("/report", report)
    app.router.add_post("/first_token", first_token)
    app.router.add_get("/engines", engines)
    app.router.add_post(r"/engines/{engine_id}/{action:drain|undrain}", drain)
    app.router.add_get("/state", state)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.cleanup_ctx.append(lifecycle)
    return app
