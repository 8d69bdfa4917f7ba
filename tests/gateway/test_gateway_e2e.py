"""End to end: the openai SDK -> gateway -> real router -> kvgate's simulated engines.

Engines publish through a broker (the in-process one, or a private Redis that the test stops);
the router is ``router.core.Router`` in ``router.service.EmbeddedRouter`` (or the remote one).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import openai
import pytest
from gw_harness import wait_until

from bench.demo import MODEL, DemoOptions, check_policies, compare, demo_stack, format_table
from gateway.app import GATEWAY_KEY, Gateway, create_app, serve
from gateway.config import GatewayConfig
from gateway.routing import embedded_routing

pytestmark = pytest.mark.timeout(120)
ADMIN = "s3cret"


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def test_openai_sdk_through_gateway_to_simulated_engines() -> None:
    async with demo_stack("e2", 2) as stack:
        oc = client(stack.url)
        prompt = "Tell me about prefix caches. " * 20
        comp = await oc.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
        assert comp.choices[0].text and comp.usage.completion_tokens == 8
        chat = await oc.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6
        )
        assert chat.choices[0].message.content and chat.usage.completion_tokens == 6
        pieces = []
        stream = await oc.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for ev in stream:
            if ev.choices:
                pieces.append(ev.choices[0].text)
        assert "".join(pieces)
        chunks = []
        stream = await oc.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        async for ev in stream:
            if ev.choices and ev.choices[0].delta.content:
                chunks.append(ev.choices[0].delta.content)
            usage = ev.usage or usage
        assert chunks and usage is not None and usage.completion_tokens == 5
        # Same prompt again: the router sends it where it is cached, and the engine says so.
        raw = await oc.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=4, extra_headers={"x-kvgate-debug": "1"}
        )
        route = raw.headers["x-kvgate-route"]
        assert "policy=e2" in route
        again = raw.parse()
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        # Unknown model: the SDK's NotFoundError with OpenAI's error shape.
        with pytest.raises(openai.NotFoundError):
            await oc.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        models = await oc.models.list()
        assert [m.id for m in models.data] == [MODEL]
        await oc.close()


async def test_openai_sdk_conversation_goes_where_its_history_and_answer_are_cached() -> None:
    """A conversation through the gateway: each next turn resends the answers so far, goes to
    the engine holding the history (the router learnt the answer's blocks from that engine's
    events) and finds the history cached there, the answers included."""
    async with demo_stack("e2", 3) as stack:
        oc = client(stack.url)
        messages = [{"role": "user", "content": "Explain prefix caching in detail. " * 40}]
        engines, cached, history_tokens = [], [], []
        for turn in range(3):
            raw = await oc.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=48, extra_headers={"x-kvgate-debug": "1"}
            )
            engines.append(raw.headers["x-kvgate-route"].split("engine=")[1].split(";")[0])
            answer = raw.parse()
            cached.append(answer.usage.prompt_tokens_details.cached_tokens)
            history_tokens.append(answer.usage.prompt_tokens)
            messages += [
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": f"And then, part {turn + 2}?"},
            ]
            await asyncio.sleep(0.3)  # the engine's events reach the router
        assert len(set(engines)) == 1
        # each next turn: all but the last partial block of its history and the new question
        # (64 bytes a block, 4 a token), the previous answer's 48 tokens included
        for before, now in zip(history_tokens, cached[1:], strict=False):
            assert now >= before + 48 - 16
        await oc.close()


@dataclass
class LiveStack:
    url: str
    gateway: Gateway
    engine_runners: list
    engine_urls: list[str]


@asynccontextmanager
async def live_stack(
    engine_broker_url: str, router_broker_url: str, prefix: str, n: int = 3
) -> AsyncIterator[LiveStack]:
    """Engines on one broker connection, the embedded router on another (as separate processes
    would be), and a gateway with fast health checks."""
    import broker as broker_mod
    from engine.server import EngineServerConfig
    from engine.server import serve as serve_engine

    eb = await broker_mod.connect(engine_broker_url, prefix=prefix)
    rb = await broker_mod.connect(router_broker_url, prefix=prefix) if router_broker_url else eb
    runners, urls = [], []
    try:
        for i in range(n):
            r, u = await serve_engine(EngineServerConfig(engine_id=f"engine-{i}", model=MODEL), eb)
            runners.append(r)
            urls.append(u)
        async with embedded_routing(rb, policy="e2") as routing:
            cfg = GatewayConfig(
                health_interval_s=0.2,
                refresh_interval_s=0.2,
                debug_header=True,
                access_log=False,
                admin_token=ADMIN,
            )
            app = create_app(cfg, routing.service, stats=routing.stats, on_drain=routing.on_drain)
            gw_runner, port = await serve(app, "127.0.0.1", 0, drain_timeout_s=2)
            gw = app[GATEWAY_KEY]
            try:
                await wait_until(
                    lambda: len([e for e in gw.pool.engines.values() if e.router_alive]) >= n, 15
                )
                yield LiveStack(f"http://127.0.0.1:{port}", gw, runners, urls)
            finally:
                await gw_runner.cleanup()
    finally:
        for r in runners:
            with contextlib.suppress(Exception):
                await r.cleanup()
        for b in {id(eb): eb, id(rb): rb}.values():
            with contextlib.suppress(Exception):
                await b.close()


async def _traffic(url: str, n: int, tag: str, stream: bool = False) -> list[int]:
    """``n`` requests, 4 at a time, with a few shared prefixes; their statuses."""
    sem = asyncio.Semaphore(4)
    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> int:
            body = {
                "model": MODEL,
                "prompt": f"shared prefix {i % 3} " * 30 + f"{tag}-{i}",
                "max_tokens": 3,
                "stream": stream,
            }
            async with sem, s.post(url + "/v1/completions", json=body) as r:
                await r.read()
                return r.status

        return list(await asyncio.gather(*(one(i) for i in range(n))))


async def test_engine_killed_mid_run() -> None:
    async with live_stack("memory://", "", "kvgate:", n=3) as st:
        assert set(await _traffic(st.url, 12, "before")) == {200}
        # What the embedded router sees: every engine, the 12 requests it routed, its loads.
        async with aiohttp.ClientSession() as s:
            assert (await s.get(st.url + "/admin/router")).status == 401
            r = await s.get(st.url + "/admin/router", headers={"Authorization": f"Bearer {ADMIN}"})
            state = await r.json()
        engines = {e["engine_id"]: e for e in state["engines"]}
        assert set(engines) == {"engine-0", "engine-1", "engine-2"}
        assert sum(e["routed_total"] for e in engines.values()) == 12
        assert sum(e["window_requests"] for e in engines.values()) == 12
        assert all(
            e["window_ms"] > 0 and e["tpot_ms"] > 0
            for e in engines.values()
            if e["window_requests"] > 0
        )
        assert state["policy"] == "e2" and state["broker"]["connected"]
        # Kill engine-1 while requests are in flight: its port stops answering.
        killer = asyncio.create_task(st.engine_runners[1].cleanup())
        statuses = await _traffic(st.url, 30, "during", stream=True)
        await killer
        statuses += await _traffic(st.url, 30, "after")
        assert set(statuses) == {200}, statuses
        assert st.gateway.pool.engines["engine-1"].breaker.state != "closed"


@pytest.mark.redis
async def test_redis_stopped_mid_run_gateway_keeps_serving(private_redis, redis_prefix) -> None:
    async with live_stack(private_redis.url, private_redis.url, redis_prefix, n=2) as st:
        assert set(await _traffic(st.url, 10, "before")) == {200}
        private_redis.stop()
        await wait_until(lambda: st.gateway.degraded, 10)
        statuses = await _traffic(st.url, 20, "during", stream=True)
        assert set(statuses) == {200}
        async with aiohttp.ClientSession() as s:
            text = await (await s.get(st.url + "/metrics")).text()
        assert "kvgate_gateway_router_degraded 1.0" in text
        private_redis.start()
        await wait_until(lambda: not st.gateway.degraded, 20)
        assert set(await _traffic(st.url, 6, "after")) == {200}


async def test_demo_compares_policies_quickly() -> None:
    opts = DemoOptions(engines=2, duration_s=3.0, rate=6.0, max_requests=24)
    summaries = await compare(opts)
    assert [s["policy"] for s in summaries] == ["e2", "round_robin"]
    for s in summaries:
        assert s["ok"] >= s["requests"] * 0.9 and s["requests"] > 5
        assert sum(s["per_engine_requests"].values()) >= s["ok"]
        assert s["prefix_hit_rate"] is not None
    table = format_table(summaries)
    assert "e2" in table and "round_robin" in table and "TTFT p50" in table
    # policy specs as the simulator takes them: an ablation alias, options in brackets
    specs = ("e2-by-load", "e2[tie_rel=0.1]")
    assert check_policies(specs) is None
    opts = DemoOptions(engines=2, duration_s=3.0, rate=6.0, max_requests=24, policies=specs)
    summaries = await compare(opts)
    assert [s["policy"] for s in summaries] == list(specs)
    assert all(s["ok"] >= s["requests"] * 0.9 and s["requests"] > 5 for s in summaries)
    # a typo is a one-line error before anything starts
    assert "unknown policy 'e2-bogus'" in (check_policies(["e2", "e2-bogus"]) or "")
    assert "tie_rel" in (check_policies(["e2[tie_rel=fast]"]) or "")


async def test_remote_router_mode_and_router_outage() -> None:
    """Gateway -> `kvgate router` over HTTP (router.service app + router.client.RemoteRouter);
    when the router process goes away the gateway keeps serving on least load."""
    from broker import MemoryBroker
    from engine.server import EngineServerConfig
    from engine.server import serve as serve_engine
    from gateway.routing import RoutingOptions, build_router, open_routing
    from router.service import EmbeddedRouter
    from router.service import create_app as create_router_app

    broker = MemoryBroker()
    engines = [
        await serve_engine(EngineServerConfig(engine_id=f"engine-{i}", model=MODEL), broker)
        for i in range(2)
    ]
    router_app = create_router_app(EmbeddedRouter(build_router("e2", 0, {}), broker))
    router_runner, router_port = await serve(router_app, "127.0.0.1", 0, drain_timeout_s=1)
    try:
        opts = RoutingOptions(router_url=f"http://127.0.0.1:{router_port}")
        async with open_routing(opts) as routing:
            cfg = GatewayConfig(
                refresh_interval_s=0.2,
                health_interval_s=0.2,
                debug_header=True,
                admin_token=ADMIN,
            )
            app = create_app(cfg, routing.service)
            gw_runner, port = await serve(app, "127.0.0.1", 0, drain_timeout_s=1)
            gw = app[GATEWAY_KEY]
            url = f"http://127.0.0.1:{port}"
            try:
                await wait_until(lambda: len(gw.pool.engines) == 2, 10)
                oc = client(url)
                raw = await oc.completions.with_raw_response.create(
                    model=MODEL, prompt="remote " * 40, max_tokens=3
                )
                assert "policy=e2" in raw.headers["x-kvgate-route"]
                # the router's state is its own service's (GET /state), not the gateway's
                async with aiohttp.ClientSession() as s:
                    auth = {"Authorization": f"Bearer {ADMIN}"}
                    r = await s.get(url + "/admin/router", headers=auth)
                    assert r.status == 404 and "GET /state" in (await r.json())["error"]["message"]
                await router_runner.cleanup()  # the router goes away
                raw = await oc.completions.with_raw_response.create(
                    model=MODEL, prompt="remote " * 40, max_tokens=3
                )
                assert "policy=gateway_fallback" in raw.headers["x-kvgate-route"]
                assert gw.degraded
                statuses = await _traffic(url, 10, "outage")
                assert set(statuses) == {200}
                await oc.close()
            finally:
                await gw_runner.cleanup()
    finally:
        await router_runner.cleanup()
        for r, _ in engines:
            await r.cleanup()


async def test_a_request_no_engine_could_ever_hold_is_a_400_not_a_429() -> None:
    """Beyond every engine's KV in all (224,000 tokens on the demo's profile), whether the
    router sheds it (a 1.25M-token prompt) or an engine is asked (max_tokens 300,000): OpenAI's
    400 context_length_exceeded, which the openai SDK does not retry; no engine counts it as a
    failure; an overload stays a 429."""
    async with demo_stack("e2", 2) as stack, aiohttp.ClientSession() as s:
        for body in (
            {"prompt": "word " * 1_000_000, "max_tokens": 2},
            {"prompt": "hi", "max_tokens": 300_000},
        ):
            async with s.post(stack.url + "/v1/completions", json={"model": MODEL, **body}) as r:
                err = (await r.json())["error"]
                assert r.status == 400, err
            assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
            assert "Retry-After" not in r.headers
        pool = stack.gateway.pool
        assert all(e.failures == 0 for e in pool.engines.values())
        oc = client(stack.url)
        comp = await oc.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        assert comp.usage.completion_tokens == 3
