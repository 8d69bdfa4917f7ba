"""The gateway's Prometheus metrics, in a registry of its own (several gateways per process in
tests and the demo must not collide). Names follow Prometheus conventions (base units, counters
ending in ``_total``) so that ``promtool check metrics`` accepts the exposition."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.httpserver import ConnectionStats
from gateway.pool import CIRCUIT_CODES, EnginePool
from kvgate.fast_metrics import FastCollector, FastCounter, FastHistogram

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
BYTES_BUCKETS = (0, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)


class ConnectionCollector:
    """The HTTP server's connection limits at work (``ConnectionStats``, read on scrape)."""

    def __init__(self, stats: ConnectionStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        st = self.stats
        yield GaugeMetricFamily(
            "kvgate_gateway_open_connections", "Client connections open now.", value=st.open
        )
        yield CounterMetricFamily(
            "kvgate_gateway_connections_refused",
            "Client connections answered 503 and closed at once: over --max-connections.",
            value=st.refused,
        )
        timeouts = CounterMetricFamily(
            "kvgate_gateway_request_timeouts",
            "Requests answered 408 and their connection closed: the head (--head-timeout) or "
            "the body (--body-timeout) did not arrive in time.",
            labels=["part"],
        )
        timeouts.add_metric(["head"], st.head_timeouts)
        timeouts.add_metric(["body"], st.body_timeouts)
        yield timeouts


class GatewayMetrics:
    """Every metric the gateway exports; engine gauges are refreshed from the pool on scrape."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # Touched by every request: the lock-free kind (see FastCounter).
        self.requests = FastCounter(
            "kvgate_gateway_requests",
            "Requests answered, by route and HTTP status.",
            ["route", "status"],
        )
        self.ttft = FastHistogram(
            "kvgate_gateway_ttft_seconds",
            "Time from request arrival to the first streamed byte sent to the client.",
            ["route"],
            buckets=LATENCY_BUCKETS,
        )
        self.e2e = FastHistogram(
            "kvgate_gateway_request_duration_seconds",
            "Time from request arrival to the last byte sent to the client.",
            ["route", "stream"],
            buckets=LATENCY_BUCKETS,
        )
        self.route_seconds = FastHistogram(
            "kvgate_gateway_route_decision_seconds",
            "Time spent asking the router (or the fallback) where a request goes.",
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01, 0.1, 1.0),
        )
        self.decisions = FastCounter(
            "kvgate_gateway_routing_decisions",
            "Routing decisions, by policy and reason (shed included).",
            ["policy", "reason"],
        )
        self.matched_bytes = FastHistogram(
            "kvgate_gateway_matched_prefix_bytes",
            "Bytes of the routing key cached on the chosen engine, per decision.",
            buckets=BYTES_BUCKETS,
        )
        self.phase_seconds = FastHistogram(
            "kvgate_gateway_pd_phase_seconds",
            "Prefill/decode disaggregation, per phase: prefill (the prefill engine's answer) "
            "and decode_first_byte (from the decode request to its first byte).",
            ["phase"],
            buckets=LATENCY_BUCKETS,
        )
        r.register(
            FastCollector(
                (
                    self.phase_seconds,
                    self.requests,
                    self.ttft,
                    self.e2e,
                    self.route_seconds,
                    self.decisions,
                    self.matched_bytes,
                )
            )
        )
        self.retries = Counter(
            "kvgate_gateway_retries",
            "Requests re-sent to another engine, by cause.",
            ["cause"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvgate_gateway_upstream_errors",
            "Failed upstream attempts, by engine and kind.",
            ["engine", "kind"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "kvgate_gateway_client_disconnects",
            "Requests whose client went away before the end (upstream cancelled).",
            registry=r,
        )
        self.engine_up = Gauge(
            "kvgate_gateway_engine_up",
            "1 when the gateway may send requests to the engine (circuit not open, not draining).",
            ["engine"],
            registry=r,
        )
        self.engine_circuit = Gauge(
            "kvgate_gateway_engine_circuit_state",
            "Circuit breaker state: 0 closed, 1 open, 2 half-open.",
            ["engine"],
            registry=r,
        )
        self.engine_inflight = Gauge(
            "kvgate_gateway_engine_inflight_requests",
            "Requests this gateway has open on the engine.",
            ["engine"],
            registry=r,
        )
        self.engine_ejections = Counter(
            "kvgate_gateway_engine_ejections",
            "Times an engine's circuit opened.",
            ["engine"],
            registry=r,
        )
        self.router_degraded = Gauge(
            "kvgate_gateway_router_degraded",
            "1 while the router (or its broker) is unavailable and the gateway routes by "
            "least load on the last known engine list.",
            registry=r,
        )
        self.fallback_decisions = Counter(
            "kvgate_gateway_fallback_decisions",
            "Requests routed by the gateway's own least-load fallback, by cause.",
            ["cause"],
            registry=r,
        )
        self.broker_lag = Gauge(
            "kvgate_gateway_broker_lag_seconds",
            "Age of the newest event the embedded router has applied (NaN when unknown).",
            registry=r,
        )
        self.broker_lag.set(float("nan"))
        self.open_streams = Gauge(
            "kvgate_gateway_open_streams",
            "Streaming responses being relayed now.",
            registry=r,
        )
        self.connections = ConnectionStats()  # the HTTP server counts into this
        r.register(ConnectionCollector(self.connections))
        self.known_engines: set[str] = set()
        self._children: dict[tuple, object] = {}

    def child(self, metric: Counter | Histogram | FastCounter | FastHistogram, *labels: str):
        """``metric.labels(*labels)``, cached: label lookups are on every request's path."""
        key = (id(metric), *labels)
        c = self._children.get(key)
        if c is None:
            if len(self._children) > 10_000:  # label sets are bounded; this is a safety net
                self._children.clear()
            c = self._children[key] = metric.labels(*labels)
        return c

    def refresh_engines(self, pool: EnginePool, now: float) -> None:
        """Engine gauges from the pool's current state (on scrape, so they are never stale)."""
        current = set(pool.engines)
        for gone in self.known_engines - current:
            for g in (self.engine_up, self.engine_circuit, self.engine_inflight):
                try:
                    g.remove(gone)
                except KeyError:
                    pass
        self.known_engines = current
        for e in pool.engines.values():
            usable = e.breaker.usable(now) and not e.draining
            self.engine_up.labels(e.engine_id).set(1 if usable else 0)
            self.engine_circuit.labels(e.engine_id).set(CIRCUIT_CODES[e.breaker.state])
            self.engine_inflight.labels(e.engine_id).set(e.inflight)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
