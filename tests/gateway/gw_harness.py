"""Test doubles for the gateway's unit-level tests: tiny aiohttp upstreams and a tiny routing
service. They live in tests only; end-to-end tests use the real router and engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from socket import IPPROTO_TCP, TCP_NODELAY

import orjson
from aiohttp import web

from gateway.app import GATEWAY_KEY, Gateway, create_app, serve
from gateway.config import GatewayConfig
from router.api import Decision, EngineInfo, Outcome, RouteRequest

MODEL = "test-model"


@dataclass
class FakeEngine:
    """An OpenAI-ish upstream whose behaviour a test controls."""

    name: str
    models: tuple[str, ...] = (MODEL,)
    fail_status: int | None = None  # answer every completion with this status
    fail_text: bytes | None = None  # ... with this plain-text body (else an OpenAI JSON error)
    chunks: int = 3
    token: str = "x"  # each streamed chunk's text
    chunk_gap_s: float = 0.0
    hold: asyncio.Event | None = None  # a stream waits here after its first chunk
    first_chunk_delay_s: float = 0.0  # the time to its first token (or its whole JSON answer)
    requests: list[dict] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)  # lower-cased names
    raw_bodies: list[bytes] = field(default_factory=list)
    peer_nodelay: list[bool] = field(default_factory=list)  # TCP_NODELAY of accepted sockets
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    finished_streams: int = 0
    url: str = ""
    runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m} for m in self.models]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw)
        self.requests.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        self.raw_bodies.append(raw)
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is not None:
            self.peer_nodelay.append(bool(sock.getsockopt(IPPROTO_TCP, TCP_NODELAY)))
        if self.fail_status is not None and self.fail_text is not None:
            return web.Response(status=self.fail_status, body=self.fail_text)
        if self.fail_status is not None:
            return web.json_response(
                {"error": {"message": "injected", "type": "x"}}, status=self.fail_status
            )
        if self.first_chunk_delay_s:
            await asyncio.sleep(self.first_chunk_delay_s)
        chat = request.path.endswith("chat/completions")
        obj = "chat.completion" if chat else "text_completion"
        usage = {"prompt_tokens": 5, "completion_tokens": self.chunks, "total_tokens": 8}
        if not body.get("stream"):
            choice = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "x" * self.chunks},
                    "finish_reason": "stop",
                }
                if chat
                else {"index": 0, "text": "x" * self.chunks, "finish_reason": "stop"}
            )
            return web.json_response(
                {
                    "id": "c1",
                    "object": obj,
                    "created": 1,
                    "model": body["model"],
                    "choices": [choice],
                    "usage": usage,
                    "engine": self.name,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(self.chunks):
                tok = self.token
                delta = (
                    {"index": 0, "delta": {"content": tok}} if chat else {"index": 0, "text": tok}
                )
                delta["finish_reason"] = "stop" if i == self.chunks - 1 else None
                chunk = {
                    "id": "c1",
                    "object": obj + ".chunk",
                    "created": 1,
                    "model": body["model"],
                    "choices": [delta],
                }
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                if i == 0 and self.hold is not None:
                    await self.hold.wait()
                elif self.chunk_gap_s:
                    await asyncio.sleep(self.chunk_gap_s)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.finished_streams += 1
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected.set()
            raise
        return resp

    async def start(self) -> FakeEngine:
        self.runner, port = await serve(self.app(), "127.0.0.1", 0, drain_timeout_s=0.5)
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def info(self) -> EngineInfo:
        return EngineInfo(self.name, self.url, self.models, True)


class ListRouting:
    """A minimal RoutingService: round robin over its engines, honouring ``exclude``."""

    def __init__(self, engines: list[FakeEngine]) -> None:
        self.fakes = engines
        self.down = False  # raise on every call, as an unreachable remote router would
        self.shed_all = False
        self.forget_engines = False  # act like a router whose broker lost every engine
        self.reports: list[tuple[str, str, Outcome]] = []
        self.answers: list[tuple[str, int, int]] = []  # (request id, output tokens, stated cap)
        self.first_tokens: list[tuple[str, str, float]] = []
        self.routed: list[RouteRequest] = []
        self._n = 0

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("router down")

    async def route(self, request: RouteRequest) -> Decision:
        self._check()
        self.routed.append(request)
        if self.shed_all or self.forget_engines:
            return Decision(None, None, "shed", "list", retry_after_s=2.5, detail="test shed")
        cands = [
            f for f in self.fakes if f.name not in request.exclude and request.model in f.models
        ]
        if not cands:
            return Decision(None, None, "shed", "list", retry_after_s=1.0)
        self._n += 1
        f = cands[self._n % len(cands)]
        return Decision(f.name, f.url, "round_robin", "list", matched_bytes=len(request.key))

    async def report(
        self,
        request_id: str,
        engine_id: str,
        outcome: Outcome,
        output_tokens: int = 0,
        max_tokens: int = 0,
    ) -> None:
        self._check()
        self.reports.append((request_id, engine_id, outcome))
        self.answers.append((request_id, output_tokens, max_tokens))

    async def first_token(self, request_id: str, engine_id: str, ttft_ms: float) -> None:
        self._check()
        self.first_tokens.append((request_id, engine_id, ttft_ms))

    async def engines(self) -> list[EngineInfo]:
        self._check()
        if self.forget_engines:
            return []
        return [f.info() for f in self.fakes]


@dataclass
class Stack:
    engines: list[FakeEngine]
    routing: ListRouting
    gateway: Gateway
    runner: web.AppRunner
    url: str


@asynccontextmanager
async def gateway_stack(
    n_engines: int = 2,
    config: GatewayConfig | None = None,
    *,
    warm: asyncio.Event | None = None,
    **engine_kwargs: object,
) -> AsyncIterator[Stack]:
    """Fake engines, a ListRouting over them and a gateway on free loopback ports. With
    ``warm``, the routing service says it is ready (``ready()``) only once ``warm`` is set,
    as a router catching up with its broker does."""
    engines = [await FakeEngine(f"e{i}", **engine_kwargs).start() for i in range(n_engines)]
    routing = ListRouting(engines)
    if warm is not None:

        async def ready() -> bool:
            return warm.is_set()

        routing.ready = ready  # type: ignore[attr-defined]
    cfg = config or GatewayConfig(health_interval_s=0.2, refresh_interval_s=0.2)
    app = create_app(cfg, routing)
    runner, port = await serve(app, "127.0.0.1", 0, drain_timeout_s=cfg.drain_timeout_s)
    try:
        yield Stack(engines, routing, app[GATEWAY_KEY], runner, f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()
        for e in engines:
            await e.stop()


async def wait_until(predicate, timeout_s: float = 5.0) -> None:
    """Poll ``predicate`` (bounded) until it holds; fail the test otherwise."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)
