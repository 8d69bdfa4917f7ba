"""Live replay against a tiny local aiohttp server with known timing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from bench.replay import ReplayConfig, engine_from_headers, replay
from bench.workloads import WorkloadOptions, build_workload
from bench.workloads.request import Request, Segment, Turn
from kvgate.slo import Slo

FIRST_DELAY = 0.05
TOKEN_GAP = 0.01
STALL = 0.1  # the last gap of each stream
N_TOKENS = 5


def _req(i: int, arrival: float, *, chat: bool = False, ttft_ms: float = 1000) -> Request:
    turns = (Turn("user", (Segment(i, 400),)),) if chat else (Turn("", (Segment(i, 400),)),)
    return Request(
        f"r{i}",
        arrival,
        turns,
        100,
        N_TOKENS,
        slo=Slo(ttft_ms, 100.0),
        endpoint="chat" if chat else "completions",
    )


async def _start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _app(seen: list[dict], release: asyncio.Event | None = None) -> web.Application:
    release = release or asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        seen.append({"path": request.path, "headers": dict(request.headers), "body": body})
        if body.get("max_tokens") == 99:
            return web.json_response(
                {"error": {"message": "slo cannot be met", "type": "x"}}, status=429
            )
        if body.get("max_tokens") == 98:
            await asyncio.wait_for(release.wait(), 30)  # a hung upstream
        if not body.get("stream"):  # a unary answer: the same tokens in one message
            await asyncio.sleep(FIRST_DELAY)
            text = "".join(f"t{i} " for i in range(N_TOKENS))
            return web.json_response(
                {
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                    "usage": {"prompt_tokens": 100, "completion_tokens": N_TOKENS},
                }
            )
        resp = web.StreamResponse(headers={"x-kvgate-route": "policy=e2;reason=explore;engine=e7"})
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        await asyncio.sleep(FIRST_DELAY)
        chat = request.path.endswith("chat/completions")
        if chat:  # a role-only chunk first, as vLLM sends: not a token
            await resp.write(b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n')
        for i in range(N_TOKENS):
            if i:  # the last gap is a stall, which the record's max_gap_s shows
                await asyncio.sleep(STALL if i == N_TOKENS - 1 else TOKEN_GAP)
            choice = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
            await resp.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
        usage = {
            "prompt_tokens": 100,
            "completion_tokens": N_TOKENS,
            "prompt_tokens_details": {"cached_tokens": 64},
        }
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/v1/chat/completions", handle)
    return app


async def test_replay_records_ttft_tpot_usage_status_and_engine(tmp_path: Path) -> None:
    seen: list[dict] = []
    runner, url = await _start(_app(seen))
    try:
        reqs = [_req(0, 0.0), _req(1, 0.02, chat=True), _req(2, 0.04).with_(output_tokens=99)]
        result = await replay(reqs, ReplayConfig(url, progress=False))
    finally:
        await runner.cleanup()
    by_id = {r.request_id: r for r in result.records}
    for rid in ("r0", "r1"):
        rec = by_id[rid]
        assert rec.status == 200 and rec.ok, rec.error
        assert FIRST_DELAY <= rec.ttft_s < 5
        assert rec.tpot_s >= TOKEN_GAP * 0.9
        assert rec.max_gap_s >= STALL * 0.9 and rec.max_gap_s > rec.tpot_s
        assert rec.e2e_s >= rec.ttft_s + (N_TOKENS - 1) * TOKEN_GAP * 0.9
        assert rec.completion_tokens == N_TOKENS and rec.cached_tokens == 64
        assert rec.engine == "e7" and rec.reason == "explore"
        assert rec.slo_met
    shed = by_id["r2"]
    assert shed.status == 429 and not shed.ok and "slo cannot be met" in shed.error
    assert result.summary["status"] == {"200": 2, "429": 1}
    assert result.summary["prefix_hit_rate"] == pytest.approx(0.64)
    # what was sent: paths, the trace hint, SLO headers, streaming with usage
    paths = sorted(s["path"] for s in seen)
    assert paths == ["/v1/chat/completions", "/v1/completions", "/v1/completions"]
    first = next(s for s in seen if s["body"].get("prompt") and s["body"]["max_tokens"] == 5)
    assert first["body"]["kvgate"] == {"input_tokens": 100, "output_tokens": N_TOKENS}
    assert first["body"]["stream_options"] == {"include_usage": True}
    assert first["headers"]["x-kvgate-ttft-ms"] == "1000"
    assert first["headers"]["x-kvgate-tpot-ms"] == "100"
    # files
    result.write(tmp_path / "r.jsonl", tmp_path / "s.json")
    lines = (tmp_path / "r.jsonl").read_bytes().splitlines()
    assert [orjson.loads(x)["request_id"] for x in lines] == ["r0", "r1", "r2"]
    assert orjson.loads((tmp_path / "s.json").read_bytes())["requests"] == 3


async def test_replay_is_open_loop_and_bounded() -> None:
    seen: list[dict] = []
    release = asyncio.Event()
    runner, url = await _start(_app(seen, release))
    try:
        reqs = [_req(i, i * 0.01) for i in range(20)]
        res = await replay(reqs, ReplayConfig(url, max_requests=6, progress=False))
        assert len(res.records) == 6
        # open loop: all six were sent before the first one finished (~0.09 s)
        assert len(seen) == 6
        seen.clear()
        res = await replay(reqs, ReplayConfig(url, max_duration_s=0.035, progress=False))
        assert [r.request_id for r in res.records] == ["r0", "r1", "r2", "r3"]
        seen.clear()
        hung = [_req(0, 0.0).with_(output_tokens=98), _req(1, 0.0)]
        res = await replay(hung, ReplayConfig(url, drain_timeout_s=0.5, progress=False))
        by_id = {r.request_id: r for r in res.records}
        assert by_id["r1"].ok
        assert not by_id["r0"].ok and "cancelled" in by_id["r0"].error
    finally:
        release.set()
        await runner.cleanup()


async def test_replay_sends_a_conversation_s_next_turn_after_the_answer_it_resends() -> None:
    """A turn naming the one before it (``Request.after``) is sent when that answer has ended
    plus the turns' gap in the workload (0.01 s here, against an answer of ~0.19 s), and its
    latencies count from then; the other requests stay open loop."""
    seen: list[dict] = []
    runner, url = await _start(_app(seen))
    reply = Segment(77, 20)  # the workload's answer text, which the live answer replaces
    first = _req(0, 0.0, chat=True).with_(reply=reply)
    turns = (*first.turns, Turn("assistant", (reply,)), Turn("user", (Segment(78, 40),)))
    second = _req(1, 0.01, chat=True).with_(turns=turns, after="r0", reply=Segment(79, 20))
    try:
        # unary answers too: the follower resends the message it got
        await replay([first, second], ReplayConfig(url, progress=False, stream=False))
        assert seen[1]["body"]["messages"][1]["content"] == "t0 t1 t2 t3 t4 "
        seen.clear()
        reqs = [first, second, _req(2, 0.02)]
        t0 = asyncio.get_running_loop().time()
        res = await replay(reqs, ReplayConfig(url, progress=False))
    finally:
        await runner.cleanup()
    # r2 (no predecessor) went out while r0 was still answering; r1 only after r0's answer,
    # resending the answer r0 got in place of the workload's (as a client resends what it got)
    assert [s["body"].get("prompt") is not None for s in seen] == [False, True, False]
    sent = seen[2]["body"]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[1]["content"] == "t0 t1 t2 t3 t4 " != reply.render().decode()
    assert all(r.ok for r in res.records)
    r0, r1, _ = res.records
    answered = r0.e2e_s
    assert answered >= FIRST_DELAY + STALL
    assert r1.ttft_s < answered  # counted from when it was sent, not from its arrival
    assert asyncio.get_running_loop().time() - t0 >= answered + 0.01 + r1.e2e_s


async def test_replay_without_hint_and_unreachable_target() -> None:
    seen: list[dict] = []
    runner, url = await _start(_app(seen))
    try:
        reqs = build_workload("tool_use", WorkloadOptions(rate=50, duration=0.1))[:2]
        cfg = ReplayConfig(url, send_hint=False, slo_headers=False, progress=False, model="m")
        res = await replay(reqs, cfg)
        assert all(r.ok for r in res.records)
        assert all("kvgate" not in s["body"] and s["body"]["model"] == "m" for s in seen)
        assert all("x-kvgate-ttft-ms" not in s["headers"] for s in seen)
    finally:
        await runner.cleanup()
    res = await replay([_req(0, 0.0)], ReplayConfig(url, progress=False, request_timeout_s=2))
    (rec,) = res.records
    assert rec.status == 0 and rec.error and not rec.ok


def test_engine_from_headers() -> None:
    assert engine_from_headers({"x-kvgate-route": "policy=e2;reason=exploit;engine=a"}) == "a"
    assert engine_from_headers({"x-kvgate-route": "policy=e2;reason=shed;engine=-"}) is None
    assert engine_from_headers({"x-kvgate-engine": "b"}) == "b"
    assert engine_from_headers({}) is None
