"""The live engine: an OpenAI-compatible aiohttp server around one :class:`EngineCore`.

The core is pure; this shell owns the clock and the sockets:

* the clock is ``time.monotonic()`` (not ``loop.time()``: uvloop's is cached per loop turn and
  has millisecond resolution); the core is advanced synchronously on the loop thread by a timer
  set for ``core.next_event_time()``, and right after every submit or cancel (no extra task, no
  lock: one thread touches the core). A timer that fires early (libuv timers have millisecond
  granularity) re-arms itself for the rest;
* once a streamed response has sent its first bytes, the timer callback itself writes each later
  batch of tokens to the socket (one write per stream per step, from precomputed chunk
  templates): no handler task wakes per token, so the last of many streams released by one step
  is not late by every other stream's handler. The first tokens, the end of a stream and unary
  answers go through the request's queue and handler. ``kvgate_engine_delivery_drift_seconds``
  measures, per token, the time from the core's production time to the moment its bytes were
  handed to the socket;
* responses are not started until the first token (or a rejection) exists, so a request the
  scheduler refuses while queued still gets a proper 429 JSON error;
* a client that goes away cancels its request in the core (freeing its KV and its batch slot);
* with a broker, an ``engine_reporter.Reporter`` publishes the core's events and a load
  heartbeat every ``heartbeat_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson
from aiohttp import HttpVersion11, web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from engine.core import EngineCore, EngineRequest, Output, Usage
from engine.scheduler.state import SchedulerConfig
from engine.text import tokens_text
from kvgate.cost_model import DEFAULT_PROFILE, CostProfile, load_profile
from kvgate.fast_metrics import FastCollector, FastHistogram
from kvgate.kv_transfer import (
    RemoteKv,
    prefill_answer_params,
    remote_prefill,
    wants_remote_decode,
)
from kvgate.logs import request_id_var
from kvgate.openai_request import (
    KV_TRANSFER_PARAM,
    ChatTemplate,
    ParsedRequest,
    RequestError,
    client_request_id,
    parse_request,
)
from kvgate.slo import DEFAULT_SLO_CLASS, SLO_CLASSES, Slo
from kvgate.stats import percentile

log = logging.getLogger("kvgate.engine")

REQUEST_ID_HEADER = "x-request-id"
_DISCONNECT_POLL_S = 0.5
_DRIFT_WINDOW = 20_000
# A timer due in less than this is waited for on the next loop turn rather than by a libuv
# timer, which has millisecond granularity and would fire up to ~1 ms late.
_SPIN_S = 0.0003


@dataclass(frozen=True, slots=True)
class EngineServerConfig:
    """How one live engine runs (built once by ``kvgate engine`` or by a test/demo)."""

    engine_id: str = "engine-0"
    model: str = "kvgate-sim"  # the served model name clients put in "model"
    aliases: tuple[str, ...] = ()  # more accepted model names
    profile: str = DEFAULT_PROFILE  # cost profile name or JSON path
    policy: str = "slo"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    default_slo: str = DEFAULT_SLO_CLASS  # SLO class for requests that state none
    default_max_tokens: int = 128  # when neither max_tokens nor the trace hint gives one
    url: str = ""  # advertised base URL in heartbeats ("" = learnt when serve() binds)
    heartbeat_s: float = 0.2
    chat_template: str | None = None  # model folder or .jinja file; None = canonical rendering
    reject_status: int = 429  # status of an SLO rejection (429 or 503)
    max_body_bytes: int = 64 * 1024 * 1024
    # prefill/decode disaggregation (kvgate.kv_transfer): the engine's announced role, and
    # the simulated link a decode engine pulls a prompt's KV over
    role: str = "both"
    kv_link_gbps: float = 100.0
    kv_bytes_per_token: int = 131_072
    kv_lease_s: float = 30.0  # how long a prefill engine keeps KV nobody has pulled

    @property
    def models(self) -> tuple[str, ...]:
        return (self.model, *self.aliases)


class EngineServer:
    """State of one live engine; built by :func:`create_app`, stored as ``app[ENGINE_KEY]``."""

    def __init__(self, config: EngineServerConfig, broker: object | None = None) -> None:
        if config.default_slo not in SLO_CLASSES:
            raise ValueError(f"unknown default SLO class {config.default_slo!r}")
        if config.reject_status not in (429, 503):
            raise ValueError("reject_status must be 429 or 503")
        self.config = config
        self.profile: CostProfile = load_profile(config.profile)
        self.core = EngineCore(
            config.engine_id,
            self.profile,
            policy=config.policy,
            config=config.scheduler,
            role=config.role,
        )
        # prefill engine: request id -> (prompt tokens, when its KV is dropped unpulled)
        self.kv_leases: dict[str, tuple[int, float]] = {}
        self._kv_client: object | None = None
        self.default_slo: Slo = SLO_CLASSES[config.default_slo]
        self.template = (
            ChatTemplate.from_path(config.chat_template) if config.chat_template else None
        )
        self.url = config.url
        self.broker = broker
        self.reporter = None
        self.started_at = time.time()
        self._streams: dict[str, asyncio.Queue[Output | None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.Handle | None = None
        self._timer_at: float | None = None
        self._heartbeat_task: asyncio.Task | None = None
        self._sweeper_task: asyncio.Task | None = None
        self._clients: dict[str, web.Request] = {}
        self._live: dict[str, _LiveStream] = {}  # streams the timer writes to directly
        self.drift_ms: deque[float] = deque(maxlen=_DRIFT_WINDOW)
        self.metrics = _Metrics(self)
        self._drift_hist = self.metrics.drift.labels()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sweeper_task = asyncio.create_task(self._sweep_disconnected(), name="sweeper")
        if self.broker is not None:
            from engine_reporter import Reporter

            self.reporter = Reporter(self.broker, self.config.engine_id)
            await self.reporter.start()
            self._heartbeat_task = asyncio.create_task(
                self._heartbeats(), name=f"heartbeat:{self.config.engine_id}"
            )

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for task in (self._heartbeat_task, self._sweeper_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.reporter is not None:
            self._publish()
            await self.reporter.close()
        if self._kv_client is not None:
            await self._kv_client.close()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ KV handover

    def lease_kv(self, request_id: str, tokens: int) -> None:
        """A prefill for a remote decode ended: keep its KV for a reader (expired ones go)."""
        now = self.now()
        for rid in [r for r, (_, until) in self.kv_leases.items() if until <= now]:
            del self.kv_leases[rid]
        self.kv_leases[request_id] = (tokens, now + self.config.kv_lease_s)

    def take_kv(self, request_id: str) -> int | None:
        """A decode engine reads a leased KV (once, as vLLM frees it after the read)."""
        lease = self.kv_leases.pop(request_id, None)
        if lease is None or lease[1] <= self.now():
            return None
        return lease[0]

    async def pull_kv(self, remote: RemoteKv, key: bytes) -> tuple[int, float] | None:
        """Read a prompt's KV from the prefill engine that holds it: (tokens, ms) once it has
        crossed the simulated link and joined this engine's prefix cache; None when the
        prefill engine is gone or no longer holds it."""
        import aiohttp

        if self._kv_client is None:
            self._kv_client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0))
        client: aiohttp.ClientSession = self._kv_client  # type: ignore[assignment]
        start = self.now()
        url = f"http://{remote.host}:{remote.port}/kvgate/kv/{remote.request_id}"
        try:
            async with client.get(url) as resp:
                if resp.status != 200:
                    return None
                tokens = (await resp.json()).get("tokens")
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        if type(tokens) is not int or tokens < 0:
            return None
        cfg = self.config
        await asyncio.sleep(tokens * cfg.kv_bytes_per_token * 8.0 / (cfg.kv_link_gbps * 1e9))
        self._dispatch(self.core.advance(self.now()))
        self.core.receive_kv(key, self.now())
        return tokens, (self.now() - start) * 1000.0

    def now(self) -> float:
        """The engine's clock: monotonic, sub-microsecond, read fresh (see the module doc)."""
        return time.monotonic()

    # ------------------------------------------------------------------ driving the core

    def submit(
        self, req: EngineRequest, request: web.Request | None = None
    ) -> asyncio.Queue[Output | None]:
        """Hand ``req`` to the core; its outputs arrive on the returned queue (then None if the
        client of ``request`` goes away)."""
        queue: asyncio.Queue[Output | None] = asyncio.Queue()
        self._streams[req.request_id] = queue
        if request is not None:
            self._clients[req.request_id] = request
        now = self.now()
        self._dispatch(self.core.advance(now))  # settle the past before the new arrival
        self.core.submit(req, now)
        self.metrics.arrivals.inc()
        self.tick()
        return queue

    def cancel(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._clients.pop(request_id, None)
        self._live.pop(request_id, None)
        if request_id in self.core:
            self.core.cancel(request_id, self.now())
            self.metrics.requests.labels("cancelled").inc()
            self.tick()

    def tick(self) -> None:
        """Advance the core to now, deliver what it produced, and re-arm the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        now = self.now()
        self._dispatch(self.core.advance(now))
        self._publish()
        nxt = self.core.next_event_time()
        if nxt is None:
            self._timer_at = None
            return
        self._timer_at = nxt
        assert self._loop is not None
        delay = nxt - self.now()
        if delay < _SPIN_S:
            self._timer = self._loop.call_soon(self._on_timer)  # type: ignore[assignment]
        else:
            self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        try:
            self.tick()
        except Exception:  # never let the engine loop die; the request handlers time out
            log.exception("engine step failed")

    def _dispatch(self, outputs: list[Output]) -> None:
        live = self._live
        written: list[_LiveStream] = []
        for out in outputs:
            if out.usage is not None:
                self.metrics.observe_finish(out.usage)
            elif out.rejected is not None:
                self.metrics.requests.labels("rejected").inc()
            stream = live.get(out.request_id)
            if stream is not None and out.rejected is None:
                if not stream.pending:
                    written.append(stream)
                stream.add(out)
                if out.usage is None:
                    continue  # the handler only needs to hear about the end
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        for stream in written:  # one write per stream, the drift taken right after it
            if not stream.flush(self):
                queue = self._streams.get(stream.rid)
                if queue is not None:
                    queue.put_nowait(None)  # the client is gone: wake its handler now

    def _publish(self) -> None:
        events = self.core.drain_events()
        if self.reporter is not None:
            for ev in events:
                self.reporter.emit(ev)
        self.metrics.count_events(events)

    def go_live(self, stream: _LiveStream) -> None:
        """From now on the timer writes ``stream``'s tokens (it has sent its first bytes)."""
        if stream.rid in self._streams:
            self._live[stream.rid] = stream

    async def _sweep_disconnected(self) -> None:
        """Wake the handlers of clients that went away (one task for all, not a timer per
        token): each gets None on its queue, returns, and cancels its request."""
        while True:
            await asyncio.sleep(_DISCONNECT_POLL_S)
            for rid, request in list(self._clients.items()):
                transport = request.transport
                if transport is None or transport.is_closing():
                    del self._clients[rid]
                    queue = self._streams.get(rid)
                    if queue is not None:
                        queue.put_nowait(None)

    async def _heartbeats(self) -> None:
        while True:
            if self.url and self.reporter is not None:
                self.reporter.emit(self.core.heartbeat(self.url, self.config.models, self.now()))
            await asyncio.sleep(self.config.heartbeat_s)

    def record_drift(self, produced_at: Iterable[float], delivered_at: float) -> None:
        """The delivery delay of tokens produced at ``produced_at``: ``delivered_at`` is when
        their bytes were handed to the socket."""
        drifts = [max(delivered_at - t, 0.0) for t in produced_at]
        self.drift_ms.extend(d * 1000.0 for d in drifts)
        self._drift_hist.observe_many(drifts)

    def drift_summary(self) -> dict[str, float | int]:
        values = list(self.drift_ms)
        return {
            "samples": len(values),
            "p50_ms": percentile(values, 0.5),
            "p99_ms": percentile(values, 0.99),
            "max_ms": max(values) if values else float("nan"),
        }


class _Metrics:
    """Prometheus metrics in the engine's own registry (several engines can share a process)."""

    def __init__(self, server: EngineServer) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        core = server.core
        self.running = Gauge("kvgate_engine_running", "Admitted requests", registry=r)
        self.running.set_function(lambda: core.running)
        self.waiting = Gauge("kvgate_engine_waiting", "Queued requests", registry=r)
        self.waiting.set_function(lambda: len(core.waiting))
        self.kv_used = Gauge("kvgate_engine_kv_blocks_used", "KV blocks in use", registry=r)
        self.kv_used.set_function(lambda: core.cache.used_blocks)
        kv_total = Gauge("kvgate_engine_kv_blocks_total", "KV blocks in all", registry=r)
        kv_total.set(server.profile.kv_blocks)
        usage = Gauge("kvgate_engine_kv_usage_ratio", "Fraction of KV blocks in use", registry=r)
        usage.set_function(lambda: core.cache.used_blocks / server.profile.kv_blocks)
        vbs = Gauge("kvgate_engine_vbs", "SCORPIO virtual batch size", registry=r)
        vbs.set_function(lambda: core.vbs)
        hits = Gauge(
            "kvgate_engine_prefix_hit_bytes",
            "Prompt bytes served from the prefix cache (cumulative)",
            registry=r,
        )
        hits.set_function(lambda: core.cache.hits_bytes)
        looked = Gauge(
            "kvgate_engine_prefix_lookup_bytes",
            "Prompt bytes looked up in the prefix cache (cumulative, full blocks)",
            registry=r,
        )
        looked.set_function(lambda: core.cache.lookups_bytes)
        self.arrivals = Counter("kvgate_engine_arrivals", "Requests submitted", registry=r)
        self.requests = Counter(
            "kvgate_engine_requests", "Requests by outcome", ["outcome"], registry=r
        )
        self.slo_requests = Counter(
            "kvgate_engine_slo_requests",
            "Finished requests by SLO class and whether TTFT and mean TPOT met it",
            ["slo_class", "met"],
            registry=r,
        )
        self.preemptions = Counter("kvgate_engine_preemptions", "Prefill preemptions", registry=r)
        self.ttft = Histogram(
            "kvgate_engine_ttft_seconds",
            "Time to first token (scheduler timeline)",
            buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 6, 10, 20, 60),
            registry=r,
        )
        self.tpot = Histogram(
            "kvgate_engine_tpot_seconds",
            "Mean time per output token after the first",
            buckets=(0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1),
            registry=r,
        )
        self.drift = FastHistogram(  # observed per token, on the delivery path: lock-free
            "kvgate_engine_delivery_drift_seconds",
            "How late a token's bytes reached the socket versus the scheduler's timeline",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
        )
        r.register(FastCollector((self.drift,)))

    def observe_finish(self, usage: Usage) -> None:
        self.requests.labels("finished").inc()
        self.slo_requests.labels(usage.slo_class, "true" if usage.slo_met else "false").inc()
        self.ttft.observe(usage.ttft_ms / 1000.0)
        if usage.completion_tokens > 1:
            self.tpot.observe(usage.tpot_ms / 1000.0)

    def count_events(self, events: list) -> None:
        n = sum(1 for e in events if type(e).__name__ == "RequestPreempted")
        if n:
            self.preemptions.inc(n)


ENGINE_KEY: web.AppKey[EngineServer] = web.AppKey("kvgate_engine", EngineServer)


# ---------------------------------------------------------------------- HTTP handlers


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(exc: RequestError) -> web.Response:
    return _json(exc.to_body(), exc.status)


async def _read_body(request: web.Request) -> object:
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None


def _prompt_tokens(server: EngineServer, parsed: ParsedRequest, body: dict) -> int:
    """The documented token rule, unless the trace states the count."""
    if parsed.hint.input_tokens is not None:
        return parsed.hint.input_tokens
    prompt = body.get("prompt") if parsed.endpoint == "completions" else None
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
        first = prompt[0]
        return max(len(first), 1) if isinstance(first, list) else len(prompt)
    return server.profile.tokens_for_bytes(len(parsed.key))


def _usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


async def _generate(request: web.Request, endpoint: str) -> web.StreamResponse:
    server = request.app[ENGINE_KEY]
    rid = client_request_id(request.headers.get(REQUEST_ID_HEADER)) or f"cmpl-{uuid.uuid4().hex}"
    token = request_id_var.set(rid)
    try:
        try:
            body = await _read_body(request)
            parsed = parse_request(
                endpoint,  # type: ignore[arg-type]
                body,
                request.headers,
                template=server.template,
                default_slo=server.default_slo,
            )
        except RequestError as exc:
            return _error(exc)
        if parsed.model not in server.config.models:
            return _error(
                RequestError(
                    f"model {parsed.model!r} is not served here (serving: "
                    f"{', '.join(server.config.models)})",
                    status=404,
                    param="model",
                    code="model_not_found",
                )
            )
        if rid in server.core:
            return _error(
                RequestError(f"request id {rid!r} is already in flight", param=REQUEST_ID_HEADER)
            )
        assert isinstance(body, dict)
        arrival = server.now()
        try:
            remote = remote_prefill(body)
        except RequestError as exc:
            return _error(exc)
        keep_kv = wants_remote_decode(body)
        if keep_kv and parsed.stream:
            return _error(
                RequestError("a prefill for a remote decode is unary: set stream to false")
            )
        output_tokens = (
            1
            if keep_kv
            else parsed.hint.output_tokens or parsed.max_tokens or server.config.default_max_tokens
        )
        input_tokens = _prompt_tokens(server, parsed, body)
        too_long = _context_error(server, parsed, input_tokens, output_tokens)
        if too_long is not None:
            return _error(too_long)
        moved: tuple[int, float] | None = None
        if remote is not None:
            moved = await server.pull_kv(remote, parsed.key)
            if moved is None:
                return _error(
                    RequestError(
                        f"could not read the prompt's KV of request {remote.request_id!r} "
                        f"from engine {remote.engine_id!r}",
                        status=503,
                        code="kv_transfer_failed",
                        type_="server_error",
                    )
                )
        req = EngineRequest(
            request_id=rid,
            key=parsed.key,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            slo=parsed.slo,
            arrival=arrival,
            kv_transfer_ms=None if moved is None else moved[1],
            kv_transfer_tokens=None if moved is None else moved[0],
            answer_key=_answer_key(server, parsed, rid, output_tokens, keep_kv),
        )
        queue = server.submit(req, request)
        try:
            if parsed.stream:
                return await _stream(request, server, parsed, rid, queue)
            return await _unary(request, server, parsed, rid, queue, keep_kv)
        finally:
            server.cancel(rid)  # no-op when it finished; frees everything when the client left
    finally:
        request_id_var.reset(token)


def _context_error(
    server: EngineServer, parsed: ParsedRequest, input_tokens: int, output_tokens: int
) -> RequestError | None:
    """A request this engine could never hold (its prompt and answer need more KV blocks than
    it has in all): OpenAI's 400 ``context_length_exceeded``, before any work. Not the
    scheduler's 429: no wait makes room for it, and a client retries a 429."""
    p = server.profile
    if p.kv_blocks_needed(len(parsed.key), input_tokens, output_tokens) <= p.kv_blocks:
        return None
    limit = p.kv_blocks * p.block_tokens
    param = "messages" if parsed.endpoint == "chat" else "prompt"
    return RequestError(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{input_tokens + output_tokens} tokens ({input_tokens} in the {param}, "
        f"{output_tokens} in the completion). Please reduce the length of the {param} or "
        "completion.",
        param=param,
        code="context_length_exceeded",
    )


def _answer_key(
    server: EngineServer, parsed: ParsedRequest, rid: str, output_tokens: int, keep_kv: bool
) -> bytes | Callable[[], bytes]:
    """What this chat answer adds to the key of the conversation's next turn, which resends it
    as an assistant message: its text (the simulated model's, fixed by the request id) and the
    line end closing the message in the canonical rendering (kvgate.openai_request), whose key
    ends with the assistant's opening line. The engine caches it when the answer is complete,
    as vLLM and SGLang cache output tokens; the text is made then (a function), since making
    a long answer's text takes time in proportion (0.3 s for 200,000 tokens) and a cancelled
    or refused answer needs none. None (b"") under a model's chat template, whose rendering of
    the answer is the template's, and for a prefill handed to a decode engine."""
    if parsed.endpoint != "chat" or server.template is not None or keep_kv:
        return b""
    return functools.partial(_answer_text, rid, output_tokens)


def _answer_text(rid: str, output_tokens: int) -> bytes:
    return tokens_text(rid, 0, output_tokens).encode() + b"\n"


def _rejection(server: EngineServer, reason: str) -> web.Response:
    return _error(
        RequestError(
            f"request rejected by engine {server.config.engine_id}: {reason}",
            status=server.config.reject_status,
            code="slo_infeasible",
            type_="server_overloaded",
        )
    )


async def _unary(
    request: web.Request,
    server: EngineServer,
    parsed: ParsedRequest,
    rid: str,
    queue: asyncio.Queue[Output | None],
    keep_kv: bool = False,
) -> web.Response:
    parts: list[str] = []
    while True:
        out = await queue.get()  # None once the client has gone away (the sweeper says so)
        if out is None:
            raise web.HTTPRequestTimeout()  # never sent: the client is gone
        if out.rejected is not None:
            return _rejection(server, out.rejected)
        if out.times:
            parts.append(tokens_text(rid, out.index, len(out.times)))
        if out.usage is not None:
            answer = _full_body(parsed, rid, "".join(parts), out.usage)
            if keep_kv:  # a prefill for a remote decode: say where the KV waits
                server.lease_kv(rid, out.usage.prompt_tokens)
                where = urlsplit(server.url)
                blocks = -(-out.usage.prompt_tokens // server.profile.block_tokens)
                answer[KV_TRANSFER_PARAM] = prefill_answer_params(
                    server.config.engine_id,
                    rid,
                    where.hostname or "127.0.0.1",
                    where.port or 80,
                    list(range(blocks)),
                    out.usage.prompt_tokens,
                )
            resp = _json(answer)
            await resp.prepare(request)
            await resp.write_eof()  # the whole answer is on the socket now
            server.record_drift(out.times[-1:], server.now())
            return resp


def _full_body(parsed: ParsedRequest, rid: str, text: str, usage: Usage) -> dict:
    created = int(time.time())
    if parsed.endpoint == "chat":
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": parsed.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": _usage_json(usage),
        }
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": parsed.model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
        "usage": _usage_json(usage),
    }


class _Chunker:
    """Builds the SSE chunks of one streamed response. A token chunk is the same JSON every
    time but for its text and finish reason, so its bytes are two precomputed pieces around the
    text (byte for byte what ``orjson.dumps`` of the whole chunk gives; a test checks)."""

    def __init__(self, parsed: ParsedRequest, rid: str) -> None:
        self.parsed = parsed
        self.rid = rid
        self.created = int(time.time())
        self.chat = parsed.endpoint == "chat"
        self.started = False
        marker = "\x00text\x00"
        field = "delta" if self.chat else "text"
        value: object = {"content": marker} if self.chat else marker
        template = self._chunk({"index": 0, field: value, "logprobs": None, "finish_reason": None})
        head, _, tail = template.partition(orjson.dumps(marker))
        self._head = head
        self._tail = tail
        self._tail_length = tail.replace(b'"finish_reason":null', b'"finish_reason":"length"', 1)

    def _chunk(self, choice: dict | None, usage: dict | None = None) -> bytes:
        data: dict = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.parsed.model,
            "choices": [choice] if choice is not None else [],
        }
        if self.parsed.include_usage:
            data["usage"] = usage
        return b"data: " + orjson.dumps(data) + b"\n\n"

    def text(self, text: str, finish: bool) -> bytes:
        out = b""
        if self.chat and not self.started:
            self.started = True
            out = self._chunk(
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
        if self.chat and not text:  # an empty delta is {} rather than {"content": ""}
            reason = "length" if finish else None
            return out + self._chunk(
                {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}
            )
        tail = self._tail_length if finish else self._tail
        return out + self._head + orjson.dumps(text) + tail

    def usage(self, usage: Usage) -> bytes:
        return self._chunk(None, _usage_json(usage))

    def payload(self, outputs: list[Output]) -> tuple[bytes, Usage | None]:
        """The bytes of ``outputs`` (one request's, in order) and the usage if it finished."""
        parts: list[bytes] = []
        finished: Usage | None = None
        for item in outputs:
            if item.times:
                text = tokens_text(self.rid, item.index, len(item.times))
                parts.append(self.text(text, item.usage is not None))
            if item.usage is not None:
                finished = item.usage
        if finished is not None:
            if self.parsed.include_usage:
                parts.append(self.usage(finished))
            parts.append(b"data: [DONE]\n\n")
        return b"".join(parts), finished


class _SseResponse(web.StreamResponse):
    """Headers wait for the first body write (as in aiohttp's ``Response``): one packet, one
    client wake-up for the first token instead of two."""

    _send_headers_immediately = False


class _LiveStream:
    """A streamed response whose later chunks the engine's timer writes itself (see the module
    docstring): the HTTP/1.1 chunked framing aiohttp would add, straight onto the transport."""

    __slots__ = ("chunker", "pending", "pending_times", "rid", "transport")

    def __init__(self, rid: str, chunker: _Chunker, transport: asyncio.Transport) -> None:
        self.rid = rid
        self.chunker = chunker
        self.transport = transport
        self.pending: list[Output] = []
        self.pending_times: list[float] = []

    def add(self, out: Output) -> None:
        self.pending.append(out)
        self.pending_times.extend(out.times)

    def flush(self, server: EngineServer) -> bool:
        """Write what is pending as one chunk; False when the client has gone away."""
        outputs, times = self.pending, self.pending_times
        self.pending, self.pending_times = [], []
        transport = self.transport
        if transport.is_closing():
            return False
        data, _ = self.chunker.payload(outputs)
        transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        server.record_drift(times, server.now())
        return True


async def _stream(
    request: web.Request,
    server: EngineServer,
    parsed: ParsedRequest,
    rid: str,
    queue: asyncio.Queue[Output | None],
) -> web.StreamResponse:
    """Wait for the first output; answer it (a 429, or the response's first bytes), then hand
    the stream to the timer when the connection allows (HTTP/1.1 chunked) and wait for its end."""
    chunker = _Chunker(parsed, rid)
    resp: web.StreamResponse | None = None
    while True:
        out = await queue.get()
        if out is None:  # the client went away
            return resp if resp is not None else web.Response(status=499)
        if out.rejected is not None:
            return _rejection(server, out.rejected) if resp is None else resp
        batch = [out]
        while not queue.empty():  # coalesce what is already due into one write
            item = queue.get_nowait()
            if item is None:
                return resp if resp is not None else web.Response(status=499)
            batch.append(item)
        if resp is None:
            resp = _SseResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    REQUEST_ID_HEADER: rid,
                }
            )
            if request.version >= HttpVersion11:
                resp.enable_chunked_encoding()  # the timer writes chunks itself (below)
            await resp.prepare(request)
        data, finished = chunker.payload(batch)
        try:
            await resp.write(data)  # also sends the buffered headers
            delivered = server.now()
            for item in batch:
                server.record_drift(item.times, delivered)
            if finished is not None:
                await resp.write_eof()
                return resp
        except (ConnectionResetError, asyncio.CancelledError):
            return resp
        transport = request.transport
        if resp.chunked and transport is not None and queue.empty():
            # From here on the timer writes this stream's tokens; the queue only hears the end
            # (or None when the client goes away). No await between the check and the handover.
            server.go_live(_LiveStream(rid, chunker, transport))  # type: ignore[arg-type]
            end = await queue.get()
            if end is not None and end.usage is not None:
                with contextlib.suppress(ConnectionResetError):
                    await resp.write_eof()
            return resp


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completions")


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _models(request: web.Request) -> web.Response:
    server = request.app[ENGINE_KEY]
    created = int(server.started_at)
    return _json(
        {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": created, "owned_by": "kvgate"}
                for m in server.config.models
            ],
        }
    )


async def _health(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def _server_info(request: web.Request) -> web.Response:
    """What sglang's ``/get_server_info`` and vLLM-style probes read, plus kvgate's own view."""
    server = request.app[ENGINE_KEY]
    cfg = server.config
    p = server.profile
    return _json(
        {
            "model_path": cfg.model,
            "served_model_name": cfg.model,
            "tokenizer_path": None,
            "dp_size": 1,
            "tp_size": 1,
            "max_total_num_tokens": p.kv_blocks * p.block_tokens,
            "chunked_prefill_size": cfg.scheduler.token_budget,
            "max_running_requests": p.max_running,
            "page_size": p.block_tokens,
            "version": "kvgate-sim",
            "kvgate": {
                "engine_id": cfg.engine_id,
                "policy": cfg.policy,
                "profile": p.name,
                "url": server.url,
                "waiting": len(server.core.waiting),
                "running": server.core.running,
                "kv_blocks_used": server.core.cache.used_blocks,
                "kv_blocks_total": p.kv_blocks,
                "vbs": server.core.vbs,
                "delivery_drift": server.drift_summary(),
            },
        }
    )


async def _model_info(request: web.Request) -> web.Response:
    server = request.app[ENGINE_KEY]
    return _json(
        {
            "model_path": server.config.model,
            "tokenizer_path": None,
            "is_generation": True,
            "max_model_len": server.profile.kv_blocks * server.profile.block_tokens,
        }
    )


async def _load(request: web.Request) -> web.Response:
    """sglang-router and vllm-router read ``load``; the rest mirrors sglang's fields."""
    core = request.app[ENGINE_KEY].core
    queued = sum(st.prefill_tokens for st in core.waiting)
    return _json(
        {
            "load": core.running + len(core.waiting),
            "num_reqs": core.running,
            "num_waiting_reqs": len(core.waiting),
            "num_tokens": queued,
        }
    )


async def _metrics(request: web.Request) -> web.Response:
    server = request.app[ENGINE_KEY]
    server.tick()  # gauges reflect now, not the last step boundary
    body = generate_latest(server.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(config: EngineServerConfig, broker: object | None = None) -> web.Application:
    """The live engine as an aiohttp app (a reporter inside when ``broker`` is given)."""
    server = EngineServer(config, broker)
    app = web.Application(client_max_size=config.max_body_bytes)
    app[ENGINE_KEY] = server

    async def lifecycle(_app: web.Application) -> AsyncIterator[None]:
        await server.start()
        yield
        await server.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, _server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, _model_info)
    app.router.add_get("/get_load", _load)
    app.router.add_get("/kvgate/kv/{request_id}", _kv_read)
    return app


async def _kv_read(request: web.Request) -> web.Response:
    """A decode engine reads a prompt's KV this (prefill) engine keeps for it."""
    server = request.app[ENGINE_KEY]
    tokens = server.take_kv(request.match_info["request_id"])
    if tokens is None:
        return _json({"error": {"message": "no such KV here", "type": "not_found"}}, 404)
    return _json({"tokens": tokens})


async def serve(
    config: EngineServerConfig,
    broker: object | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
) -> tuple[web.AppRunner, str]:
    """Start an engine on ``host:port`` (0: a free port); returns the runner and its base URL,
    which becomes the advertised URL unless ``config.url`` sets one."""
    app = create_app(config, broker)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    url = f"http://{shown}:{bound[1]}"
    server = app[ENGINE_KEY]
    if not server.url:
        server.url = url
    return runner, url
