"""The live engine over real HTTP on 127.0.0.1, with the openai SDK."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import openai
import orjson
import pytest

from broker import MemoryBroker
from broker.base import START_ID
from broker.codec import decode_batch
from broker.events import FirstToken, LoadHeartbeat, RequestEnqueued, RequestFinished
from engine.scheduler.state import SchedulerConfig
from engine.server import ENGINE_KEY, EngineServerConfig, serve

PROMPT = "You are a careful assistant. Answer briefly. " * 30 + "What is 2 + 2?"


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, MemoryBroker, object]]:
    broker = MemoryBroker()
    runner, url = await serve(EngineServerConfig(engine_id="e1", heartbeat_s=0.05), broker)
    yield url, broker, runner.app[ENGINE_KEY]
    await runner.cleanup()


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_completion_non_stream_and_cached_tokens_on_repeat(engine) -> None:
    url, _, _ = engine
    client = _client(url)
    r1 = await client.completions.create(model="kvgate-sim", prompt=PROMPT, max_tokens=7)
    assert r1.choices[0].finish_reason == "length"
    assert len(r1.choices[0].text) == 7 * 4
    assert r1.usage.completion_tokens == 7 and r1.usage.prompt_tokens == -(-len(PROMPT) // 4)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    r2 = await client.completions.create(model="kvgate-sim", prompt=PROMPT, max_tokens=7)
    assert r2.usage.prompt_tokens_details.cached_tokens > 0.9 * r2.usage.prompt_tokens


async def test_chat_streaming_with_usage(engine) -> None:
    url, _, _ = engine
    client = _client(url)
    stream = await client.chat.completions.create(
        model="kvgate-sim",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, reasons = "", None, []
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reasons.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    assert len(text) == 20 and reasons[-1] == "length"
    assert usage is not None and usage.completion_tokens == 5


async def test_a_conversation_s_next_turn_finds_the_answer_it_resends_cached(engine) -> None:
    """The openai SDK's conversation: the next turn resends the answer as an assistant message,
    and the engine cached that answer when it finished (as vLLM and SGLang cache output), so
    the whole history is a hit, not only the last prompt."""
    url, _, _ = engine
    client = _client(url)
    history = [{"role": "user", "content": PROMPT}]
    first = await client.chat.completions.create(
        model="kvgate-sim", messages=history, max_tokens=64
    )
    answer = first.choices[0].message.content or ""
    assert len(answer) == 64 * 4
    history += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    second = await client.chat.completions.create(
        model="kvgate-sim", messages=history, max_tokens=4
    )
    # the first turn's key (PROMPT and its wrapping) and the answer's 256 bytes: whole 64-byte
    # blocks of both, i.e. well past the first prompt's own
    first_key = len(b"<|user|>\n" + PROMPT.encode() + b"\n<|assistant|>\n")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (first_key + len(answer) + 1) // 64 * 16
    assert cached > first_key // 64 * 16 + 48


async def test_completion_streaming_and_chat_non_stream(engine) -> None:
    url, _, _ = engine
    client = _client(url)
    parts = [
        c.choices[0].text
        async for c in await client.completions.create(
            model="kvgate-sim", prompt="hello", max_tokens=4, stream=True
        )
    ]
    assert len("".join(parts)) == 16
    chat = await client.chat.completions.create(
        model="kvgate-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert (
        chat.choices[0].message.role == "assistant" and len(chat.choices[0].message.content) == 12
    )


async def test_bad_input_is_400_and_unknown_model_404(engine) -> None:
    url, _, _ = engine
    client = _client(url)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        await client.completions.create(model="kvgate-sim", prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="x-kvgate-ttft-ms"):
        await client.completions.create(
            model="kvgate-sim", prompt="x", extra_headers={"x-kvgate-ttft-ms": "-3"}
        )
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="other", prompt="x")
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", data=b"{") as r:
        assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]


async def test_an_odd_request_id_is_replaced_not_a_500(engine) -> None:
    """Hit directly with a request id holding a non-UTF-8 byte (which the answer's text and
    the events are made from), the engine answers with an id of its own; a sane id is kept."""
    url, _, _ = engine
    host, port = url.removeprefix("http://").split(":")
    body = b'{"model": "kvgate-sim", "messages": [{"role": "user", "content": "hi"}]}'
    for rid, kept in ((b"\xffabc", False), (b"my-id.1", True)):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nx-request-id: %s\r\nContent-Length: %d\r\n"
            b"\r\n%s" % (rid, len(body), body)
        )
        raw = await asyncio.wait_for(reader.read(-1), 10)
        writer.close()
        assert raw.startswith(b"HTTP/1.1 200"), raw[:300]
        answer = orjson.loads(raw.split(b"\r\n\r\n", 1)[1])
        assert (answer["id"] == rid.decode()) if kept else answer["id"].startswith("cmpl-")


@pytest.mark.timeout(60)
async def test_a_request_no_engine_could_hold_is_a_400_at_once(engine) -> None:
    """Prompt and answer beyond the engine's KV in all: OpenAI's 400 context_length_exceeded,
    answered before any work (not a retryable 429 after the whole answer's text was made:
    seconds for 6M tokens, forever for a hint near 2**62); the engine serves on."""
    url, _, server = engine
    msgs = [{"role": "user", "content": "hi"}]
    cases = (
        ("/v1/chat/completions", {"messages": msgs, "max_tokens": 6_000_000}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": msgs, "kvgate": {"output_tokens": 2**62}},
            "messages",
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 300_000}, "prompt"),
        ("/v1/completions", {"prompt": "word " * 1_000_000, "max_tokens": 2}, "prompt"),
    )
    async with aiohttp.ClientSession() as s:
        for path, body, param in cases:
            t0 = asyncio.get_running_loop().time()
            async with s.post(url + path, json={"model": "kvgate-sim", **body}) as r:
                err = (await r.json())["error"]
                assert r.status == 400, (body, err)
            assert asyncio.get_running_loop().time() - t0 < 2.0
            assert err["code"] == "context_length_exceeded" and err["param"] == param
            assert "maximum context length is 224000 tokens" in err["message"]
    assert server.core.rejected == 0  # refused before the scheduler
    client = _client(url)
    r = await client.chat.completions.create(model="kvgate-sim", messages=msgs, max_tokens=3)
    assert r.usage.completion_tokens == 3


async def test_a_long_answer_s_text_is_made_only_when_it_ends(engine, monkeypatch) -> None:
    """The text a chat answer adds to the next turn's key is made when the answer ends, not
    on arrival: a long answer cancelled early costs no more than the tokens it sent."""
    import engine.server as engine_server

    url, _, server = engine
    asked: list[int] = []
    real = engine_server.tokens_text

    def counting(rid: str, start: int, count: int) -> str:
        asked.append(count)
        return real(rid, start, count)

    monkeypatch.setattr(engine_server, "tokens_text", counting)
    body = {
        "model": "kvgate-sim",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 100_000,
        "stream": True,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200
        await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
        r.close()
    for _ in range(100):  # bounded: the engine sees the client gone within its poll
        if not server.core.running and not server.core.waiting:
            break
        await asyncio.sleep(0.05)
    assert asked and max(asked) < 1000, max(asked)


async def test_infeasible_slo_is_429_with_the_reason(engine) -> None:
    url, _, _ = engine
    with pytest.raises(openai.RateLimitError, match="TTFT SLO of 250 ms cannot be met"):
        await _client(url).completions.create(
            model="kvgate-sim", prompt="x" * 40_000, extra_body={"slo": {"class": "chat"}}
        )
    with pytest.raises(openai.RateLimitError, match="TTFT SLO"):
        await _client(url).chat.completions.create(
            model="kvgate-sim",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"kvgate": {"input_tokens": 20_000}},
            extra_headers={"x-kvgate-slo-class": "image"},
        )


async def test_trace_hint_sets_token_counts(engine) -> None:
    url, _, _ = engine
    r = await _client(url).completions.create(
        model="kvgate-sim",
        prompt="short",
        max_tokens=50,
        extra_body={"kvgate": {"input_tokens": 900, "output_tokens": 3}},
    )
    assert r.usage.prompt_tokens == 900 and r.usage.completion_tokens == 3


async def test_events_reach_the_broker_with_the_request_id(engine) -> None:
    url, broker, server = engine
    await _client(url).completions.create(
        model="kvgate-sim", prompt=PROMPT, max_tokens=2, extra_headers={"x-request-id": "rq-42"}
    )
    await asyncio.sleep(0.15)
    await server.reporter.flush()
    events = []
    for _, entries in await broker.read({"e1": START_ID}):
        for _, fields in entries:
            events.extend(env.event for env in decode_batch(fields))
    mine = [type(e) for e in events if getattr(e, "request_id", None) == "rq-42"]
    assert mine[0] is RequestEnqueued and FirstToken in mine and mine[-1] is RequestFinished
    hb = [e for e in events if isinstance(e, LoadHeartbeat)]
    assert hb and hb[-1].url == url and hb[-1].models == ("kvgate-sim",)


async def test_probes_and_metrics(engine) -> None:
    url, _, _ = engine
    await _client(url).completions.create(model="kvgate-sim", prompt=PROMPT, max_tokens=3)
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/get_load") as r:
            assert isinstance((await r.json())["load"], int)
        for path in ("/server_info", "/get_server_info"):
            async with s.get(url + path) as r:
                info = await r.json()
                assert info["dp_size"] == 1 and info["kvgate"]["engine_id"] == "e1"
        for path in ("/model_info", "/get_model_info"):
            async with s.get(url + path) as r:
                assert (await r.json())["model_path"] == "kvgate-sim"
        async with s.get(url + "/health") as r:
            assert r.status == 200
        async with s.get(url + "/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "kvgate-sim"
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    for name in (
        "kvgate_engine_running",
        "kvgate_engine_waiting",
        "kvgate_engine_kv_usage_ratio",
        "kvgate_engine_prefix_hit_bytes",
        "kvgate_engine_ttft_seconds_bucket",
        "kvgate_engine_tpot_seconds_bucket",
        "kvgate_engine_delivery_drift_seconds_bucket",
    ):
        assert name in text
    assert 'kvgate_engine_requests_total{outcome="finished"} 1.0' in text


async def test_client_disconnect_cancels_the_request() -> None:
    cfg = EngineServerConfig(engine_id="e2", scheduler=SchedulerConfig())
    runner, url = await serve(cfg)
    server = runner.app[ENGINE_KEY]
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": "kvgate-sim", "prompt": "x", "max_tokens": 100_000, "stream": True}
            async with s.post(url + "/v1/completions", json=body) as r:
                await r.content.readline()
                assert server.core.running == 1
        for _ in range(100):
            if server.core.running == 0:
                break
            await asyncio.sleep(0.02)
        assert server.core.running == 0
    finally:
        await runner.cleanup()


async def test_tokens_are_delivered_on_the_schedulers_timeline() -> None:
    runner, url = await serve(EngineServerConfig(engine_id="e3"))
    server = runner.app[ENGINE_KEY]
    try:
        client = _client(url)
        await asyncio.gather(
            *(
                client.completions.create(
                    model="kvgate-sim", prompt=f"{i} " + PROMPT, max_tokens=20
                )
                for i in range(8)
            )
        )
        drift = server.drift_summary()
        assert drift["samples"] >= 8
        # Not a timing assertion on this shared machine: delivery can never precede production.
        assert drift["p50_ms"] >= 0
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_chunk_templates_match_the_full_json(endpoint: str, include_usage: bool) -> None:
    """The precomputed token-chunk bytes are exactly orjson's rendering of the whole chunk."""
    import orjson

    from engine.server import _Chunker
    from kvgate.openai_request import parse_request

    body: dict = {"model": "kvgate-sim", "stream": True, "max_tokens": 4}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    parsed = parse_request(endpoint, body, {})  # type: ignore[arg-type]
    chunker = _Chunker(parsed, 'rid-"quoted"\\')
    chunker.started = True  # compare token chunks only (the chat role chunk is generic)
    for text in (" abc", ' "q"\n\u00e9', ""):
        for finish in (False, True):
            if endpoint == "chat" and not text:
                continue  # an empty delta goes through the generic builder
            field: dict = {"delta": {"content": text}} if endpoint == "chat" else {"text": text}
            choice = {"index": 0, **field, "logprobs": None, "finish_reason": None}
            choice["finish_reason"] = "length" if finish else None
            data: dict = {
                "id": chunker.rid,
                "object": "chat.completion.chunk" if endpoint == "chat" else "text_completion",
                "created": chunker.created,
                "model": "kvgate-sim",
                "choices": [choice],
            }
            if include_usage:
                data["usage"] = None
            assert chunker.text(text, finish) == b"data: " + orjson.dumps(data) + b"\n\n"
