"""The gateway: an app factory around one proxy handler, served by the gateway's own HTTP/1.1
server (:mod:`gateway.httpserver`) with its own upstream client (:mod:`gateway.upstream`).

Per request the handler validates the body (``kvgate.openai_request``), asks the router once
(embedded or remote, behind the :class:`router.api.RoutingService` protocol), forwards the
original body bytes to the chosen engine and relays the answer; SSE chunk by chunk as it arrives.
A connection failure or a 5xx before the first byte is retried on the next-best engine (the
failed one excluded), at most ``max_retries`` times. Background work (engine list refresh, active
health checks, outcome reports to the router) runs from :meth:`Gateway.start` to
:meth:`Gateway.stop`.

When the router cannot be reached, or says it knows no live engine while the gateway's own
health checks find some, or its broker is down, the gateway keeps serving on the last known engine
list by least load (its own in-flight counts) and says so in ``kvgate_gateway_router_degraded``
and in the logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import math
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import orjson
from aiohttp import web

from gateway.busypoll import BusyPoll
from gateway.config import GatewayConfig
from gateway.errors import error_response, from_request_error
from gateway.httpserver import (
    HttpServer,
    Request,
    Response,
    Routes,
    StreamResponse,
    encode_header_lines,
    json_response,
)
from gateway.metrics import GatewayMetrics
from gateway.pool import EnginePool, Transition
from gateway.upstream import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)
from kvgate.aio import stop_tasks
from kvgate.kv_transfer import decode_body, prefill_body, returned_params
from kvgate.logs import AccessLog, LogOnce, request_id_var
from kvgate.openai_request import (
    KV_TRANSFER_PARAM,
    ChatTemplate,
    Endpoint,
    RequestError,
    client_request_id,
    parse_request,
)
from kvgate.slo import Slo
from kvgate.slo_forward import forward_body
from router.api import Decision, EngineInfo, Outcome, RouteRequest, RoutingService
from router.pd import decode_id

log = logging.getLogger("kvgate.gateway")

REQUEST_ID = "x-request-id"
ROUTE_HEADER = "x-kvgate-route"
WORKER_HEADER = "x-kvgate-worker"  # the gateway process's pid, on debug responses
DEBUG_HEADER = "x-kvgate-debug"
FALLBACK_POLICY = "gateway_fallback"
READY_POLL_S = 0.02  # how often a gateway that is not ready yet checks again
# Stopping the background jobs waits this long at most: each job is bounded by its own timeouts
# (route_timeout_s, health_timeout_s, the broker ping's), well below it.
STOP_TIMEOUT_S = 5.0


def _completion_tokens(body: bytes) -> int:
    """An OpenAI answer's ``usage.completion_tokens`` (0: none, or not an answer)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return 0
    usage = doc.get("usage") if isinstance(doc, dict) else None
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return n if type(n) is int and n > 0 else 0


class _Access:
    """What the access log says of one request, filled in as the request goes (attribute
    sets only: the line is built once, at the end, and only when the log is on)."""

    __slots__ = (
        "decode_engine",
        "decode_wait_s",
        "detail",
        "engine",
        "error",
        "matched_bytes",
        "max_tokens",
        "model",
        "overhead_events",
        "policy",
        "prefill_s",
        "reason",
        "retries",
        "slo",
        "stream",
        "tried",
        "ttft_s",
        "upstream_status",
    )

    def __init__(self) -> None:
        self.model: str | None = None
        self.stream: bool | None = None
        self.slo: str | None = None
        self.engine: str | None = None
        self.policy: str | None = None
        self.reason: str | None = None
        self.detail = ""
        self.matched_bytes = 0
        self.retries = 0
        self.tried: set[str] | None = None
        self.upstream_status: int | None = None
        self.error: str | None = None
        self.ttft_s: float | None = None
        self.decode_engine: str | None = None  # disaggregated: the decode engine (last tried)
        self.prefill_s: float | None = None  # ... the prefill phase (its engine's answer)
        self.decode_wait_s: float | None = None  # ... the decode request to its first byte
        # the cap told to the router (its max_tokens, stated or the default), and the SSE data
        # events of a streamed answer that carry no token (a chat's role chunk, a usage chunk)
        self.max_tokens = 0
        self.overhead_events = 0

    def fields(self, path: str, status: int, duration_s: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "path": path,
            "status": status,
            "model": self.model,
            "stream": self.stream,
            "slo": self.slo,
            "engine": self.engine,
            "policy": self.policy,
            "reason": self.reason,
            "matched_bytes": self.matched_bytes,
            "retries": self.retries,
            "upstream_status": self.upstream_status,
            "ttft_ms": None if self.ttft_s is None else round(self.ttft_s * 1e3, 3),
            "duration_ms": round(duration_s * 1e3, 3),
        }
        if self.detail:
            out["detail"] = self.detail
        if self.tried:
            out["failed_engines"] = sorted(self.tried)
        if self.error is not None:
            out["upstream_error"] = self.error
        if self.decode_engine is not None:
            out["decode_engine"] = self.decode_engine
            out["prefill_ms"] = None if self.prefill_s is None else round(self.prefill_s * 1e3, 3)
            out["decode_first_byte_ms"] = (
                None if self.decode_wait_s is None else round(self.decode_wait_s * 1e3, 3)
            )
        return out


# Hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp recomputes: never copied across.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "date",
        "server",
    }
)
# As lower-cased bytes: the server and the upstream client give header names that way.
# (``Expect: 100-continue`` was answered by the gateway, which has the whole body.)
_NOT_FORWARDED = frozenset(h.encode() for h in _HOP | {DEBUG_HEADER, REQUEST_ID, "expect"})
_NOT_RELAYED = frozenset(h.encode() for h in _HOP | {REQUEST_ID, ROUTE_HEADER, WORKER_HEADER})
HEALTH_BODY_LIMIT = 1 << 20  # a /health or /v1/models answer larger than this is a failure
# What of the client's head goes to an engine: engines refuse big heads with a plain-text 400
# that says nothing useful (aiohttp: over 128 fields or a line over 8,190 bytes; uvicorn on
# h11: a head over 16 KiB), so the gateway sends at most this much, in the first fields.
MAX_FORWARDED_FIELDS = 64
MAX_FORWARDED_FIELD_BYTES = 8000
MAX_FORWARDED_HEAD_BYTES = 16 * 1024
_JSON_TYPE = b"content-type: application/json\r\n"

StatsProvider = Callable[[], Awaitable[Mapping[str, Any]]]
DrainHook = Callable[[str, bool], None]


@dataclass(frozen=True, slots=True)
class _Route:
    endpoint: Endpoint
    path: str


@dataclass(slots=True)
class _TwoPhase:
    """One disaggregated request as it goes through its phases (``Gateway._two_phase``)."""

    request: Request
    route: _Route
    body: dict[str, Any]  # the client's body as forwarded (SLO fields included)
    rid: str
    decision: Decision  # the pair (a decode retry replaces it)
    debug: bool
    start: float
    access: _Access
    ask: RouteRequest  # what the router was asked (a decode retry asks it again)
    decode_started: float = 0.0


class Gateway:
    """The proxy's state and handlers; built by :func:`create_app`."""

    def __init__(
        self,
        config: GatewayConfig,
        routing: RoutingService,
        *,
        templates: Mapping[str | None, ChatTemplate] | None = None,
        default_slo: Slo | None = None,
        stats: StatsProvider | None = None,
        on_drain: DrainHook | None = None,
    ) -> None:
        self.config = config
        self.routing = routing
        self.templates = dict(templates or {})
        self.default_slo = default_slo
        self.stats = stats
        self.on_drain = on_drain
        self.pool = EnginePool(config.breaker)
        self.pool.add_static(config.static_engines)
        self.metrics = GatewayMetrics()
        self.upstream: UpstreamPool | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False  # the background loops end (a cancel() alone may be lost)
        self.shutting_down = False
        self.access_log = AccessLog() if config.access_log else None
        # Ready (latched): the routing service says it is (an embedded router has caught up
        # with its broker and knows an engine; a remote one answers /ready), and an engine is
        # usable. Until then requests wait for it (``ready_wait_s``), then get 503.
        self.ready_at: float | None = None
        self._ready_event = asyncio.Event()
        self._routing_ready: Callable[[], Awaitable[bool]] | None = getattr(routing, "ready", None)
        self.router_failed_at: float | None = None  # last time route()/engines() failed
        self.broker_ok = True
        self.broker_failing_since: float | None = None
        self.degraded = False
        self.last_refresh = -math.inf
        # outcomes for the router, and (outcome None) the TTFTs of streamed answers
        self.reports: asyncio.Queue[tuple[str, str, Outcome | None, float]] = asyncio.Queue(
            maxsize=10_000
        )
        self.log_once = LogOnce(log, every_s=60.0)
        self.open_streams = 0
        self.busy_poll = BusyPoll() if self.config.busy_poll else None
        self.pid = str(os.getpid())  # which worker answered (``--workers N``)
        # Request ids: random, not secret. Seeded per Gateway, so forked workers differ; one
        # getrandom() syscall per request was a visible cost.
        self._ids = random.Random(os.urandom(16))
        # An embedded router answers synchronously inside its coroutine: a timeout could never
        # fire, so the per-call timer (a visible share of a proxied request) is skipped.
        self._needs_timeout = not _is_embedded(routing)

    # ---- degraded mode -------------------------------------------------------------------

    def _set_degraded(self, cause: str | None) -> None:
        now_degraded = cause is not None
        if now_degraded != self.degraded:
            self.degraded = now_degraded
            self.metrics.router_degraded.set(1 if now_degraded else 0)
            if now_degraded:
                log.warning(
                    "router unavailable: routing by least load on the last known engines",
                    extra={"cause": cause, "engines": len(self.pool.engines)},
                )
            else:
                log.info("router available again: routing through it")

    def _broker_health(self, ok: bool, now: float) -> None:
        """The embedded router's broker counts as down once its checks have failed for
        ``broker_grace_s``: a ping that times out on a busy machine must not turn off the
        router (measured: one such second sent 45 of 300 requests by least load)."""
        if ok:
            self.broker_failing_since = None
            if not self.broker_ok:
                self.broker_ok = True
            return
        if self.broker_failing_since is None:
            self.broker_failing_since = now
        if self.broker_ok and now - self.broker_failing_since >= self.config.broker_grace_s:
            self.broker_ok = False
            log.warning("broker unavailable: the router's view is frozen")

    def _router_usable(self, now: float) -> bool:
        """After a router failure, skip it for a second instead of paying its timeout on every
        request; the refresher keeps probing it meanwhile."""
        failed = self.router_failed_at
        return self.broker_ok and (failed is None or now - failed > 1.0)

    def _router_failed(self, exc: BaseException, what: str) -> None:
        self.router_failed_at = time.monotonic()
        self.log_once.warning(f"router-{what}", "router %s failed: %r", what, exc)
        self._set_degraded(f"router {what} failed: {exc!r}")

    # ---- background work -----------------------------------------------------------------

    async def refresh_engines(self) -> None:
        """Re-read the router's engine list (and its stats); on failure keep the last one."""
        self.last_refresh = time.monotonic()
        try:
            async with asyncio.timeout(self.config.route_timeout_s):
                infos: list[EngineInfo] = await self.routing.engines()
        except Exception as exc:  # any failure of the router: keep serving without it
            self._router_failed(exc, "engines")
            return
        self.pool.merge_router_list(infos)
        if self.stats is not None:
            try:
                st = await self.stats()
            except Exception as exc:
                self.log_once.warning("router-stats", "router stats failed: %r", exc)
                st = {}
            lag = st.get("broker_lag_s")
            self.metrics.broker_lag.set(float(lag) if lag is not None else math.nan)
            ok = st.get("broker_ok")
            if ok is not None:
                self._broker_health(bool(ok), time.monotonic())
        if not self.broker_ok:
            self._set_degraded("broker unavailable")
        elif self.router_failed_at is None or time.monotonic() - self.router_failed_at > 1.0:
            self.router_failed_at = None
            self._set_degraded(None)

    async def _get(self, url: str, path: str) -> tuple[int, bytes]:
        """A GET to an engine through the upstream pool: (status, body)."""
        assert self.upstream is not None
        r = await self.upstream.request(self.upstream.target(url, path), b"GET")
        try:
            return r.status, await r.read(HEALTH_BODY_LIMIT)
        finally:
            r.close()

    async def check_health(self) -> None:
        """Probe every engine's ``GET /health`` (and learn the models of static engines)."""

        async def probe(engine_id: str, url: str, need_models: bool) -> None:
            error = ""
            try:
                async with asyncio.timeout(self.config.health_timeout_s):
                    status, _ = await self._get(url, "/health")
                    ok = status < 500
                    error = "" if ok else f"/health answered {status}"
                    if ok and need_models:
                        _, body = await self._get(url, "/v1/models")
                        data = orjson.loads(body)
                        models = [m["id"] for m in data.get("data", []) if "id" in m]
                        self.pool.set_models(engine_id, models)
            except (
                UpstreamError,
                TimeoutError,
                ValueError,
                KeyError,
                TypeError,
                AttributeError,
            ) as exc:
                ok, error = False, repr(exc)
            self._engine_transition(
                engine_id, self.pool.health_result(engine_id, ok, time.monotonic(), error), error
            )

        await asyncio.gather(
            *(probe(e.engine_id, e.url, not e.models) for e in list(self.pool.engines.values()))
        )

    async def _every(self, interval: float, job: Callable[[], Awaitable[None]]) -> None:
        # Not ``while True``: a job that talks to Redis can swallow the cancel() meant to stop
        # this loop (kvgate.aio), which then has to notice the stop by itself.
        while not self._stopping:
            await asyncio.sleep(interval)
            if self._stopping:
                return
            try:
                await job()
            except Exception:  # a background job must never die
                log.exception("background job %s failed", getattr(job, "__name__", job))

    async def _report_loop(self) -> None:
        """Send queued outcomes, everything queued at once per wake-up (under load many
        requests finish between two turns of the loop)."""
        reports = self.reports
        while not self._stopping:
            batch = [await reports.get()]
            while not reports.empty():
                batch.append(reports.get_nowait())
            for rid, engine_id, outcome, ttft_ms, answer in batch:
                try:
                    if self._needs_timeout:
                        async with asyncio.timeout(self.config.route_timeout_s):
                            await self._send_report(rid, engine_id, outcome, ttft_ms, answer)
                    else:
                        await self._send_report(rid, engine_id, outcome, ttft_ms, answer)
                except Exception as exc:
                    self.log_once.warning("router-report", "router report failed: %r", exc)

    async def _send_report(
        self,
        rid: str,
        engine_id: str,
        outcome: Outcome | None,
        ttft_ms: float,
        answer: tuple[int, int],
    ) -> None:
        if outcome is None:
            await self.routing.first_token(rid, engine_id, ttft_ms)
        else:
            await self.routing.report(rid, engine_id, outcome, *answer)

    def _report(
        self,
        rid: str,
        engine_id: str,
        outcome: Outcome | None,
        ttft_ms: float = 0.0,
        answer: tuple[int, int] = (0, 0),
    ) -> None:
        """Queue an outcome for the router, or (``outcome`` None) the TTFT of a streamed
        answer; ``answer``: its length in tokens and the cap told to the router (0: unknown),
        from which a router learns how long answers are for engines that do not say.
        Reporting never delays the response."""
        try:
            self.reports.put_nowait((rid, engine_id, outcome, ttft_ms, answer))
        except asyncio.QueueFull:
            self.log_once.warning("report-queue", "router report queue full: dropping outcomes")

    async def start(self) -> None:
        """Upstream pool, first refresh and probes, then the periodic jobs."""
        self.upstream = UpstreamPool(
            connect_timeout_s=self.config.connect_timeout_s,
            idle_timeout_s=self.config.idle_timeout_s,
        )
        self._stopping = False
        await self.refresh_engines()
        await self.check_health()
        self._tasks = [
            asyncio.create_task(self._become_ready()),
            asyncio.create_task(self._every(self.config.refresh_interval_s, self.refresh_engines)),
            asyncio.create_task(self._every(self.config.health_interval_s, self.check_health)),
            asyncio.create_task(self._report_loop()),
        ]

    async def stop(self) -> None:
        """Stop the periodic jobs (bounded: a job may swallow its cancellation, see
        :mod:`kvgate.aio`) and close the upstream connections."""
        tasks, self._tasks = self._tasks, []
        self._stopping = True
        if self.busy_poll is not None:
            self.busy_poll.close()
        await stop_tasks(tasks, STOP_TIMEOUT_S, what="gateway background job")
        if self.upstream is not None:
            await self.upstream.close()

    async def _become_ready(self) -> None:
        """Check readiness until it holds, then latch it and release the waiting requests."""
        while self.ready_at is None and not self._stopping:
            try:
                if await self._check_ready():
                    return
            except Exception:  # a background job must never die
                log.exception("readiness check failed")
            await asyncio.sleep(READY_POLL_S)

    async def _check_ready(self) -> bool:
        probe = self._routing_ready
        if probe is not None and not await probe():
            return False
        await self.refresh_engines()  # the engines the router knows now, not a second ago
        usable = len(self.pool.usable(None, time.monotonic()))
        if not usable:
            return False
        self.ready_at = time.monotonic()
        self._ready_event.set()
        log.info("gateway ready: routing caught up, %d usable engines", usable)
        return True

    async def _wait_ready(self) -> bool:
        """Wait up to ``ready_wait_s`` for readiness (a request that came too early)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.ready_wait_s):
                await self._ready_event.wait()
        return self.ready_at is not None

    def on_shutdown(self) -> None:
        """Stop advertising readiness; the server then lets open streams finish."""
        self.shutting_down = True
        log.info("shutting down: draining %d open streams", self.open_streams)

    # ---- routing ------------------------------------------------------------------------

    def _fallback(self, req: RouteRequest, now: float, cause: str) -> Decision:
        e = self.pool.least_loaded(req.model, req.exclude, now)
        self.metrics.fallback_decisions.labels(cause).inc()
        if e is None:
            return Decision(
                None, None, "shed", FALLBACK_POLICY, retry_after_s=1.0, detail="no usable engine"
            )
        return Decision(e.engine_id, e.url, "least_load", FALLBACK_POLICY, detail=cause)

    async def decide(self, req: RouteRequest) -> Decision:
        """The router's answer, or the gateway's least-load fallback when it cannot give one."""
        now = time.monotonic()
        if not self._router_usable(now):
            return self._fallback(req, now, "router_unavailable")
        try:
            if self._needs_timeout:
                async with asyncio.timeout(self.config.route_timeout_s):
                    d = await self.routing.route(req)
            else:
                d = await self.routing.route(req)
        except Exception as exc:  # remote router down, timeout, or a router bug
            self._router_failed(exc, "route")
            return self._fallback(req, now, "router_unavailable")
        # The router knows no live engine for the model (its broker lost them) while the
        # gateway still has engines it can reach: serve rather than shed.
        if (
            d.shed
            and self.pool.router_alive_for(req.model) == 0
            and self.pool.usable(req.model, now)
        ):
            return self._fallback(req, now, "router_has_no_engines")
        if d.engine_id is not None and d.engine_id not in self.pool.engines:
            self.pool.merge_router_list([EngineInfo(d.engine_id, d.url or "", (req.model,), True)])
        return d

    # ---- the proxy ----------------------------------------------------------------------

    @staticmethod
    def _read_json(request: Request) -> tuple[bytes, Any]:
        """The body (its size was checked by the server: 413) and its JSON, which the gateway
        can write again (orjson reads 1,024 levels of nesting but writes 254: a body between
        the two failed with a 500 where the gateway re-encodes it)."""
        raw = request.body
        if not raw:
            raise RequestError("request body is empty; expected a JSON object")
        try:
            doc = orjson.loads(raw)
            orjson.dumps(doc)
        except orjson.JSONDecodeError as exc:
            raise RequestError(f"request body is not valid JSON: {exc}") from None
        except TypeError as exc:
            raise RequestError(f"request body is nested too deeply: {exc}") from None
        return raw, doc

    def _forward_headers(self, request: Request, rid: bytes) -> bytes:
        """The head for the engine: ``Content-Type: application/json`` (the body is JSON the
        gateway parsed, whatever the client called it), the request id, and the client's own
        fields as received (Authorization for an engine's API key, the SLO headers, tracing),
        each name once with its first value (the one the gateway itself read), never a
        hop-by-hop one (RFC 9110's, and those the client's Connection names), one over
        ``MAX_FORWARDED_FIELD_BYTES``, nor past ``MAX_FORWARDED_FIELDS`` or
        ``MAX_FORWARDED_HEAD_BYTES``: the engine would refuse the whole head. Dropped fields
        are logged (once a minute). Encoded once per request."""
        skip = _NOT_FORWARDED
        seen = {b"content-type"}
        if "connection" in request.headers:  # (every Connection field: each may name some)
            for n, v in request.fields:
                if n == b"connection":
                    seen.update(t.strip().lower() for t in v.split(b","))
        lines = [_JSON_TYPE]
        size = dropped = 0
        for n, v in request.fields:
            if n in skip or n in seen:
                continue
            seen.add(n)
            line = n + b": " + v + b"\r\n"
            size += len(line)
            if (
                len(line) > MAX_FORWARDED_FIELD_BYTES
                or size > MAX_FORWARDED_HEAD_BYTES
                or len(lines) > MAX_FORWARDED_FIELDS
            ):
                size -= len(line)
                dropped += 1
                continue
            lines.append(line)
        if dropped:
            self.log_once.warning(
                "dropped-fields",
                "not forwarded to engines: %d client header fields over the gateway's limits "
                "(%d fields, %d bytes each, %d bytes in all)",
                dropped,
                MAX_FORWARDED_FIELDS,
                MAX_FORWARDED_FIELD_BYTES,
                MAX_FORWARDED_HEAD_BYTES,
            )
        lines.append(b"x-request-id: " + rid + b"\r\n")
        return b"".join(lines)

    def _response_headers(
        self, upstream: UpstreamResponse, rid: bytes, decision: Decision, debug: bool
    ) -> bytes:
        """The engine's header lines for the client (hop-by-hop ones dropped), plus ours."""
        skip = _NOT_RELAYED
        lines = [n + b": " + v + b"\r\n" for n, v in upstream.fields if n not in skip]
        lines.append(b"x-request-id: " + rid + b"\r\n")
        if debug:
            debug_pairs = ((ROUTE_HEADER, decision.header_value()), (WORKER_HEADER, self.pid))
            lines.append(encode_header_lines(debug_pairs))
        return b"".join(lines)

    async def handle(self, request: Request, route: _Route) -> Response | StreamResponse:
        """The proxy handler of both OpenAI endpoints."""
        start = time.perf_counter()
        rid = (
            client_request_id(request.headers.get(REQUEST_ID))
            or f"{self._ids.getrandbits(128):032x}"
        )
        token = request_id_var.set(rid)
        status = 499  # a cancelled handler: the client went away
        access = _Access()
        busy = self.busy_poll
        if busy is not None:
            busy.enter()
        try:
            try:
                resp = await self._proxy(request, route, rid, start, access)
            except RequestError as exc:
                resp = from_request_error(exc, {REQUEST_ID: rid})
            status = resp.status
            return resp
        finally:
            if busy is not None:
                busy.leave()
            m = self.metrics
            m.child(m.requests, route.path, str(status)).inc()
            alog = self.access_log
            if alog is not None and alog.enabled():
                alog.write(access.fields(route.path, status, time.perf_counter() - start))
            request_id_var.reset(token)

    async def _proxy(
        self, request: Request, route: _Route, rid: str, start: float, access: _Access
    ) -> Response | StreamResponse:
        raw, body = self._read_json(request)
        model = body.get("model") if isinstance(body, dict) else None
        template = self.templates.get(model) if isinstance(model, str) else None
        if template is None:
            template = self.templates.get(None)
        parsed = parse_request(
            route.endpoint, body, request.headers, template=template, default_slo=self.default_slo
        )
        if body.get(KV_TRANSFER_PARAM) is not None:
            # the gateway's to set (its two-phase requests to disaggregated engines): a
            # client's made an engine fetch KV from wherever it named and fail with a 5xx, and
            # the gateway took the engine for broken and ejected it
            raise RequestError(
                f"'{KV_TRANSFER_PARAM}' is set by the gateway, not by clients",
                param=KV_TRANSFER_PARAM,
            )
        access.model = parsed.model
        access.stream = parsed.stream
        access.slo = parsed.slo.name
        if self.ready_at is None and not await self._wait_ready():
            access.detail = "not ready"
            return error_response(
                503,
                "the gateway is not ready yet: its router is catching up with the broker or "
                "knows no engine",
                code="not_ready",
                headers={REQUEST_ID: rid, "Retry-After": "1"},
            )
        if not self.pool.serves(parsed.model):
            if time.monotonic() - self.last_refresh > 0.25:
                await self.refresh_engines()
            if not self.pool.serves(parsed.model):
                raise RequestError(
                    f"The model '{parsed.model}' does not exist or no engine serves it",
                    status=404,
                    param="model",
                    code="model_not_found",
                )
        debug = self.config.debug_header or request.headers.get(DEBUG_HEADER) == "1"
        cfg = self.config
        input_tokens = parsed.hint.input_tokens or max(
            1, math.ceil(len(parsed.key) / cfg.bytes_per_token)
        )
        max_tokens = parsed.max_tokens or parsed.hint.output_tokens or cfg.default_max_tokens
        access.max_tokens = max_tokens
        access.overhead_events = (route.endpoint == "chat") + parsed.include_usage
        rid_b = rid.encode("utf-8", "surrogateescape")
        headers = self._forward_headers(request, rid_b)
        fbody = body
        if cfg.forward_slo != "none":  # the SLO where vLLM's scheduler sees it
            fbody = forward_body(body, parsed.slo, rid, cfg.forward_slo)
            raw = orjson.dumps(fbody)
        m = self.metrics
        tried: set[str] = set()
        for attempt in range(cfg.max_retries + 1):
            now = time.monotonic()
            t_route = time.perf_counter()
            blocked = self.pool.blocked(now)
            ask = RouteRequest(
                request_id=rid,
                model=parsed.model,
                key=parsed.key,
                input_tokens=input_tokens,
                max_tokens=max_tokens,
                slo=parsed.slo,
                session=parsed.session,
                exclude=blocked | tried if tried else blocked,
            )
            decision = await self.decide(ask)
            m.route_seconds.observe(time.perf_counter() - t_route)
            m.child(m.decisions, decision.policy, decision.reason).inc()
            access.retries = attempt
            access.engine = decision.engine_id
            access.policy = decision.policy
            access.reason = decision.reason
            access.detail = decision.detail
            access.matched_bytes = decision.matched_bytes
            if decision.reason == "too_long":  # not an overload: no retry would serve it
                param = "messages" if route.endpoint == "chat" else "prompt"
                raise RequestError(
                    f"This request exceeds the maximum context length of every engine serving "
                    f"{parsed.model!r} ({decision.detail}). Please reduce the length of the "
                    f"{param} or completion.",
                    param=param,
                    code="context_length_exceeded",
                )
            if decision.shed:
                retry_after = max(1, math.ceil(decision.retry_after_s or 1.0))
                if tried:  # every engine left has failed this request
                    return error_response(
                        502,
                        "no engine could serve the request: " + ", ".join(sorted(tried)),
                        code="upstream_unavailable",
                        headers={REQUEST_ID: rid},
                    )
                return error_response(
                    429,
                    "no engine can meet this request's SLO now"
                    + (f": {decision.detail}" if decision.detail else ""),
                    code="slo_shed",
                    headers={REQUEST_ID: rid, "Retry-After": str(retry_after)},
                )
            m.matched_bytes.observe(decision.matched_bytes)
            engine_id = decision.engine_id
            assert engine_id is not None
            url = decision.url or self.pool.engines[engine_id].url
            if decision.disaggregated:
                pd = _TwoPhase(request, route, fbody, rid, decision, debug, start, access, ask)
                result = await self._two_phase(pd, attempt == cfg.max_retries, tried)
                if result is not None:
                    return result
                access.tried = tried
                self.metrics.retries.labels("upstream_failure").inc()
                continue
            result = await self._forward(
                request,
                route,
                raw,
                headers,
                engine_id,
                url,
                rid,
                rid_b,
                decision,
                debug,
                start,
                attempt == cfg.max_retries,
                access,
            )
            if result is not None:
                return result
            tried.add(engine_id)
            access.tried = tried
            self.metrics.retries.labels("upstream_failure").inc()
        raise AssertionError("unreachable: the last attempt always answers")

    async def _two_phase(
        self, pd: _TwoPhase, last: bool, tried: set[str]
    ) -> Response | StreamResponse | None:
        """A disaggregated request (``kvgate.kv_transfer``): the prefill on the prefill engine
        (one token, its KV kept for a remote decode), then the client's own request with the
        returned ``kv_transfer_params`` on the decode engine, relayed as usual. None: retry the
        pair (engines that failed are in ``tried``). A decode engine that cannot be reached is
        replaced by another for the same prefill (its KV still waits); one that answers 5xx
        (the KV is gone, or it broke) makes the caller run the prefill again."""
        decision = pd.decision
        prefill = decision.engine_id
        assert prefill is not None and self.upstream is not None
        url = decision.url or self.pool.engines[prefill].url
        got = await self._prefill(pd, prefill, url, last)
        if got is None:
            tried.add(prefill)
            return None
        if not isinstance(got, dict):
            return got  # the prefill engine's own error (4xx), or the last attempt's 502
        params = got.get("params")
        cfg = self.config
        dec_rid = decode_id(pd.rid)
        headers = self._forward_headers(pd.request, dec_rid.encode("utf-8", "surrogateescape"))
        raw = orjson.dumps(decode_body(pd.body, params))
        decode_tried: set[str] = set()
        for attempt in range(cfg.max_retries + 1):
            engine_id = decision.decode_engine_id
            assert engine_id is not None
            if engine_id not in self.pool.engines:
                self.pool.merge_router_list(
                    [EngineInfo(engine_id, decision.decode_url or "", (pd.ask.model,), True)]
                )
            d_url = decision.decode_url or self.pool.engines[engine_id].url
            pd.access.decode_engine = engine_id
            pd.access.error = None
            pd.decode_started = time.perf_counter()
            final = last and attempt == cfg.max_retries
            result = await self._forward(
                pd.request,
                pd.route,
                raw,
                headers,
                engine_id,
                d_url,
                pd.rid,
                pd.rid.encode("utf-8", "surrogateescape"),
                decision,
                pd.debug,
                pd.start,
                final,
                pd.access,
                pd,
            )
            if result is not None:
                return result
            if pd.access.error != "connect":
                return None  # 5xx or a broken answer: run the prefill again
            decode_tried.add(engine_id)
            tried.add(engine_id)
            self.metrics.retries.labels("decode_failure").inc()
            now = time.monotonic()
            retry = await self.decide(
                replace(pd.ask, exclude=self.pool.blocked(now) | tried, prefilled_on=prefill)
            )
            if retry.shed or not retry.disaggregated:
                return None  # no decode engine for this prefill: the pair again
            decision = pd.decision = retry
        return None

    async def _prefill(
        self, pd: _TwoPhase, engine_id: str, url: str, last: bool
    ) -> dict | Response | None:
        """The prefill phase: ``{"params": the returned kv_transfer_params or None}``, the
        engine's own 4xx answer, a 502 on the last attempt, or None to retry elsewhere."""
        assert self.upstream is not None
        t0 = time.perf_counter()
        self.pool.started(engine_id, time.monotonic())
        rid_b = pd.rid.encode("utf-8", "surrogateescape")
        error = ""
        try:
            target = self.upstream.target(url, pd.route.path)
            upstream = await self.upstream.request(
                target,
                b"POST",
                self._forward_headers(pd.request, rid_b),
                orjson.dumps(prefill_body(pd.body)),
            )
            try:
                status = upstream.status
                out_headers = self._response_headers(upstream, rid_b, pd.decision, pd.debug)
                data = await upstream.read()
            finally:
                upstream.close()
        except asyncio.CancelledError:
            self._client_gone(engine_id, pd.rid)
            raise
        except (UpstreamError, ValueError) as exc:
            kind = "connect" if isinstance(exc, (UpstreamConnectError, ValueError)) else "read"
            pd.access.error = kind
            self._upstream_failed(engine_id, pd.rid, kind, str(exc))
            error = f"prefill engine {engine_id} failed: {exc}"
        else:
            pd.access.upstream_status = status
            if status >= 500:
                pd.access.error = f"http_{status}"
                self._upstream_failed(engine_id, pd.rid, f"http_{status}", "5xx")
                error = f"prefill engine {engine_id} answered {status}"
            elif status >= 400:  # the request's own fault (or an SLO rejection): relay it
                self.pool.released(engine_id)
                self._report(pd.rid, engine_id, "failed")
                return _engine_error(status, data, engine_id, pd.rid) or Response(
                    status, data, raw_headers=out_headers
                )
            else:
                try:
                    answer = orjson.loads(data)
                except orjson.JSONDecodeError:
                    answer = None
                if not isinstance(answer, dict):
                    pd.access.error = "prefill_answer"
                    self._upstream_failed(engine_id, pd.rid, "read", "prefill answer not JSON")
                    error = f"prefill engine {engine_id} gave no JSON answer"
                else:
                    self._engine_transition(
                        engine_id, self.pool.finished(engine_id, True, time.monotonic()), ""
                    )
                    pd.access.prefill_s = time.perf_counter() - t0
                    m = self.metrics
                    m.child(m.phase_seconds, "prefill").observe(pd.access.prefill_s)
                    return {"params": returned_params(answer)}
        if last:
            return error_response(
                502, error, code="upstream_unavailable", headers={REQUEST_ID: pd.rid}
            )
        return None

    def _engine_transition(self, engine_id: str, transition: Transition | None, error: str) -> None:
        """Log an engine's ejection once on the way down and once on the way back (the pool
        reports only those two transitions, not every failed probe in between)."""
        if transition == "ejected":
            self.metrics.engine_ejections.labels(engine_id).inc()
            log.warning(
                "engine %s ejected: %s",
                engine_id,
                error,
                extra={"engine": engine_id, "error": error},
            )
        elif transition == "readmitted":
            log.warning("engine %s readmitted", engine_id, extra={"engine": engine_id})

    def _upstream_failed(self, engine_id: str, rid: str, kind: str, error: str) -> None:
        self.metrics.upstream_errors.labels(engine_id, kind).inc()
        self._engine_transition(
            engine_id, self.pool.finished(engine_id, False, time.monotonic(), error), error
        )
        self._report(rid, engine_id, "failed")

    def _client_gone(self, engine_id: str, rid: str) -> None:
        self.pool.released(engine_id)
        self._report(rid, engine_id, "cancelled")
        self.metrics.client_disconnects.inc()

    async def _forward(
        self,
        request: Request,
        route: _Route,
        raw: bytes,
        headers: bytes,
        engine_id: str,
        url: str,
        rid: str,
        rid_b: bytes,
        decision: Decision,
        debug: bool,
        start: float,
        last: bool,
        access: _Access,
        pd: _TwoPhase | None = None,
    ) -> Response | StreamResponse | None:
        """One attempt on one engine: the response, or None to retry on another engine
        (``pd``: the decode phase of a disaggregated request, timed)."""
        assert self.upstream is not None
        self.pool.started(engine_id, time.monotonic())
        access.upstream_status = None
        try:
            target = self.upstream.target(url, route.path)
        except ValueError as exc:  # an engine URL the gateway cannot use (from the router)
            access.error = "connect"
            self._upstream_failed(engine_id, rid, "connect", repr(exc))
            if last:
                return error_response(
                    502,
                    f"engine {engine_id} has an unusable URL: {exc}",
                    code="upstream_unavailable",
                    headers={REQUEST_ID: rid},
                )
            return None
        sent = time.perf_counter()
        try:
            upstream = await self.upstream.request(target, b"POST", headers, raw)
        except asyncio.CancelledError:
            self._client_gone(engine_id, rid)
            raise
        except UpstreamError as exc:
            kind = "connect" if isinstance(exc, UpstreamConnectError) else "read"
            access.error = kind
            self._upstream_failed(engine_id, rid, kind, str(exc))
            log.warning("engine %s failed: %s", engine_id, exc, extra={"engine": engine_id})
            if last:
                return error_response(
                    504 if isinstance(exc, UpstreamTimeout) else 502,
                    f"engine {engine_id} failed before answering: {exc}",
                    code="upstream_unavailable" if kind == "connect" else "upstream_error",
                    headers={REQUEST_ID: rid},
                )
            return None
        relaying = False  # _relay_stream accounts for the stream's end itself, once
        try:
            status = access.upstream_status = upstream.status
            if pd is not None and status < 500:
                access.decode_wait_s = time.perf_counter() - pd.decode_started
                m = self.metrics
                m.child(m.phase_seconds, "decode_first_byte").observe(access.decode_wait_s)
            if status >= 500 and not last:
                if pd is not None and b"kv_transfer_failed" in await upstream.read():
                    # the decode engine is fine; the prefill engine no longer holds the KV
                    access.error = "kv_gone"
                    self.pool.released(engine_id)
                    self._report(rid, engine_id, "failed")
                    return None
                access.error = f"http_{status}"
                self._upstream_failed(engine_id, rid, f"http_{status}", "5xx")
                return None
            out_headers = self._response_headers(upstream, rid_b, decision, debug)
            if upstream.is_event_stream:
                relaying = True
                return await self._relay_stream(
                    request,
                    route,
                    upstream,
                    out_headers,
                    engine_id,
                    rid,
                    start,
                    access,
                    sent=None if pd is not None else sent,
                )
            data = await upstream.read()
        except asyncio.CancelledError:
            if not relaying:
                self._client_gone(engine_id, rid)
            raise
        except UpstreamError as exc:
            access.error = "read"
            self._upstream_failed(engine_id, rid, "read", str(exc))
            if last:
                return error_response(
                    504 if isinstance(exc, UpstreamTimeout) else 502,
                    f"engine {engine_id} failed before answering: {exc}",
                    code="upstream_error",
                    headers={REQUEST_ID: rid},
                )
            return None
        finally:
            upstream.close()  # a no-op once the body was read: the connection is back
        ok = status < 500
        error = "" if ok else f"answered {status}"
        self._engine_transition(
            engine_id, self.pool.finished(engine_id, ok, time.monotonic(), error), error
        )
        answer = (_completion_tokens(data), access.max_tokens) if status == 200 else (0, 0)
        self._report(rid, engine_id, "ok" if ok else "failed", answer=answer)
        m = self.metrics
        m.child(m.e2e, route.path, "false").observe(time.perf_counter() - start)
        if status >= 400:
            wrapped = _engine_error(status, data, engine_id, rid)
            if wrapped is not None:
                return wrapped
        return Response(status, data, raw_headers=out_headers)

    async def _relay_stream(
        self,
        request: Request,
        route: _Route,
        upstream: UpstreamResponse,
        out_headers: bytes,
        engine_id: str,
        rid: str,
        start: float,
        access: _Access,
        sent: float | None = None,
    ) -> StreamResponse:
        """Relay SSE bytes as they arrive, with no buffering and no hop through this task: the
        upstream connection hands each piece to ``forward`` from its ``data_received`` (push
        mode), which writes it to the client at once; this coroutine only waits for the end
        and drains a slow client. The headers go out with the first piece, and the last piece
        with the end of the body (one write each: each write is a syscall and a client
        wake-up). The first piece's time since the request went to the engine (``sent``; None:
        not reported, as for a disaggregated decode) goes to the router: for an engine that
        sends no request events it is the only word on when its prefill ended."""
        resp = StreamResponse(upstream.status, raw_headers=out_headers)
        self.open_streams += 1  # exported on scrape (a Gauge takes a lock per update)
        outcome: Outcome = "ok"
        first = True
        events = 0  # SSE data events relayed, [DONE] included: about one a token on vLLM
        ttft = self.metrics.child(self.metrics.ttft, route.path)

        def forward(piece: bytes, last: bool) -> bool:
            nonlocal first, events
            # an event's field starts a line, and a JSON string holds no raw newline: an
            # answer whose text says "data:" is not counted
            events += piece.count(b"\ndata:")
            if first and piece:
                events += piece.startswith(b"data:")
                first = False
                now = time.perf_counter()
                access.ttft_s = now - start
                ttft.observe(access.ttft_s)
                if sent is not None:
                    self._report(rid, engine_id, None, (now - sent) * 1000.0)
            try:
                return resp.send(piece, last)
            except ConnectionResetError:  # gone: the server cancels this task, which says so
                return True

        try:
            await resp.prepare(request)
            upstream.stream_to(forward)
            while True:
                try:
                    await upstream.relayed()
                except UpstreamError as exc:  # the engine broke or went idle mid-stream
                    outcome = "failed"
                    access.error = "stream"
                    self._upstream_failed(engine_id, rid, "stream", str(exc))
                    log.warning(
                        "stream from %s broke: %s", engine_id, exc, extra={"engine": engine_id}
                    )
                    err = error_response(502, f"engine {engine_id} stream broke: {exc}")
                    with contextlib.suppress(ConnectionResetError):
                        await resp.write(b"data: " + err.body + b"\n\n")
                        await resp.write_eof()
                    return resp
                if upstream.complete:
                    break
                await resp.drain()  # held: the client is slow; read on once it has room
                upstream.release()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):  # the client went away
            outcome = "cancelled"
            self.metrics.client_disconnects.inc()
            upstream.close()  # drop the upstream connection: the engine stops generating
            raise
        finally:
            self.open_streams -= 1
            now = time.monotonic()
            if outcome == "ok":
                self._engine_transition(engine_id, self.pool.finished(engine_id, True, now), "")
            elif outcome == "cancelled":
                self.pool.released(engine_id)
            if outcome == "ok":
                # an answer's tokens, as its events count them (each of vLLM's decode steps
                # sends one; less [DONE], a chat's role chunk and a usage chunk)
                tokens = events - 1 - access.overhead_events
                answer = (tokens, access.max_tokens) if tokens > 0 else (0, 0)
                self._report(rid, engine_id, outcome, answer=answer)
            elif outcome != "failed":
                self._report(rid, engine_id, outcome)
            m = self.metrics
            m.child(m.e2e, route.path, "true").observe(time.perf_counter() - start)

    # ---- other endpoints ----------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        if time.monotonic() - self.last_refresh > self.config.refresh_interval_s:
            await self.refresh_engines()
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "kvgate"}
            for m in self.pool.models()
        ]
        return json_response(orjson.dumps({"object": "list", "data": data}))

    async def health(self, request: Request) -> Response:
        return json_response(orjson.dumps({"status": "ok", "pid": int(self.pid)}))

    async def ready(self, request: Request) -> Response:
        usable = len(self.pool.usable(None, time.monotonic()))
        routing_ready = self.ready_at is not None
        ready = routing_ready and usable > 0 and not self.shutting_down
        body = {
            "ready": ready,
            "routing_ready": routing_ready,
            "usable_engines": usable,
            "degraded": self.degraded,
            "shutting_down": self.shutting_down,
        }
        headers = () if ready else (("Retry-After", "1"),)
        return json_response(orjson.dumps(body), 200 if ready else 503, headers)

    async def metrics_endpoint(self, request: Request) -> Response:
        self.metrics.refresh_engines(self.pool, time.monotonic())
        self.metrics.open_streams.set(self.open_streams)
        return Response(body=self.metrics.exposition(), content_type=self.metrics.content_type)

    def _authorized(self, request: Request) -> bool:
        token = self.config.admin_token or ""
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            value.strip().encode("utf-8", "surrogateescape"), token.encode()
        )

    def _unauthorized(self) -> Response:
        return error_response(
            401,
            "admin endpoints need 'Authorization: Bearer <admin token>'",
            code="invalid_admin_token",
            headers={"WWW-Authenticate": 'Bearer realm="kvgate-admin"'},
        )

    async def admin_engines(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        now = time.monotonic()
        body = {
            "degraded": self.degraded,
            "engines": [e.describe(now) for e in self.pool.engines.values()],
        }
        return json_response(orjson.dumps(body))

    async def admin_router(self, request: Request) -> Response:
        """The embedded router's state: its view of each engine (loads, measured TPOT, fitted
        speed, requests routed), its tree and its broker consumer, as a separate router's
        ``GET /state`` gives it. (With several workers, this worker's router.)"""
        if not self._authorized(request):
            return self._unauthorized()
        state = getattr(self.routing, "state", None)  # only the embedded router has it
        if state is None:
            return error_response(
                404, "the router runs apart from this gateway: read its GET /state"
            )
        return json_response(orjson.dumps(state()))

    async def admin_drain(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._unauthorized()
        engine_id = request.match_info["engine_id"]
        draining = request.match_info["action"] == "drain"
        if not self.pool.set_draining(engine_id, draining):
            return error_response(404, f"unknown engine {engine_id!r}", param="engine_id")
        if self.on_drain is not None:
            try:
                self.on_drain(engine_id, draining)
            except Exception as exc:  # e.g. an engine the router does not know: gateway-side only
                log.warning("router did not take the drain of %s: %r", engine_id, exc)
        log.info("engine %s %s", engine_id, "draining" if draining else "undrained")
        e = self.pool.engines[engine_id]
        return json_response(orjson.dumps(e.describe(time.monotonic())))


def _engine_error(status: int, data: bytes, engine_id: str, rid: str) -> Response | None:
    """An engine's error answer that is not JSON (aiohttp's plain-text 400 for a head it
    refuses, a proxy's HTML page) as OpenAI's JSON error, its text in the message, so that
    clients (the openai SDK) read it as any other error; None: a JSON object (OpenAI's error,
    or an older vLLM's top-level one), relayed as it is."""
    with contextlib.suppress(orjson.JSONDecodeError):
        if isinstance(orjson.loads(data), dict):
            return None
    text = data[:500].decode("utf-8", "replace").strip()
    return error_response(
        status,
        f"engine {engine_id} answered {status}" + (f": {text}" if text else ""),
        code="upstream_error",
        headers={REQUEST_ID: rid},
    )


def _is_embedded(routing: RoutingService) -> bool:
    """Is ``routing`` the in-process router (whose calls never wait on I/O)?"""
    try:
        from router.service import EmbeddedRouter
    except ImportError:  # pragma: no cover - the router package is part of kvgate
        return False
    return isinstance(routing, EmbeddedRouter)


_ROUTES: dict[str, _Route] = {
    "/v1/completions": _Route("completions", "/v1/completions"),
    "/v1/chat/completions": _Route("chat", "/v1/chat/completions"),
}


GATEWAY_KEY = "gateway"  # ``app[GATEWAY_KEY]`` is the app's Gateway


def _http_error(status: int, message: str) -> Response:
    """The server's own refusals (404, 405, 413, 431, 400 ...) as OpenAI-style JSON."""
    return error_response(status, message)


class GatewayApp:
    """What :func:`create_app` returns and :func:`serve` runs: a Gateway and its routes.
    ``owns_gateway``: serving it starts and stops the Gateway (False for a second listener
    on the same Gateway, such as a worker's metrics port)."""

    def __init__(self, gateway: Gateway, routes: Routes, *, owns_gateway: bool = True) -> None:
        self.gateway = gateway
        self.routes = routes
        self.owns_gateway = owns_gateway

    def __getitem__(self, key: str) -> Gateway:
        if key != GATEWAY_KEY:
            raise KeyError(key)
        return self.gateway


def create_app(
    config: GatewayConfig,
    routing: RoutingService,
    *,
    templates: Mapping[str | None, ChatTemplate] | None = None,
    default_slo: Slo | None = None,
    stats: StatsProvider | None = None,
    on_drain: DrainHook | None = None,
) -> GatewayApp:
    """The gateway application. ``templates`` maps a model (or None for every model) to its chat
    template; ``stats`` gives the router's ``broker_lag_s``/``broker_ok``; ``on_drain`` tells an
    embedded router about admin drains."""
    gw = Gateway(
        config,
        routing,
        templates=templates,
        default_slo=default_slo,
        stats=stats,
        on_drain=on_drain,
    )
    routes = Routes()
    for route in _ROUTES.values():
        routes.add("POST", route.path, functools.partial(gw.handle, route=route))
    routes.add("GET", "/v1/models", gw.models)
    routes.add("GET", "/health", gw.health)
    routes.add("GET", "/ready", gw.ready)
    routes.add("GET", "/metrics", gw.metrics_endpoint)
    if config.admin_token:
        routes.add("GET", "/admin/engines", gw.admin_engines)
        routes.add("GET", "/admin/router", gw.admin_router)
        routes.add("POST", "/admin/engines/{engine_id}/{action:drain|undrain}", gw.admin_drain)
    return GatewayApp(gw, routes)


def metrics_app(app: GatewayApp) -> GatewayApp:
    """``/metrics`` (and ``/health``) of one worker on a port of its own: Prometheus scrapes
    each worker there, since the shared port reaches one worker per scrape."""
    gw = app.gateway
    routes = Routes()
    routes.add("GET", "/metrics", gw.metrics_endpoint)
    routes.add("GET", "/health", gw.health)
    return GatewayApp(gw, routes, owns_gateway=False)


class GatewayRunner:
    """A served :class:`GatewayApp`; :meth:`cleanup` drains and stops it."""

    def __init__(self, app: GatewayApp, drain_timeout_s: float) -> None:
        self.app = app
        self.drain_timeout_s = drain_timeout_s
        gw = app.gateway
        cfg = gw.config
        self.server = HttpServer(
            app.routes,
            error=_http_error,
            max_body_bytes=cfg.max_body_bytes,
            head_timeout_s=cfg.head_timeout_s,
            body_timeout_s=cfg.body_timeout_s,
            max_connections=cfg.max_connections,
            stats=gw.metrics.connections,
        )
        self._started = False

    async def start(self, host: str, port: int, reuse_port: bool) -> int:
        gw = self.app.gateway
        if self.app.owns_gateway:
            await gw.start()
        self._started = True
        try:
            return await self.server.start(host, port, reuse_port=reuse_port)
        except BaseException:
            await self.cleanup()
            raise

    async def cleanup(self) -> None:
        """Graceful stop: /ready says 503, no new connections, open requests and streams
        finish for up to the drain timeout, then the background jobs and upstream pool stop."""
        if not self._started:
            return
        self._started = False
        gw = self.app.gateway
        if self.app.owns_gateway:
            gw.on_shutdown()
        await self.server.shutdown(self.drain_timeout_s)
        if self.app.owns_gateway:
            await gw.stop()


async def serve(
    app: GatewayApp | web.Application,
    host: str,
    port: int,
    *,
    drain_timeout_s: float = 30.0,
    reuse_port: bool = False,
) -> tuple[GatewayRunner | web.AppRunner, int]:
    """Start ``app`` on host:port (0 = a free port); returns the runner (``await
    runner.cleanup()`` to stop) and the bound port. A client that disconnects cancels its
    handler, so the upstream request is cancelled too. ``reuse_port``: SO_REUSEPORT, for the
    worker processes that share one port. An aiohttp ``web.Application`` (tests' fake engines)
    is served by aiohttp."""
    if isinstance(app, GatewayApp):
        runner = GatewayRunner(app, drain_timeout_s)
        return runner, await runner.start(host, port, reuse_port)
    aio = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=drain_timeout_s, access_log=None
    )
    await aio.setup()
    site = web.TCPSite(aio, host, port, reuse_address=True, reuse_port=reuse_port or None)
    await site.start()
    server = site._server  # the asyncio server: the only place the bound port is known
    assert server is not None and server.sockets
    return aio, server.sockets[0].getsockname()[1]
