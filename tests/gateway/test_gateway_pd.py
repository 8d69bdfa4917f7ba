"""End to end, prefill/decode disaggregation: the openai SDK -> gateway -> embedded router ->
kvgate's simulated engines started with roles (prefill, decode), the KV handed over by the
two-phase request vLLM's connectors define (kvgate.kv_transfer); and each phase's engine
killed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import openai
import pytest
from gw_harness import wait_until

from bench.demo import MODEL
from gateway.app import GATEWAY_KEY, Gateway, create_app, serve
from gateway.config import GatewayConfig
from gateway.routing import embedded_routing

pytestmark = pytest.mark.timeout(120)


@dataclass
class PdStack:
    url: str
    gateway: Gateway
    runners: dict[str, object]  # engine id -> its runner
    servers: dict[str, object]  # engine id -> its EngineServer


@asynccontextmanager
async def pd_stack(roles: dict[str, str], **engine_kw) -> AsyncIterator[PdStack]:
    from broker import MemoryBroker
    from engine.server import ENGINE_KEY, EngineServerConfig
    from engine.server import serve as serve_engine

    broker = MemoryBroker()
    runners, servers = {}, {}
    try:
        for eid, role in roles.items():
            cfg = EngineServerConfig(engine_id=eid, model=MODEL, role=role, **engine_kw)
            runner, _ = await serve_engine(cfg, broker)
            runners[eid] = runner
            servers[eid] = runner.app[ENGINE_KEY]
        async with embedded_routing(broker, policy="e2") as routing:
            cfg = GatewayConfig(
                health_interval_s=0.2, refresh_interval_s=0.2, access_log=True, max_retries=3
            )
            app = create_app(cfg, routing.service, stats=routing.stats, on_drain=routing.on_drain)
            gw_runner, port = await serve(app, "127.0.0.1", 0, drain_timeout_s=2)
            gw = app[GATEWAY_KEY]
            try:
                await wait_until(
                    lambda: (
                        len([e for e in gw.pool.engines.values() if e.router_alive]) >= len(roles)
                    ),
                    15,
                )
                yield PdStack(f"http://127.0.0.1:{port}", gw, runners, servers)
            finally:
                await gw_runner.cleanup()
    finally:
        for r in runners.values():
            with contextlib.suppress(Exception):
                await r.cleanup()  # type: ignore[attr-defined]


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _route(raw) -> dict[str, str]:
    return dict(p.split("=", 1) for p in raw.headers["x-kvgate-route"].split(";"))


async def test_two_phase_request_through_the_openai_sdk(caplog) -> None:
    async with pd_stack({"p0": "prefill", "d0": "decode"}) as st:
        oc = client(st.url)
        prompt = "Disaggregate the prefill from the decode. " * 20
        raw = await oc.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=8, extra_headers={"x-kvgate-debug": "1"}
        )
        route = _route(raw)
        assert (route["prefill"], route["decode"]) == ("p0", "d0")
        comp = raw.parse()
        assert comp.choices[0].text and comp.usage.completion_tokens == 8
        # the decode engine computed only what the KV handover did not bring
        assert comp.usage.prompt_tokens_details.cached_tokens >= comp.usage.prompt_tokens - 16
        chunks, usage = [], None
        stream = await oc.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for ev in stream:
            if ev.choices and ev.choices[0].delta.content:
                chunks.append(ev.choices[0].delta.content)
            usage = ev.usage or usage
        assert chunks and usage is not None and usage.completion_tokens == 5
        # the client's errors are the engine's, unchanged
        with pytest.raises(openai.BadRequestError):
            await oc.completions.create(model=MODEL, prompt=prompt, max_tokens=-3)
        assert not st.servers["p0"].kv_leases  # every KV handed over was read
        # per-phase timings: metrics and the access log
        async with aiohttp.ClientSession() as s:
            text = await (await s.get(st.url + "/metrics")).text()
        assert 'kvgate_gateway_pd_phase_seconds_count{phase="prefill"}' in text
        assert 'kvgate_gateway_pd_phase_seconds_count{phase="decode_first_byte"}' in text
        await oc.close()


async def test_access_log_has_both_phases(capsys) -> None:
    from kvgate.logs import setup_logging

    setup_logging("info")
    async with pd_stack({"p0": "prefill", "d0": "decode"}) as st:
        oc = client(st.url)
        await oc.completions.create(model=MODEL, prompt="access " * 50, max_tokens=3)
        await oc.close()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if '"decode_engine"' in ln]
    assert lines, "no access-log line names a decode engine"
    rec = json.loads(lines[-1])
    assert rec["engine"] == "p0" and rec["decode_engine"] == "d0"
    assert rec["prefill_ms"] > 0 and rec["decode_first_byte_ms"] > 0
    logging.getLogger().handlers.clear()


async def test_mixed_fleet_serves_both_kinds() -> None:
    async with pd_stack({"p0": "prefill", "d0": "decode", "b0": "both"}) as st:
        oc = client(st.url)
        seen = set()
        for i in range(12):
            raw = await oc.completions.with_raw_response.create(
                model=MODEL,
                prompt=f"mixed fleet {i} " * 40,
                max_tokens=4,
                extra_headers={"x-kvgate-debug": "1"},
            )
            r = _route(raw)
            seen.add("pd" if "prefill" in r else r["engine"])
            assert raw.parse().usage.completion_tokens == 4
        assert "d0" not in seen  # a decode-only engine never runs a whole request
        await oc.close()


async def test_prefill_engine_killed_retries_on_another_prefill_engine() -> None:
    async with pd_stack({"p0": "prefill", "p1": "prefill", "d0": "decode"}) as st:
        oc = client(st.url)
        await st.runners["p0"].cleanup()  # type: ignore[attr-defined]
        for i in range(6):
            raw = await oc.completions.with_raw_response.create(
                model=MODEL,
                prompt=f"prefill kill {i} " * 40,
                max_tokens=3,
                extra_headers={"x-kvgate-debug": "1"},
            )
            assert _route(raw)["prefill"] == "p1"
            assert raw.parse().usage.completion_tokens == 3
        await oc.close()


async def test_decode_engine_killed_before_its_first_byte_retries_the_decode() -> None:
    async with pd_stack({"p0": "prefill", "d0": "decode", "d1": "decode"}) as st:
        oc = client(st.url)
        await st.runners["d0"].cleanup()  # type: ignore[attr-defined]
        decodes = set()
        for i in range(6):
            stream = await oc.completions.with_raw_response.create(
                model=MODEL,
                prompt=f"decode kill {i} " * 40,
                max_tokens=3,
                stream=True,
                extra_headers={"x-kvgate-debug": "1"},
            )
            r = _route(stream)
            decodes.add(r["decode"])
            text = "".join([ev.choices[0].text async for ev in stream.parse() if ev.choices])
            assert text
        assert decodes == {"d1"}
        # the prefill ran once per request: the KV waited for the second decode engine
        assert not st.servers["p0"].kv_leases
        assert st.servers["p0"].core.finished == 6
        await oc.close()


async def test_kv_gone_reruns_the_prefill() -> None:
    # the prefill engine has dropped the first KV when the decode engine asks for it (503
    # kv_transfer_failed): the gateway runs the prefill again, then the decode
    async with pd_stack({"p0": "prefill", "d0": "decode"}) as st:
        p0 = st.servers["p0"]
        take, calls = p0.take_kv, []

        def forgetful(request_id: str):
            calls.append(request_id)
            got = take(request_id)
            return None if len(calls) == 1 else got

        p0.take_kv = forgetful
        oc = client(st.url)
        raw = await oc.completions.with_raw_response.create(
            model=MODEL, prompt="gone " * 60, max_tokens=3, extra_headers={"x-kvgate-debug": "1"}
        )
        assert raw.parse().usage.completion_tokens == 3
        assert _route(raw)["decode"] == "d0" and len(calls) == 2
        assert p0.core.finished == 2  # the prefill ran again
        assert st.servers["d0"].core.finished == 1
        assert st.gateway.pool.engines["d0"].failures == 0  # not the decode engine's fault
        await oc.close()


async def test_all_decode_engines_dead_falls_back_to_the_prefill_engine() -> None:
    async with pd_stack({"p0": "prefill", "d0": "decode"}) as st:
        oc = client(st.url)
        await st.runners["d0"].cleanup()  # type: ignore[attr-defined]
        comp = await oc.completions.create(model=MODEL, prompt="alone " * 40, max_tokens=3)
        assert comp.usage.completion_tokens == 3
        await oc.close()


async def test_engine_rejects_bad_kv_transfer_params() -> None:
    async with pd_stack({"d0": "decode"}) as st:
        url = st.gateway.pool.engines["d0"].url
        async with aiohttp.ClientSession() as s:
            bad = {"do_remote_prefill": True, "remote_engine_id": "p0"}
            r = await s.post(
                url + "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 2, "kv_transfer_params": bad},
            )
            assert r.status == 400
            assert "remote_request_id" in (await r.json())["error"]["message"]
            far = {
                "do_remote_prefill": True, "remote_engine_id": "p0", "remote_request_id": "r",
                "remote_host": "10.0.0.1", "remote_port": 1, "remote_block_ids": [],
            }  # fmt: skip
            r = await s.post(
                url + "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 2, "kv_transfer_params": far},
            )
            assert r.status == 400 and "loopback" in (await r.json())["error"]["message"]
            gone = dict(far, remote_host="127.0.0.1", remote_port=9)
            r = await s.post(
                url + "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 2, "kv_transfer_params": gone},
            )
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "kv_transfer_failed"
        await asyncio.sleep(0)
