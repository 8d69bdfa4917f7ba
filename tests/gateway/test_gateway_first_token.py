"""The gateway tells the router when a streamed answer's first token came: for an engine that
sends no request events (a static one here, a plain vLLM behind the bridge in production) it is
the router's only word on when the prefill ended, and (``--fit-gateway-ttft``) on how fast the
engine is. The openai SDK streams through the real gateway and the embedded router to a fake
OpenAI engine whose first token takes far longer than its cost profile says."""

from __future__ import annotations

import asyncio

import openai
import pytest
from gw_harness import MODEL, FakeEngine, wait_until

from broker import MemoryBroker
from gateway.app import GATEWAY_KEY, create_app, serve
from gateway.config import GatewayConfig, parse_engine_spec
from gateway.routing import embedded_routing
from router.cluster_state import ClusterConfig
from router.core import RouterConfig

pytestmark = pytest.mark.timeout(60)

FIRST_TOKEN_S = 0.25  # the fake's time to first token: ~100x the profile's prefill of the prompt


async def test_a_streamed_first_token_ends_the_prefill_and_fits_the_engines_speed() -> None:
    release = asyncio.Event()  # the stream waits after its first chunk until this is set
    fake = await FakeEngine("s0", chunks=1, hold=release, first_chunk_delay_s=FIRST_TOKEN_S).start()
    spec = parse_engine_spec(f"s0={fake.url},{MODEL}")
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
                assert done.choices[0].text == "x"
                await wait_until(lambda: engine.inflight == 0, 5)
                assert engine.speed.prefill_evidence == 0.0
                stream = await oc.completions.create(
                    model=MODEL, prompt="p " * 200, max_tokens=2, stream=True
                )
                first = await anext(aiter(stream))
                assert first.choices[0].text == "x"
                # mid-stream: the router has the first token (the prefill is no longer queued
                # work there, the request decodes); with --fit-gateway-ttft the idle engine's
                # TTFT says it is slow
                await wait_until(lambda: bool(engine.decoding), 5)
                assert not engine.open_prefill and engine.inflight == 1
                assert engine.speed.prefill_evidence > 0.0
                assert engine.speed.prefill > 4.0
                release.set()
                assert [c async for c in stream] == []
                await wait_until(lambda: engine.inflight == 0, 5)
            finally:
                release.set()
                await oc.close()
                await gw_runner.cleanup()
    finally:
        await fake.stop()
