"""Bad input: every case an OpenAI-style JSON error with the right 4xx, never a 500 or a crash;
and the /metrics exposition passes ``promtool check metrics`` (or prometheus_client's parser)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import aiohttp
import orjson
import pytest
from gw_harness import MODEL, gateway_stack, wait_until

from gateway.config import GatewayConfig

C = "/v1/completions"
CHAT = "/v1/chat/completions"

# (path, raw body, extra headers, expected status, expected param or None)
CASES: list[tuple[str, bytes, dict[str, str], int, str | None]] = [
    (C, b"{not json", {}, 400, None),
    (C, b"", {}, 400, None),
    (C, b"[1, 2]", {}, 400, None),
    (C, b'"a string"', {}, 400, None),
    (C, b'{"prompt": "x"}', {}, 400, "model"),
    (C, b'{"model": 5, "prompt": "x"}', {}, 400, "model"),
    (C, b'{"model": "test-model"}', {}, 400, "prompt"),
    (C, b'{"model": "test-model", "prompt": 7}', {}, 400, "prompt"),
    (C, b'{"model": "test-model", "prompt": "x", "stream": "yes"}', {}, 400, "stream"),
    (C, b'{"model": "test-model", "prompt": "x", "max_tokens": -3}', {}, 400, "max_tokens"),
    (C, b'{"model": "test-model", "prompt": "x", "max_tokens": "9"}', {}, 400, "max_tokens"),
    (C, b'{"model": "test-model", "prompt": "x", "n": 2}', {}, 400, "n"),
    (C, b'{"model": "nope", "prompt": "x"}', {}, 404, "model"),
    (C, b'{"model": "test-model", "prompt": "x", "slo": {"ttft_ms": -1}}', {}, 400, "slo.ttft_ms"),
    (C, b'{"model": "test-model", "prompt": "x", "slo": {"class": "gold"}}', {}, 400, "slo.class"),
    (C, b'{"model": "test-model", "prompt": "x", "slo": 3}', {}, 400, "slo"),
    (C, b'{"model": "test-model", "prompt": "x"}', {"x-kvgate-ttft-ms": "fast"}, 400, None),
    (C, b'{"model": "test-model", "prompt": "x"}', {"x-kvgate-tpot-ms": "nan"}, 400, None),
    (C, b'{"model": "test-model", "prompt": "x"}', {"x-kvgate-slo-class": "zzz"}, 400, None),
    (C, b'{"model": "test-model", "prompt": "x", "kvgate": {"input_tokens": 0}}', {}, 400, None),
    (CHAT, b'{"model": "test-model"}', {}, 400, "messages"),
    (CHAT, b'{"model": "test-model", "messages": []}', {}, 400, "messages"),
    (CHAT, b'{"model": "test-model", "messages": ["hi"]}', {}, 400, "messages[0]"),
    (CHAT, b'{"model": "test-model", "messages": [{"content": "x"}]}', {}, 400, "messages[0].role"),
    (
        CHAT,
        b'{"model": "test-model", "messages": [{"role": "user", "content": 5}]}',
        {},
        400,
        "messages[0].content",
    ),
    (
        CHAT,
        b'{"model": "test-model", "messages": [{"role": "user"}], "tools": {}}',
        {},
        400,
        "tools",
    ),
    (C, b'{"model": "test-model", "prompt": "\xff\xfe"}', {}, 400, None),
    # token-id prompts: a nested array must be non-empty, and true is no token id
    (C, b'{"model": "test-model", "prompt": [[]]}', {}, 400, "prompt"),
    (C, b'{"model": "test-model", "prompt": [[true]]}', {}, 400, "prompt"),
    (C, b'{"model": "test-model", "prompt": [[1, 2], []]}', {}, 400, "prompt"),
    (C, b'{"model": "test-model", "prompt": [1, -2]}', {}, 400, "prompt"),
    # SLO numbers in the plain decimal syntax only (float() takes these)
    (C, b'{"model": "test-model", "prompt": "x"}', {"x-kvgate-ttft-ms": "1_000"}, 400, None),
    (
        C,
        b'{"model": "test-model", "prompt": "x", "slo": {"ttft_ms": "\xd9\xa1\xd9\xa0\xd9\xa0"}}',
        {},
        400,
        "slo.ttft_ms",
    ),
    # sampling parameters OpenAI bounds, and stop's type
    (C, b'{"model": "test-model", "prompt": "x", "temperature": 2.5}', {}, 400, "temperature"),
    (C, b'{"model": "test-model", "prompt": "x", "temperature": -0.1}', {}, 400, "temperature"),
    (C, b'{"model": "test-model", "prompt": "x", "temperature": "1"}', {}, 400, "temperature"),
    (C, b'{"model": "test-model", "prompt": "x", "top_p": 1.5}', {}, 400, "top_p"),
    (C, b'{"model": "test-model", "prompt": "x", "top_p": true}', {}, 400, "top_p"),
    (C, b'{"model": "test-model", "prompt": "x", "stop": 5}', {}, 400, "stop"),
    (C, b'{"model": "test-model", "prompt": "x", "stop": ["a", 1]}', {}, 400, "stop"),
    (
        CHAT,
        b'{"model": "test-model", "messages": [{"role": "user"}], "stop": {"a": 1}}',
        {},
        400,
        "stop",
    ),
    # a content part is an object (or a string): millions of numbers, each rendered for the
    # routing key on the event loop, held every client for a minute
    (
        CHAT,
        b'{"model": "test-model", "messages": [{"role": "user", "content": ["a", 1]}]}',
        {},
        400,
        "messages[0].content[1]",
    ),
    # nesting orjson reads (to 1,024) but cannot write (over 254): a 500 where re-encoded
    (
        CHAT,
        b'{"model": "test-model", "messages": [{"role": "user", "content": [{"type": "x", "a": '
        + b"[" * 300
        + b"]" * 300
        + b"}]}]}",
        {},
        400,
        None,
    ),
    (
        C,
        b'{"model": "test-model", "prompt": "x", "metadata": ' + b"[" * 300 + b"]" * 300 + b"}",
        {},
        400,
        None,
    ),
    # the gateway's field of a two-phase request: a client's made engines fail and be ejected
    (
        CHAT,
        b'{"model": "test-model", "messages": [{"role": "user", "content": "hi"}], '
        b'"kv_transfer_params": {"do_remote_prefill": true, "remote_port": 1}}',
        {},
        400,
        "kv_transfer_params",
    ),
]


async def test_bad_input_matrix() -> None:
    cfg = GatewayConfig(max_body_bytes=4096)
    async with gateway_stack(1, config=cfg) as st, aiohttp.ClientSession() as s:
        for path, raw, headers, want, param in CASES:
            async with s.post(
                st.url + path, data=raw, headers={"Content-Type": "application/json", **headers}
            ) as r:
                body = await r.read()
                assert r.status == want, (raw, r.status, body)
                assert r.content_type == "application/json"
                err = orjson.loads(body)["error"]
                assert isinstance(err["message"], str) and err["message"]
                assert err["type"] in ("invalid_request_error",)
                if param is not None:
                    assert err["param"] == param, (raw, err)
        # Too large: declared by Content-Length, and sent chunked without one.
        big = orjson.dumps({"model": MODEL, "prompt": "x" * 5000})
        async with s.post(st.url + C, data=big) as r:
            assert r.status == 413 and "error" in await r.json()

        async def chunks():
            for _ in range(10):
                yield b" " * 1000

        async with s.post(st.url + C, data=chunks()) as r:
            assert r.status == 413 and "error" in await r.json()
        # Wrong method, unknown path: JSON errors too.
        async with s.get(st.url + C) as r:
            assert r.status == 405 and "error" in await r.json()
        async with s.get(st.url + "/v2/nothing") as r:
            assert r.status == 404 and "error" in await r.json()
        # The engine never saw any of it, and the gateway still serves.
        assert st.engines[0].requests == []
        async with s.post(st.url + C, json={"model": MODEL, "prompt": "ok"}) as r:
            assert r.status == 200
        text = await (await s.get(st.url + "/metrics")).text()
        assert 'status="500"' not in text


async def _scrape_after_traffic() -> str:
    async with gateway_stack(2) as st, aiohttp.ClientSession() as s:
        await s.post(st.url + C, json={"model": MODEL, "prompt": "x", "stream": True})
        await s.post(st.url + C, json={"model": MODEL, "prompt": "x"})
        await s.post(st.url + C, data=b"{")
        st.engines[0].fail_status = 500
        for _ in range(3):
            await s.post(st.url + C, json={"model": MODEL, "prompt": "x"})
        async with s.get(st.url + "/metrics") as r:
            assert r.status == 200
            return await r.text()


async def test_metrics_pass_promtool_or_parser() -> None:
    text = await _scrape_after_traffic()
    for name in (
        "kvgate_gateway_requests_total",
        "kvgate_gateway_ttft_seconds_bucket",
        "kvgate_gateway_request_duration_seconds_bucket",
        "kvgate_gateway_routing_decisions_total",
        "kvgate_gateway_matched_prefix_bytes_bucket",
        "kvgate_gateway_retries_total",
        "kvgate_gateway_engine_up",
        "kvgate_gateway_router_degraded",
        "kvgate_gateway_broker_lag_seconds",
        "kvgate_gateway_open_connections",
        "kvgate_gateway_connections_refused_total",
        'kvgate_gateway_request_timeouts_total{part="head"}',
    ):
        assert name in text, name
    promtool = shutil.which("promtool")
    if promtool:
        res = subprocess.run(
            [promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30
        )
        assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()
        assert res.stdout.strip() == b"" and res.stderr.strip() == b"", "promtool lint warnings"
    else:  # validated by the reference parser instead (the CI image may lack promtool)
        from prometheus_client.parser import text_string_to_metric_families

        families = list(text_string_to_metric_families(text))
        assert len(families) >= 9


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded"])
async def test_content_type_is_not_required_to_be_json(ctype: str) -> None:
    # Like OpenAI's API, the body is parsed as JSON whatever the client labelled it.
    async with gateway_stack(1) as st, aiohttp.ClientSession() as s:
        raw = orjson.dumps({"model": MODEL, "prompt": "x"})
        async with s.post(st.url + C, data=raw, headers={"Content-Type": ctype}) as r:
            assert r.status == 200


async def test_connection_limits_through_the_gateway() -> None:
    """The gateway's config reaches its HTTP server: over --max-connections a client gets 503,
    a trickled head gets 408 after --head-timeout, and /metrics counts both."""
    cfg = GatewayConfig(max_connections=1, head_timeout_s=0.3, health_interval_s=60)
    async with gateway_stack(1, cfg) as st:
        port = int(st.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nX-Slow: ")  # holds the only slot, unfinished
        await writer.drain()
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        refused = await asyncio.wait_for(r2.read(-1), 5)
        w2.close()
        assert refused.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in refused
        late = await asyncio.wait_for(reader.read(-1), 5)  # 408 once the head is 0.3 s late
        writer.close()
        assert late.startswith(b"HTTP/1.1 408")
        await wait_until(lambda: st.gateway.metrics.connections.open == 0)
        async with aiohttp.ClientSession() as s, s.get(st.url + "/metrics") as r:
            text = await r.text()
    assert "kvgate_gateway_connections_refused_total 1.0" in text
    assert 'kvgate_gateway_request_timeouts_total{part="head"} 1.0' in text
