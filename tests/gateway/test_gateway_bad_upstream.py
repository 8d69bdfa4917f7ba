"""Engines that misbehave, through the whole gateway: every case ends in a clean JSON error for
the client or a cleanly ended stream (an SSE error event, then the end of the chunked body),
never a crash, a hung request or a leaked upstream connection; the gateway keeps serving."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import orjson
import pytest
from gw_harness import MODEL, ListRouting
from raw_server import ok_response, raw_server

from gateway.app import GATEWAY_KEY, Gateway, create_app, serve
from gateway.config import GatewayConfig
from router.api import EngineInfo

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
EVENT = b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


# What the engine does with a completion request, by case.
CASES: dict[str, bytes | list[bytes | float | str]] = {
    "garbage": [b"\x16\x03\x01 not http at all\r\n\r\n", "close"],
    "oversized_head": [b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", "close"],
    "truncated_body": [b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"partial', "close"],
    "reset_before_answer": ["reset"],
    "silent": [30.0],
    "bad_chunking": [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nxyz\r\n", "close"],
    "stream_reset_mid_way": [SSE_HEAD + chunk(EVENT), 0.05, "reset"],
    "stream_truncated": [SSE_HEAD + chunk(EVENT) + chunk(EVENT), 0.05, "close"],
    "stream_stalls": [SSE_HEAD + chunk(EVENT), 30.0],
    "stream_bad_chunking": [SSE_HEAD + chunk(EVENT), 0.05, b"zz\r\n", 1.0, "close"],
}


@dataclass
class RawEngine:
    """An engine on a raw server: healthy for /health and /v1/models, scripted otherwise."""

    name: str
    case: str
    url: str = ""
    models: tuple[str, ...] = (MODEL,)

    def info(self) -> EngineInfo:
        return EngineInfo(self.name, self.url, self.models, True)

    async def script(self, conn, n, head, body, w):
        if head.startswith(b"GET /health"):
            w.write(ok_response())
            return None
        if head.startswith(b"GET /v1/models"):
            w.write(ok_response(orjson.dumps({"data": [{"id": MODEL}]})))
            return None
        for step in CASES[self.case]:
            if isinstance(step, bytes):
                w.write(step)
                await w.drain()
            elif isinstance(step, float):
                await asyncio.sleep(step)
            else:
                return step
        return None


@asynccontextmanager
async def bad_stack(case: str) -> AsyncIterator[tuple[str, Gateway]]:
    engine = RawEngine("bad", case)
    async with raw_server(engine.script) as (url, _):
        engine.url = url
        routing = ListRouting([engine])  # type: ignore[list-item]
        cfg = GatewayConfig(max_retries=0, idle_timeout_s=0.4, health_interval_s=60)
        app = create_app(cfg, routing)
        runner, port = await serve(app, "127.0.0.1", 0, drain_timeout_s=1.0)
        try:
            yield f"http://127.0.0.1:{port}", app[GATEWAY_KEY]
        finally:
            await runner.cleanup()


async def no_leak(gw: Gateway) -> None:
    """Every upstream connection still open is an idle, pooled one."""
    pool = gw.upstream
    assert pool is not None
    for _ in range(100):
        if len(pool.connections()) == pool.idle_count():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(pool.connections())} open, {pool.idle_count()} idle")


@pytest.mark.parametrize(
    "case",
    [
        "garbage",
        "oversized_head",
        "truncated_body",
        "reset_before_answer",
        "silent",
        "bad_chunking",
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_broken_answer_before_any_byte_is_a_json_error(case: str, stream: bool) -> None:
    async with bad_stack(case) as (url, gw), aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        body = {"model": MODEL, "prompt": "x", "stream": stream}
        async with s.post(url + "/v1/completions", json=body) as r:
            data = await r.read()
            # Not an event stream: the body is read whole before answering, so a body that
            # breaks is as much an upstream error as a head that does.
            assert r.status == (504 if case == "silent" else 502), data
        assert time.monotonic() - t0 < 5
        err = orjson.loads(data)["error"]
        assert err["message"] and err["type"] in ("upstream_error", "upstream_timeout")
        await no_leak(gw)
        text = await (await s.get(url + "/metrics")).text()
        assert "kvgate_gateway_upstream_errors_total" in text
        assert 'status="500"' not in text  # never an internal error


@pytest.mark.parametrize(
    "case", ["stream_reset_mid_way", "stream_truncated", "stream_stalls", "stream_bad_chunking"]
)
async def test_stream_that_breaks_after_its_first_byte_ends_cleanly(case: str) -> None:
    async with bad_stack(case) as (url, gw), aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        body = {"model": MODEL, "prompt": "x", "stream": True}
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            data = await asyncio.wait_for(r.read(), 5)  # the chunked body ends properly
        assert time.monotonic() - t0 < 5
        events = [e for e in data.split(b"\n\n") if e]
        assert events[0] == EVENT.strip()  # what the engine sent was relayed
        err = orjson.loads(events[-1].removeprefix(b"data: "))["error"]
        assert "stream broke" in err["message"]
        if case == "stream_stalls":
            assert "no byte" in err["message"]
        await no_leak(gw)
        assert gw.open_streams == 0
        assert gw.pool.engines["bad"].inflight == 0
        # The gateway still serves (the next request meets the same broken engine).
        async with s.get(url + "/ready") as r:
            assert r.status in (200, 503)


async def test_slow_client_pauses_the_engine_and_gets_every_byte() -> None:
    """A streamed answer far larger than the socket buffers on the way, read by a client that
    stops reading for a while: the engine is held back (the gateway buffers nothing), and
    every byte arrives once the client reads again."""
    piece = b"data: " + b"y" * 65_000 + b"\n\n"
    total_pieces = 1000  # ~65 MB
    written = 0

    class Streamer(RawEngine):
        async def script(self, conn, n, head, body, w):
            nonlocal written
            if not head.startswith(b"POST"):
                return await super().script(conn, n, head, body, w)
            w.write(SSE_HEAD)
            for _ in range(total_pieces):
                w.write(chunk(piece))
                await w.drain()
                written += 1
            w.write(b"0\r\n\r\n")
            await w.drain()
            return None

    engine = Streamer("big", "")
    async with raw_server(engine.script) as (url, _):
        engine.url = url
        cfg = GatewayConfig(max_retries=0, health_interval_s=60)
        app = create_app(cfg, ListRouting([engine]))  # type: ignore[list-item]
        runner, port = await serve(app, "127.0.0.1", 0, drain_timeout_s=1.0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = orjson.dumps({"model": MODEL, "prompt": "x", "stream": True})
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.transport.pause_reading()
            await asyncio.sleep(0.5)
            held = written
            await asyncio.sleep(0.3)
            assert written == held < total_pieces  # the engine waits for the client
            writer.transport.resume_reading()
            received = 0
            tail = b""
            while not tail.endswith(b"\n\n\r\n0\r\n\r\n"):
                data = await asyncio.wait_for(reader.read(1 << 20), 10)
                assert data, "the stream ended early"
                received += len(data)
                tail = (tail + data)[-16:]
            assert received > total_pieces * len(piece) and written == total_pieces
            writer.close()
            await no_leak(app[GATEWAY_KEY])
        finally:
            await runner.cleanup()
