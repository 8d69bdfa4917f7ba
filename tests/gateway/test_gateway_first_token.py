"""The gateway tells the router when a streamed answer's first token came: for an engine that
sends no request events (a static one here, a plain vLLM behind the bridge in production) it is
the router's only word on when the prefill ended, and (``--fit-gateway-ttft``) on how fast the
engine is. The openai SDK streams through the real gateway and the embedded router to a fake
OpenAI engine whose first token takes far longer than its cost profile says."""

from __future__ import annotations

import asyncio

import openai
import orjson
import pytest
from aiohttp import web
from gw_harness import wait_until

from broker import MemoryBroker
from gateway.app import GATEWAY_KEY, create_app, serve
from gateway.config import GatewayConfig, parse_engine_spec
from gateway.routing import embedded_routing
from router.cluster_state import ClusterConfig
from router.core import RouterConfig

pytestmark = pytest.mark.timeout(60)

MODEL = "tiny"
FIRST_TOKEN_S = 0.25  # the fake's time to first token: ~100x the profile's prefill of the prompt


class SlowFirstToken:
    """An OpenAI completions server that waits ``FIRST_TOKEN_S`` before its first chunk, then
    holds the stream open until ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.first_sent = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        await asyncio.sleep(FIRST_TOKEN_S)
        chunk = {"id": "c", "object": "text_completion", "created": 0, "model": MODEL,
                 "choices": [{"index": 0, "text": "t", "finish_reason": None}]}  # fmt: skip
        if not body.get("stream"):
            chunk["choices"][0]["finish_reason"] = "stop"
            return web.json_response(chunk)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        self.first_sent.set()
        await self.release.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def test_a_streamed_first_token_ends_the_prefill_and_fits_the_engines_speed() -> None:
    fake = SlowFirstToken()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    spec = parse_engine_spec(f"s0=http://127.0.0.1:{port},{MODEL}")
    try:
        config = RouterConfig("e2", {}, ClusterConfig(fit_gateway_ttft=True))
        async with embedded_routing(
            MemoryBroker(), static_engines=(spec,), router=config
        ) as routing:
            cfg = GatewayConfig(health_interval_s=0.2, refresh_interval_s=0.2,
                                static_engines=(spec,))  # fmt: skip
            app = create_app(cfg, routing.service, stats=routing.stats)
            gw_runner, gw_port = await serve(app, "127.0.0.1", 0, drain_timeout_s=1)
            gw = app[GATEWAY_KEY]
            engine = routing.router.cluster.engines["s0"]
            oc = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{gw_port}/v1", api_key="x", max_retries=0
            )
            try:
                await wait_until(lambda: gw.ready_at is not None or len(gw.pool.engines) == 1, 10)
                # not streamed: the gateway sees no first token, the router learns nothing
                done = await oc.completions.create(model=MODEL, prompt="q " * 200, max_tokens=2)
                assert done.choices[0].text == "t"
                await wait_until(lambda: engine.inflight == 0, 5)
                assert engine.speed.prefill_evidence == 0.0
                stream = await oc.completions.create(
                    model=MODEL, prompt="p " * 200, max_tokens=2, stream=True
                )
                first = await anext(aiter(stream))
                assert first.choices[0].text == "t"
                # mid-stream: the router has the first token (the prefill is no longer queued
                # work there, the request decodes); with --fit-gateway-ttft the idle engine's
                # TTFT says it is slow
                await wait_until(lambda: bool(engine.decoding), 5)
                assert not engine.open_prefill and engine.inflight == 1
                assert engine.speed.prefill_evidence > 0.0
                assert engine.speed.prefill > 4.0
                fake.release.set()
                assert [c async for c in stream] == []
                await wait_until(lambda: engine.inflight == 0, 5)
            finally:
                fake.release.set()
                await oc.close()
                await gw_runner.cleanup()
    finally:
        await runner.cleanup()
