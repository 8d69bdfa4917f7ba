"""The gateway's configuration: one frozen dataclass built once by the CLI (or a test).

Pure: parsing ``--engine ID=URL[,MODEL...]`` and ``--chat-template [MODEL=]PATH`` lives here so the
CLI, the demo and tests build the same :class:`GatewayConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.cli_support import check_http_url

MiB = 1024 * 1024
# the gateway's own HTTP server (gateway.httpserver): a request's whole head, and its whole body,
# must arrive within these of their first byte; open connections per worker are capped
HEAD_TIMEOUT_S = 30.0
BODY_TIMEOUT_S = 300.0
MAX_CONNECTIONS = 10_000


@dataclass(frozen=True, slots=True)
class StaticEngine:
    """An engine configured by hand (``--engine``); its models are discovered when not given."""

    engine_id: str
    url: str
    models: tuple[str, ...] = ()
    role: str = "both"  # prefill, decode or both (prefill/decode disaggregation)


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Passive ejection: open after ``failures`` consecutive failures, probe after a cooldown
    that doubles on every failed probe up to ``max_cooldown_s``."""

    failures: int = 3
    cooldown_s: float = 2.0
    max_cooldown_s: float = 30.0


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything the proxy needs; durations in seconds."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 8 * MiB
    head_timeout_s: float = HEAD_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS  # per worker; over it a connection gets 503
    connect_timeout_s: float = 2.0
    idle_timeout_s: float = 120.0  # no upstream byte for this long: give up (stream or not)
    route_timeout_s: float = 1.0  # a router that does not answer in time counts as unavailable
    max_retries: int = 2  # extra attempts on another engine (connection failure / 5xx)
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    refresh_interval_s: float = 1.0  # how often the router's engine list is re-read
    # the embedded router's broker must fail its health checks this long before the gateway
    # routes without the router (a few seconds of stale events beat least load)
    broker_grace_s: float = 5.0
    drain_timeout_s: float = 30.0  # graceful shutdown: how long open streams may finish
    # before the gateway is ready (its router caught up, an engine known) a request waits
    # this long for it, then gets 503 with Retry-After
    ready_wait_s: float = 5.0
    debug_header: bool = False  # always add x-kvgate-route (else only on x-kvgate-debug: 1)
    admin_token: str | None = None
    access_log: bool = True
    static_engines: tuple[StaticEngine, ...] = ()
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    default_max_tokens: int = 256  # routing estimate when a request states no max_tokens
    bytes_per_token: float = 4.0  # routing estimate of input tokens from key bytes
    busy_poll: bool = False  # poll without sleeping while requests are open (gateway.busypoll)
    forward_slo: str = "none"  # --forward-slo: the SLO in vllm_xargs (kvgate.slo_forward)


def parse_engine_spec(spec: str) -> StaticEngine:
    """``ID=URL[,MODEL...][,role=ROLE]`` -> :class:`StaticEngine` (ValueError with the reason
    if invalid)."""
    engine_id, sep, rest = spec.partition("=")
    if not sep or not engine_id.strip() or not rest.strip():
        raise ValueError(f"--engine {spec!r}: expected ID=URL[,MODEL...][,role=ROLE]")
    url, *items = (p.strip() for p in rest.split(","))
    models = tuple(m for m in items if m and not m.startswith("role="))
    roles = [m.removeprefix("role=") for m in items if m.startswith("role=")]
    role = roles[-1] if roles else "both"
    if role not in ("both", "prefill", "decode"):
        raise ValueError(f"--engine {spec!r}: role must be both, prefill or decode")
    return StaticEngine(
        engine_id.strip(), check_http_url(url, f"--engine {engine_id}"), models, role
    )


def parse_template_spec(spec: str) -> tuple[str | None, str]:
    """``[MODEL=]PATH`` -> (model or None for every model, path)."""
    model, sep, path = spec.partition("=")
    if not sep:
        return None, spec
    if not model or not path:
        raise ValueError(f"--chat-template {spec!r}: expected [MODEL=]PATH")
    return model, path
