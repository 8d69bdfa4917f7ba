"""The gateway's two-phase request against a strict fake of vLLM's disaggregated serving: two
fake engines that check every ``kv_transfer_params`` exchange as vLLM's NIXL connector defines
it (vllm/distributed/kv_transfer/kv_connector/v1/nixl: the prefill request asks
``do_remote_decode`` with the remote fields null, one token, unary; its answer carries
``do_remote_prefill`` and where the blocks wait; the decode request is the client's own plus
exactly those params) and fail the request otherwise. Static engines with roles, the embedded
router, the openai SDK."""

from __future__ import annotations

import uuid

import openai
import orjson
import pytest
from aiohttp import web
from gw_harness import wait_until

from broker import MemoryBroker
from gateway.app import GATEWAY_KEY, create_app, serve
from gateway.config import GatewayConfig, parse_engine_spec
from gateway.routing import embedded_routing

pytestmark = pytest.mark.timeout(60)

MODEL = "tiny"
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class StrictVllm:
    """One fake vLLM engine of a P/D pair; ``errors`` lists every protocol violation seen."""

    def __init__(self, role: str, registry: dict[str, dict]) -> None:
        self.role = role
        self.registry = registry  # remote_request_id -> the params a prefill handed out
        self.engine_id = str(uuid.uuid4())
        self.errors: list[str] = []
        self.seen: list[dict] = []
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    def fail(self, why: str) -> web.Response:
        self.errors.append(why)
        return web.json_response({"error": {"message": why, "type": "BadRequestError"}}, status=400)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        rid = request.headers.get("x-request-id")
        params = body.get("kv_transfer_params")
        if not rid:
            return self.fail("no x-request-id")
        if self.role == "prefill":
            if params != PREFILL_PARAMS:
                return self.fail(f"prefill params {params!r}")
            if body.get("max_tokens") != 1 or body.get("stream") or "stream_options" in body:
                return self.fail("a prefill is one token, unary")
            handed = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [[1, 2, 3]],
                "remote_engine_id": self.engine_id,
                "remote_request_id": rid,
                "remote_host": "127.0.0.1",
                "remote_port": self.port + 1000,
                "tp_size": 1,
                "remote_num_tokens": 40,
            }
            self.registry[rid] = handed
            return web.json_response(
                {
                    "id": f"cmpl-{rid}",
                    "object": "text_completion",
                    "model": MODEL,
                    "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41},
                    "kv_transfer_params": handed,
                }
            )
        # decode
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return self.fail(f"decode without remote prefill params: {params!r}")
        expected = self.registry.pop(params.get("remote_request_id"), None)
        if expected != params:
            return self.fail(f"decode params {params!r} are not what the prefill handed out")
        n = body.get("max_tokens")
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(n):
                chunk = {
                    "id": "c",
                    "object": "text_completion",
                    "model": MODEL,
                    "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}],
                }
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response(
            {
                "id": "c",
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": "t" * n, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 40, "completion_tokens": n, "total_tokens": 40 + n},
            }
        )


async def test_gateway_speaks_vllms_kv_transfer_params_exchange() -> None:
    registry: dict[str, dict] = {}
    fakes = {"p0": StrictVllm("prefill", registry), "d0": StrictVllm("decode", registry)}
    runners = []
    specs = []
    try:
        for eid, fake in fakes.items():
            runner = web.AppRunner(fake.app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            fake.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            runners.append(runner)
            specs.append(
                parse_engine_spec(f"{eid}=http://127.0.0.1:{fake.port},{MODEL},role={fake.role}")
            )
        assert specs[0].role == "prefill" and specs[1].role == "decode"
        async with embedded_routing(MemoryBroker(), static_engines=tuple(specs)) as routing:
            cfg = GatewayConfig(
                health_interval_s=0.2, refresh_interval_s=0.2, static_engines=tuple(specs)
            )
            app = create_app(cfg, routing.service, stats=routing.stats)
            gw_runner, port = await serve(app, "127.0.0.1", 0, drain_timeout_s=1)
            gw = app[GATEWAY_KEY]
            try:
                await wait_until(lambda: gw.ready_at is not None or len(gw.pool.engines) == 2, 10)
                oc = openai.AsyncOpenAI(
                    base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0
                )
                raw = await oc.completions.with_raw_response.create(
                    model=MODEL,
                    prompt="a prompt " * 30,
                    max_tokens=5,
                    extra_headers={"x-kvgate-debug": "1"},
                )
                assert "prefill=p0;decode=d0" in raw.headers["x-kvgate-route"]
                assert raw.parse().choices[0].text == "ttttt"
                stream = await oc.completions.create(
                    model=MODEL, prompt="another " * 30, max_tokens=3, stream=True
                )
                assert "".join([c.choices[0].text async for c in stream]) == "t0t1t2"
                await oc.close()
            finally:
                await gw_runner.cleanup()
    finally:
        for r in runners:
            await r.cleanup()
    assert fakes["p0"].errors == [] and fakes["d0"].errors == []
    assert len(fakes["p0"].seen) == 2 and len(fakes["d0"].seen) == 2
    assert registry == {}  # every handed-out KV was claimed by a decode
    # the decode request is the client's own (max_tokens, stream kept)
    assert [b["max_tokens"] for b in fakes["d0"].seen] == [5, 3]
    assert [bool(b.get("stream")) for b in fakes["d0"].seen] == [False, True]
