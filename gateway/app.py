"""The gateway: an aiohttp app factory around one proxy handler.

Per request the handler validates the body (``kvgate.openai_request``), asks the router once
(embedded or remote, behind the :class:`router.api.RoutingService` protocol), forwards the
original body bytes to the chosen engine and relays the answer; SSE chunk by chunk as it arrives.
A connection failure or a 5xx before the first byte is retried on the next-best engine (the
failed one excluded), at most ``max_retries`` times. Background work (engine list refresh, active
health checks, outcome reports to the router) runs in cleanup contexts.

When the router cannot be reached, or says it knows no live engine while the gateway's own
health checks find some, or its broker is down, the gateway keeps serving on the last known engine
list by least load (its own in-flight counts) and says so in ``kvgate_gateway_router_degraded``
and in the logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from yarl import URL

from gateway.config import GatewayConfig
from gateway.errors import error_response, from_request_error
from gateway.metrics import GatewayMetrics
from gateway.pool import EnginePool
from kvgate.logs import LogOnce, request_id_var
from kvgate.openai_request import ChatTemplate, Endpoint, RequestError, parse_request
from kvgate.slo import Slo
from router.api import Decision, EngineInfo, Outcome, RouteRequest, RoutingService

log = logging.getLogger("kvgate.gateway")

REQUEST_ID = "x-request-id"
ROUTE_HEADER = "x-kvgate-route"
WORKER_HEADER = "x-kvgate-worker"  # the gateway process's pid, on debug responses
DEBUG_HEADER = "x-kvgate-debug"
FALLBACK_POLICY = "gateway_fallback"
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
_NOT_FORWARDED = _HOP | {DEBUG_HEADER, REQUEST_ID}
_NOT_RELAYED = _HOP | {REQUEST_ID, ROUTE_HEADER, WORKER_HEADER}
_UPSTREAM_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError, OSError)

StatsProvider = Callable[[], Awaitable[Mapping[str, Any]]]
DrainHook = Callable[[str, bool], None]


@dataclass(frozen=True, slots=True)
class _Route:
    endpoint: Endpoint
    path: str


def nodelay_socket(addr_info: Any) -> socket.socket:
    """Upstream sockets with TCP_NODELAY from birth: a streamed chunk is never held back by
    Nagle's algorithm waiting for the ACK of the previous small write."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


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
        self.session: aiohttp.ClientSession | None = None
        self.shutting_down = False
        self.router_failed_at: float | None = None  # last time route()/engines() failed
        self.broker_ok = True
        self.degraded = False
        self.last_refresh = -math.inf
        self.reports: asyncio.Queue[tuple[str, str, Outcome]] = asyncio.Queue(maxsize=10_000)
        self.log_once = LogOnce(log, every_s=60.0)
        self.open_streams = 0
        self._urls: dict[tuple[str, str], URL] = {}
        self.pid = str(os.getpid())  # which worker answered (``--workers N``)
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
            if ok is not None and bool(ok) != self.broker_ok:
                self.broker_ok = bool(ok)
                if not self.broker_ok:
                    log.warning("broker unavailable: the router's view is frozen")
        if not self.broker_ok:
            self._set_degraded("broker unavailable")
        elif self.router_failed_at is None or time.monotonic() - self.router_failed_at > 1.0:
            self.router_failed_at = None
            self._set_degraded(None)

    async def check_health(self) -> None:
        """Probe every engine's ``GET /health`` (and learn the models of static engines)."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)

        async def probe(engine_id: str, url: str, need_models: bool) -> None:
            error = ""
            try:
                async with self.session.get(url + "/health", timeout=timeout) as r:
                    await r.read()
                    ok = r.status < 500
                    error = "" if ok else f"/health answered {r.status}"
                if ok and need_models:
                    async with self.session.get(url + "/v1/models", timeout=timeout) as r:
                        data = await r.json(loads=orjson.loads, content_type=None)
                        models = [m["id"] for m in data.get("data", []) if "id" in m]
                        self.pool.set_models(engine_id, models)
            except (*_UPSTREAM_FAILURES, ValueError, KeyError, TypeError, AttributeError) as exc:
                ok, error = False, repr(exc)
            now = time.monotonic()
            if self.pool.health_result(engine_id, ok, now, error):
                log.warning(
                    "engine %s is now %s",
                    engine_id,
                    "usable" if ok else "ejected",
                    extra={"engine": engine_id, "error": error},
                )

        await asyncio.gather(
            *(probe(e.engine_id, e.url, not e.models) for e in list(self.pool.engines.values()))
        )

    async def _every(self, interval: float, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await job()
            except Exception:  # a background job must never die
                log.exception("background job %s failed", getattr(job, "__name__", job))

    async def _report_loop(self) -> None:
        """Send queued outcomes, everything queued at once per wake-up (under load many
        requests finish between two turns of the loop)."""
        reports = self.reports
        while True:
            batch = [await reports.get()]
            while not reports.empty():
                batch.append(reports.get_nowait())
            for rid, engine_id, outcome in batch:
                try:
                    if self._needs_timeout:
                        async with asyncio.timeout(self.config.route_timeout_s):
                            await self.routing.report(rid, engine_id, outcome)
                    else:
                        await self.routing.report(rid, engine_id, outcome)
                except Exception as exc:
                    self.log_once.warning("router-report", "router report failed: %r", exc)

    def _report(self, rid: str, engine_id: str, outcome: Outcome) -> None:
        """Queue an outcome for the router; reporting never delays the response."""
        try:
            self.reports.put_nowait((rid, engine_id, outcome))
        except asyncio.QueueFull:
            self.log_once.warning("report-queue", "router report queue full: dropping outcomes")

    async def background(self, app: web.Application) -> AsyncIterator[None]:
        """Cleanup context: upstream session, first refresh and probes, then periodic jobs."""
        connector = aiohttp.TCPConnector(
            limit=0,
            keepalive_timeout=60.0,
            ttl_dns_cache=60,
            socket_factory=nodelay_socket,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            timeout=aiohttp.ClientTimeout(
                total=None,
                sock_connect=self.config.connect_timeout_s,
                sock_read=self.config.idle_timeout_s,
            ),
        )
        await self.refresh_engines()
        await self.check_health()
        tasks = [
            asyncio.create_task(self._every(self.config.refresh_interval_s, self.refresh_engines)),
            asyncio.create_task(self._every(self.config.health_interval_s, self.check_health)),
            asyncio.create_task(self._report_loop()),
        ]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.session.close()

    async def on_shutdown(self, app: web.Application) -> None:
        """Stop advertising readiness; aiohttp then waits for open streams to finish."""
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

    async def _read_json(self, request: web.Request) -> Any:
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise RequestError(f"request body exceeds {limit} bytes", status=413)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(f"request body exceeds {limit} bytes", status=413) from None
        if not raw:
            raise RequestError("request body is empty; expected a JSON object")
        try:
            return raw, orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise RequestError(f"request body is not valid JSON: {exc}") from None

    def _forward_headers(self, request: web.Request, rid: str) -> dict[str, str]:
        out = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        out[REQUEST_ID] = rid
        return out

    def _response_headers(
        self, upstream: aiohttp.ClientResponse, rid: str, decision: Decision, debug: bool
    ) -> dict[str, str]:
        out = {k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_RELAYED}
        out[REQUEST_ID] = rid
        if debug:
            out[ROUTE_HEADER] = decision.header_value()
            out[WORKER_HEADER] = self.pid
        return out

    async def handle(self, request: web.Request, route: _Route) -> web.StreamResponse:
        """The proxy handler of both OpenAI endpoints."""
        start = time.perf_counter()
        rid = request.headers.get(REQUEST_ID) or secrets.token_hex(16)
        token = request_id_var.set(rid)
        status = 499  # a cancelled handler: the client went away
        try:
            try:
                resp = await self._proxy(request, route, rid, start)
            except RequestError as exc:
                resp = from_request_error(exc, {REQUEST_ID: rid})
            status = resp.status
            return resp
        finally:
            m = self.metrics
            m.child(m.requests, route.path, str(status)).inc()
            if self.config.access_log and log.isEnabledFor(logging.INFO):
                log.info(
                    "request",
                    extra={
                        "path": route.path,
                        "status": status,
                        "duration_ms": round((time.perf_counter() - start) * 1e3, 3),
                    },
                )
            request_id_var.reset(token)

    async def _proxy(
        self, request: web.Request, route: _Route, rid: str, start: float
    ) -> web.StreamResponse:
        raw, body = await self._read_json(request)
        model = body.get("model") if isinstance(body, dict) else None
        template = self.templates.get(model) if isinstance(model, str) else None
        if template is None:
            template = self.templates.get(None)
        parsed = parse_request(
            route.endpoint, body, request.headers, template=template, default_slo=self.default_slo
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
        headers = self._forward_headers(request, rid)
        tried: set[str] = set()
        for attempt in range(cfg.max_retries + 1):
            now = time.monotonic()
            t_route = time.perf_counter()
            decision = await self.decide(
                RouteRequest(
                    request_id=rid,
                    model=parsed.model,
                    key=parsed.key,
                    input_tokens=input_tokens,
                    max_tokens=max_tokens,
                    slo=parsed.slo,
                    session=parsed.session,
                    exclude=self.pool.blocked(now) | tried,
                )
            )
            self.metrics.route_seconds.observe(time.perf_counter() - t_route)
            m = self.metrics
            m.child(m.decisions, decision.policy, decision.reason).inc()
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
            self.metrics.matched_bytes.observe(decision.matched_bytes)
            engine_id = decision.engine_id
            assert engine_id is not None
            url = decision.url or self.pool.engines[engine_id].url
            last = attempt == cfg.max_retries
            result = await self._forward(
                request,
                route,
                raw,
                headers,
                engine_id,
                self._upstream_url(url, route.path),
                rid,
                decision,
                debug,
                start,
                last,
            )
            if result is not None:
                return result
            tried.add(engine_id)
            self.metrics.retries.labels("upstream_failure").inc()
        raise AssertionError("unreachable: the last attempt always answers")

    def _upstream_url(self, base: str, path: str) -> URL:
        """Parsed once per engine and path (URL parsing is a visible share of a request)."""
        url = self._urls.get((base, path))
        if url is None:
            if len(self._urls) > 100_000:
                self._urls.clear()
            url = self._urls[(base, path)] = URL(base + path)
        return url

    def _upstream_failed(self, engine_id: str, rid: str, kind: str, error: str) -> None:
        now = time.monotonic()
        self.metrics.upstream_errors.labels(engine_id, kind).inc()
        if self.pool.finished(engine_id, False, now, error):
            self.metrics.engine_ejections.labels(engine_id).inc()
            log.warning("engine %s ejected: %s", engine_id, error, extra={"engine": engine_id})
        self._report(rid, engine_id, "failed")

    async def _forward(
        self,
        request: web.Request,
        route: _Route,
        raw: bytes,
        headers: dict[str, str],
        engine_id: str,
        url: URL,
        rid: str,
        decision: Decision,
        debug: bool,
        start: float,
        last: bool,
    ) -> web.StreamResponse | None:
        """One attempt on one engine: the response, or None to retry on another engine."""
        assert self.session is not None
        self.pool.started(engine_id, time.monotonic())
        try:
            upstream = await self.session.post(url, data=raw, headers=headers)
        except asyncio.CancelledError:
            self.pool.released(engine_id)
            self._report(rid, engine_id, "cancelled")
            self.metrics.client_disconnects.inc()
            raise
        except _UPSTREAM_FAILURES as exc:
            self._upstream_failed(engine_id, rid, "connect", repr(exc))
            log.warning("engine %s unreachable: %r", engine_id, exc, extra={"engine": engine_id})
            if last:
                return error_response(
                    502,
                    f"engine {engine_id} unreachable: {exc!r}",
                    code="upstream_unavailable",
                    headers={REQUEST_ID: rid},
                )
            return None
        try:
            if upstream.status >= 500 and not last:
                await upstream.read()
                self._upstream_failed(engine_id, rid, f"http_{upstream.status}", "5xx")
                return None
            out_headers = self._response_headers(upstream, rid, decision, debug)
            if upstream.content_type == "text/event-stream":
                return await self._relay_stream(
                    request, route, upstream, out_headers, engine_id, rid, start
                )
            data = await upstream.read()
        except asyncio.CancelledError:
            self.pool.released(engine_id)
            self._report(rid, engine_id, "cancelled")
            self.metrics.client_disconnects.inc()
            raise
        except _UPSTREAM_FAILURES as exc:
            self._upstream_failed(engine_id, rid, "read", repr(exc))
            if last:
                return error_response(
                    504 if isinstance(exc, asyncio.TimeoutError) else 502,
                    f"engine {engine_id} failed before answering: {exc!r}",
                    code="upstream_error",
                    headers={REQUEST_ID: rid},
                )
            return None
        finally:
            upstream.release()
        ok = upstream.status < 500
        self.pool.finished(engine_id, ok, time.monotonic(), "" if ok else f"{upstream.status}")
        self._report(rid, engine_id, "ok" if ok else "failed")
        m = self.metrics
        m.child(m.e2e, route.path, "false").observe(time.perf_counter() - start)
        return web.Response(status=upstream.status, body=data, headers=out_headers)

    async def _relay_stream(
        self,
        request: web.Request,
        route: _Route,
        upstream: aiohttp.ClientResponse,
        out_headers: dict[str, str],
        engine_id: str,
        rid: str,
        start: float,
    ) -> web.StreamResponse:
        """Relay SSE bytes as they arrive; no buffering, one write per upstream read. The
        headers go out with the first chunk, and the last chunk with the end of the body (one
        write each rather than two: each write is a syscall and a wake-up of the client)."""
        resp = _SseResponse(status=upstream.status, headers=out_headers)
        self.open_streams += 1
        self.metrics.open_streams.inc()
        outcome: Outcome = "ok"
        try:
            await resp.prepare(request)
            content = upstream.content
            first = True
            while True:
                try:
                    chunk = await content.readany()
                except _UPSTREAM_FAILURES as exc:  # the engine broke or went idle mid-stream
                    outcome = "failed"
                    self._upstream_failed(engine_id, rid, "stream", repr(exc))
                    log.warning(
                        "stream from %s broke: %r", engine_id, exc, extra={"engine": engine_id}
                    )
                    err = error_response(502, f"engine {engine_id} stream broke: {exc!r}")
                    with contextlib.suppress(ConnectionResetError):
                        await resp.write(b"data: " + err.body + b"\n\n")
                        await resp.write_eof()
                    return resp
                if not chunk:
                    break
                if first:
                    first = False
                    m = self.metrics
                    m.child(m.ttft, route.path).observe(time.perf_counter() - start)
                if content.at_eof():  # the upstream body is complete: end ours with this chunk
                    await resp.write_eof(chunk)
                    return resp
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):  # the client went away
            outcome = "cancelled"
            self.metrics.client_disconnects.inc()
            upstream.close()  # drop the upstream connection: the engine stops generating
            raise
        finally:
            self.open_streams -= 1
            self.metrics.open_streams.dec()
            now = time.monotonic()
            if outcome == "ok":
                self.pool.finished(engine_id, True, now)
            elif outcome == "cancelled":
                self.pool.released(engine_id)
            if outcome != "failed":
                self._report(rid, engine_id, outcome)
            m = self.metrics
            m.child(m.e2e, route.path, "true").observe(time.perf_counter() - start)

    # ---- other endpoints ----------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        if time.monotonic() - self.last_refresh > self.config.refresh_interval_s:
            await self.refresh_engines()
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "kvgate"}
            for m in self.pool.models()
        ]
        return web.json_response({"object": "list", "data": data}, dumps=_dumps)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "pid": int(self.pid)}, dumps=_dumps)

    async def ready(self, request: web.Request) -> web.Response:
        usable = len(self.pool.usable(None, time.monotonic()))
        ready = usable > 0 and not self.shutting_down
        body = {
            "ready": ready,
            "usable_engines": usable,
            "degraded": self.degraded,
            "shutting_down": self.shutting_down,
        }
        return web.json_response(body, status=200 if ready else 503, dumps=_dumps)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        self.metrics.refresh_engines(self.pool, time.monotonic())
        return web.Response(
            body=self.metrics.exposition(), headers={"Content-Type": self.metrics.content_type}
        )

    def _authorized(self, request: web.Request) -> bool:
        token = self.config.admin_token or ""
        given = request.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            value.strip().encode(), token.encode()
        )

    def _unauthorized(self) -> web.Response:
        return error_response(
            401,
            "admin endpoints need 'Authorization: Bearer <admin token>'",
            code="invalid_admin_token",
            headers={"WWW-Authenticate": 'Bearer realm="kvgate-admin"'},
        )

    async def admin_engines(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._unauthorized()
        now = time.monotonic()
        body = {
            "degraded": self.degraded,
            "engines": [e.describe(now) for e in self.pool.engines.values()],
        }
        return web.json_response(body, dumps=_dumps)

    async def admin_drain(self, request: web.Request) -> web.Response:
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
        return web.json_response(e.describe(time.monotonic()), dumps=_dumps)


class _SseResponse(web.StreamResponse):
    """A streamed response whose headers wait for the first body write (aiohttp's plain
    ``Response`` does the same), so that they share one packet and one client wake-up."""

    _send_headers_immediately = False


def _is_embedded(routing: RoutingService) -> bool:
    """Is ``routing`` the in-process router (whose calls never wait on I/O)?"""
    try:
        from router.service import EmbeddedRouter
    except ImportError:  # pragma: no cover - the router package is part of kvgate
        return False
    return isinstance(routing, EmbeddedRouter)


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


_ROUTES: dict[str, _Route] = {
    "/v1/completions": _Route("completions", "/v1/completions"),
    "/v1/chat/completions": _Route("chat", "/v1/chat/completions"),
}


def _handler_for(gw: Gateway, route: _Route) -> Callable[[web.Request], Awaitable]:
    async def proxy(request: web.Request) -> web.StreamResponse:
        return await gw.handle(request, route)

    return proxy


GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)


@web.middleware
async def _json_errors(request: web.Request, handler: Callable) -> web.StreamResponse:
    """aiohttp's own 404/405/413 answers, and any bug, as OpenAI-style JSON (never a crash)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason or "error")
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s", request.path)
        return error_response(500, "internal gateway error (logged)", code="internal_error")


class _NoAccessLog(AbstractAccessLogger):
    """aiohttp's access log is replaced by the gateway's JSON request log."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        return None

    @property
    def enabled(self) -> bool:
        return False


def create_app(
    config: GatewayConfig,
    routing: RoutingService,
    *,
    templates: Mapping[str | None, ChatTemplate] | None = None,
    default_slo: Slo | None = None,
    stats: StatsProvider | None = None,
    on_drain: DrainHook | None = None,
) -> web.Application:
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
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_json_errors])
    app[GATEWAY_KEY] = gw
    for route in _ROUTES.values():
        app.router.add_post(route.path, _handler_for(gw, route))
    app.router.add_get("/v1/models", gw.models)
    app.router.add_get("/health", gw.health)
    app.router.add_get("/ready", gw.ready)
    app.router.add_get("/metrics", gw.metrics_endpoint)
    if config.admin_token:
        app.router.add_get("/admin/engines", gw.admin_engines)
        app.router.add_post(r"/admin/engines/{engine_id}/{action:drain|undrain}", gw.admin_drain)
    app.cleanup_ctx.append(gw.background)
    app.on_shutdown.append(gw.on_shutdown)
    return app


async def serve(
    app: web.Application,
    host: str,
    port: int,
    *,
    drain_timeout_s: float = 30.0,
    reuse_port: bool = False,
) -> tuple[web.AppRunner, int]:
    """Start ``app`` on host:port (0 = a free port); returns the runner and the bound port.
    Client disconnects cancel the handler, so the upstream request is cancelled too.
    ``reuse_port``: SO_REUSEPORT, for the worker processes that share one port."""
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=drain_timeout_s,
        access_log_class=_NoAccessLog,
        access_log=None,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, reuse_port=reuse_port or None)
    await site.start()
    server = site._server  # the asyncio server: the only place the bound port is known
    assert server is not None and server.sockets
    return runner, server.sockets[0].getsockname()[1]
