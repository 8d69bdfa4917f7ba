"""``--forward-slo``: the gateway writes each request's SLO where vLLM's scheduler sees it
(``vllm_xargs``, kvgate.slo_forward), and sets vLLM's priority from it on request."""

from __future__ import annotations

import argparse

import aiohttp
import orjson
from gw_harness import MODEL, gateway_stack

from gateway.cli import add_arguments, config_from_args
from gateway.config import GatewayConfig
from kvgate.slo import SLO_CLASSES


async def post(s: aiohttp.ClientSession, url: str, body: dict, **headers: str) -> int:
    async with s.post(url, data=orjson.dumps(body), headers=headers) as r:
        await r.read()
        return r.status


def config(mode: str) -> GatewayConfig:
    return GatewayConfig(health_interval_s=0.2, refresh_interval_s=0.2, forward_slo=mode)


async def test_the_slo_reaches_the_engine_in_vllm_xargs() -> None:
    async with gateway_stack(1, config("vllm")) as st, aiohttp.ClientSession() as s:
        url = st.url + "/v1/completions"
        body = {"model": MODEL, "prompt": "p", "vllm_xargs": {"mine": "x"}}
        body["slo"] = {"class": "file"}
        chat_headers = {"x-request-id": "r1", "x-kvgate-slo-class": "chat"}
        assert await post(s, url, body, **chat_headers) == 200
        assert await post(s, url, {"model": MODEL, "prompt": "q"}, **{"x-request-id": "r2"}) == 200
        assert await post(s, url, {"model": MODEL, "prompt": "q", "slo": {"ttft_ms": 900}}) == 200
        first, second, third = st.engines[0].requests
        chat, relaxed = SLO_CLASSES["chat"], SLO_CLASSES["relaxed"]
        assert first["vllm_xargs"] == {
            "mine": "x",  # the client's own extra args stay
            "kvgate_slo_class": "chat",  # the header wins over the body, as in kvgate.slo
            "kvgate_ttft_ms": chat.ttft_ms,
            "kvgate_tpot_ms": chat.tpot_ms,
            "kvgate_request_id": "r1",
        }
        assert "slo" not in first and "priority" not in first
        # no SLO stated: the gateway's default class (relaxed unless --default-slo says else)
        assert second["vllm_xargs"]["kvgate_slo_class"] == "relaxed"
        assert second["vllm_xargs"]["kvgate_ttft_ms"] == relaxed.ttft_ms
        assert third["vllm_xargs"]["kvgate_ttft_ms"] == 900.0
        assert third["vllm_xargs"]["kvgate_slo_class"] == "custom"


async def test_priority_mode_sets_vllms_priority_from_the_ttft_slo() -> None:
    async with gateway_stack(1, config("vllm-priority")) as st, aiohttp.ClientSession() as s:
        url = st.url + "/v1/chat/completions"
        msgs = [{"role": "user", "content": "hi"}]
        headers = {"x-kvgate-slo-class": "search"}
        assert await post(s, url, {"model": MODEL, "messages": msgs}, **headers) == 200
        assert st.engines[0].requests[0]["priority"] == 4000


async def test_off_by_default_the_body_goes_as_sent() -> None:
    assert GatewayConfig().forward_slo == "none"
    async with gateway_stack(1) as st, aiohttp.ClientSession() as s:
        raw = {"model": MODEL, "prompt": "p", "slo": {"class": "chat"}}
        assert await post(s, st.url + "/v1/completions", raw) == 200
        assert st.engines[0].requests[0] == raw


def test_the_cli_option() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--forward-slo", "vllm-priority"])
    assert config_from_args(args).forward_slo == "vllm-priority"
