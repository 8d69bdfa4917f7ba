"""The proxy against small aiohttp upstreams and a tiny routing service (tests/gateway/gw_harness).

End-to-end tests with the real router and engine are in test_gateway_e2e.py.
"""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import orjson
import pytest
from gw_harness import MODEL, gateway_stack, wait_until

from gateway.app import MAX_FORWARDED_FIELDS
from gateway.config import GatewayConfig


async def post(session: aiohttp.ClientSession, url: str, body: dict | bytes, **headers: str):
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with session.post(
        url, data=data, headers={"Content-Type": "application/json", **headers}
    ) as r:
        return r.status, dict(r.headers), await r.read()


async def test_body_forwarded_byte_for_byte_with_request_id_and_slo_headers() -> None:
    async with gateway_stack(1) as st, aiohttp.ClientSession() as s:
        raw = b'{"model": "test-model", "prompt": "abc",  "weird_field": {"x": [1, 2]}}'
        status, headers, body = await post(
            s,
            st.url + "/v1/completions",
            raw,
            **{"x-request-id": "rid-1", "x-kvgate-ttft-ms": "300", "x-kvgate-debug": "1"},
        )
        assert status == 200
        assert headers["X-Request-ID"] == "rid-1"
        assert headers["x-kvgate-route"].startswith("policy=list;reason=round_robin;engine=e0")
        assert orjson.loads(body)["engine"] == "e0"
        eng = st.engines[0]
        assert eng.raw_bodies[0] == raw  # unknown fields and even whitespace untouched
        assert eng.headers[0]["x-request-id"] == "rid-1"
        assert eng.headers[0]["x-kvgate-ttft-ms"] == "300"
        assert "x-kvgate-debug" not in eng.headers[0]
        routed = st.routing.routed[0]
        assert routed.request_id == "rid-1" and routed.key == b"abc"
        assert routed.slo.ttft_ms == 300.0
        # No debug header asked: no route header; a request id is generated and echoed.
        status, headers, _ = await post(s, st.url + "/v1/completions", raw)
        assert status == 200 and "x-kvgate-route" not in headers
        assert len(headers["X-Request-ID"]) == 32
        assert eng.headers[1]["x-request-id"] == headers["X-Request-ID"]
        await wait_until(lambda: len(st.routing.reports) == 2)
        assert {o for _, _, o in st.routing.reports} == {"ok"}
        assert st.routing.first_tokens == []  # (not streamed: the gateway saw no first token)


async def test_sse_is_relayed_incrementally() -> None:
    hold = asyncio.Event()
    async with gateway_stack(1, hold=hold) as st, aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": "p", "stream": True}
        async with s.post(st.url + "/v1/completions", json=body) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
            # The upstream is still holding its stream open: the chunk was not buffered.
            assert first.startswith(b"data: {") and st.engines[0].finished_streams == 0
            # ... and the router hears of the first token now, not when the stream ends
            await wait_until(lambda: len(st.routing.first_tokens) == 1)
            rid, engine_id, ttft_ms = st.routing.first_tokens[0]
            assert rid == r.headers["X-Request-ID"] and engine_id == "e0"
            assert 0.0 < ttft_ms < 5000.0
            assert st.routing.reports == []
            hold.set()
            rest = await r.read()
        assert rest.endswith(b"data: [DONE]\n\n")
        assert st.engines[0].finished_streams == 1


async def test_client_disconnect_cancels_upstream() -> None:
    hold = asyncio.Event()
    async with gateway_stack(1, hold=hold) as st:
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": "p", "stream": True}
            async with s.post(st.url + "/v1/completions", json=body) as r:
                await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
                r.close()  # the client goes away mid-stream
        await asyncio.wait_for(st.engines[0].disconnected.wait(), 5)
        await wait_until(lambda: "cancelled" in {o for _, _, o in st.routing.reports})
        assert st.gateway.pool.engines["e0"].inflight == 0
        hold.set()


async def test_a_client_gone_mid_stream_is_counted_once() -> None:
    """One disconnect: one ``cancelled`` report, one count, one in-flight slot freed (the
    other stream's slot on the same engine stays counted)."""
    hold = asyncio.Event()
    async with gateway_stack(1, hold=hold) as st, aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": "p", "stream": True}
        kept = await s.post(st.url + "/v1/completions", json=body)
        await asyncio.wait_for(kept.content.readuntil(b"\n\n"), 5)
        async with s.post(st.url + "/v1/completions", json=body) as r:
            await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
            assert st.gateway.pool.engines["e0"].inflight == 2
            r.close()  # the client goes away mid-stream
        await asyncio.wait_for(st.engines[0].disconnected.wait(), 5)
        await wait_until(lambda: "cancelled" in {o for _, _, o in st.routing.reports})
        await asyncio.sleep(0.1)  # (a second count would have come by now)
        assert [o for _, _, o in st.routing.reports] == ["cancelled"]
        assert st.gateway.metrics.client_disconnects._value.get() == 1
        assert st.gateway.pool.engines["e0"].inflight == 1
        hold.set()
        await kept.read()
        kept.close()
        await wait_until(lambda: st.gateway.pool.engines["e0"].inflight == 0)


async def _raw_post(url: str, extra: bytes) -> tuple[int, dict[str, str]]:
    """A completion whose head carries ``extra`` header lines as raw bytes (a client library
    would refuse a non-ASCII byte): its status and headers."""
    host, port = url.removeprefix("http://").split(":")
    body = orjson.dumps({"model": MODEL, "prompt": "p"})
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)
    )
    raw = await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in head[1:])
    return int(head[0].split()[1]), {k.lower(): v for k, v in fields.items()}


async def test_a_client_request_id_is_kept_only_when_sane() -> None:
    """A sane x-request-id is kept and forwarded; an odd byte in it, a space or an
    over-long one is replaced by a generated id (never a 500, never an engine failure)."""
    async with gateway_stack(1) as st:
        status, headers = await _raw_post(st.url, b"x-request-id: req-42_A.b\r\n")
        assert status == 200 and headers["x-request-id"] == "req-42_A.b"
        assert st.engines[0].headers[-1]["x-request-id"] == "req-42_A.b"
        for bad in (b"\xffabc", b"a b", b"x" * 129, b"caf\xc3\xa9"):
            status, headers = await _raw_post(st.url, b"x-request-id: " + bad + b"\r\n")
            assert status == 200, bad
            rid = headers["x-request-id"]
            assert len(rid) == 32 and int(rid, 16) >= 0, (bad, rid)
            assert st.engines[0].headers[-1]["x-request-id"] == rid
        e0 = st.gateway.pool.engines["e0"]
        assert e0.failures == 0 and e0.breaker.state == "closed"


async def test_only_what_engines_need_of_the_clients_head_is_forwarded() -> None:
    """Duplicate fields, a 9 KB field, 200 fields, hop-by-hop ones: none reaches the engine
    (whose server would refuse the head with a plain-text 400); Authorization, the SLO headers
    and the first value of a repeated field do, with one Content-Type: application/json."""
    async with gateway_stack(1) as st:
        head = (
            b"Authorization: Bearer sk-engine\r\nContent-Type: text/plain\r\n"
            b"x-kvgate-ttft-ms: 5000\r\nx-kvgate-ttft-ms: 1\r\nConnection: x-hop\r\n"
            b"x-hop: dropped\r\nx-big: " + b"b" * 9000 + b"\r\nTE: trailers\r\n"
            b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
            + b"".join(b"x-junk-%d: v\r\n" % i for i in range(200))
        )
        status, headers = await _raw_post(st.url, head)
        assert status == 200, headers
        got = st.engines[0].headers[-1]
        assert got["authorization"] == "Bearer sk-engine"
        assert got["content-type"] == "application/json"
        assert got["x-kvgate-ttft-ms"] == "5000"  # the value the gateway read
        assert got["traceparent"].startswith("00-0af76519")
        assert "x-hop" not in got and "x-big" not in got and "te" not in got
        assert len(got) <= MAX_FORWARDED_FIELDS + 8  # (and aiohttp's own: host, length)


async def test_an_engines_error_that_is_not_json_reaches_the_client_as_json() -> None:
    async with gateway_stack(1) as st, aiohttp.ClientSession() as s:
        st.engines[0].fail_status = 400
        st.engines[0].fail_text = b"400, message: Duplicate 'Content-Type' header found"
        async with s.post(st.url + "/v1/completions", json={"model": MODEL, "prompt": "p"}) as r:
            assert r.status == 400 and r.content_type == "application/json"
            err = (await r.json())["error"]
            assert "Duplicate 'Content-Type'" in err["message"] and "e0" in err["message"]
            assert err["type"] == "invalid_request_error" and r.headers["x-request-id"]
        st.engines[0].fail_text = None  # an OpenAI JSON error: relayed as it is
        async with s.post(st.url + "/v1/completions", json={"model": MODEL, "prompt": "p"}) as r:
            assert r.status == 400 and (await r.json())["error"]["message"] == "injected"


async def test_5xx_before_first_byte_is_retried_on_another_engine() -> None:
    async with gateway_stack(2) as st, aiohttp.ClientSession() as s:
        st.engines[0].fail_status = 503
        for _ in range(6):
            status, _, body = await post(
                s, st.url + "/v1/completions", {"model": MODEL, "prompt": "x"}
            )
            assert status == 200 and orjson.loads(body)["engine"] == "e1"
        retried = [r for r in st.routing.routed if "e0" in r.exclude]
        assert retried, "the retry must exclude the failed engine"
        await wait_until(lambda: ("e0", "failed") in {(e, o) for _, e, o in st.routing.reports})
        # Three consecutive failures open e0's circuit: later requests never try it.
        assert st.gateway.pool.engines["e0"].breaker.state == "open"
        assert len(st.engines[0].requests) == 3


async def test_retries_are_bounded_and_last_error_relayed() -> None:
    cfg = GatewayConfig(max_retries=1, health_interval_s=60)
    async with gateway_stack(3, config=cfg) as st, aiohttp.ClientSession() as s:
        for e in st.engines:
            e.fail_status = 500
        status, _, body = await post(s, st.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert status == 500 and orjson.loads(body)["error"]["message"] == "injected"
        assert sum(len(e.requests) for e in st.engines) == 2  # one try + one retry


async def test_engine_killed_mid_run_requests_keep_succeeding() -> None:
    cfg = GatewayConfig(health_interval_s=0.2, refresh_interval_s=0.2)
    async with gateway_stack(3, config=cfg) as st, aiohttp.ClientSession() as s:
        statuses = []
        for i in range(30):
            if i == 5:
                await st.engines[1].stop()
            stream = i % 2 == 0
            body = {"model": MODEL, "prompt": f"q{i}", "stream": stream}
            status, _, _ = await post(s, st.url + "/v1/completions", body)
            statuses.append(status)
        assert statuses == [200] * 30
        assert st.gateway.pool.engines["e1"].breaker.state in ("open", "half_open")
        text = await (await s.get(st.url + "/metrics")).text()
        assert 'kvgate_gateway_engine_up{engine="e1"} 0.0' in text
        assert "kvgate_gateway_retries_total" in text


async def test_shed_becomes_429_with_retry_after() -> None:
    async with gateway_stack(1) as st, aiohttp.ClientSession() as s:
        st.routing.shed_all = True
        status, headers, body = await post(
            s, st.url + "/v1/completions", {"model": MODEL, "prompt": "x"}
        )
        assert status == 429 and headers["Retry-After"] == "3"
        err = orjson.loads(body)["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "slo_shed"


async def test_router_down_falls_back_to_least_load_and_says_so() -> None:
    async with gateway_stack(2) as st, aiohttp.ClientSession() as s:
        st.routing.down = True
        served = set()
        for i in range(6):
            status, headers, body = await post(
                s,
                st.url + "/v1/completions",
                {"model": MODEL, "prompt": str(i)},
                **{"x-kvgate-debug": "1"},
            )
            assert status == 200
            assert "policy=gateway_fallback;reason=least_load" in headers["x-kvgate-route"]
            served.add(orjson.loads(body)["engine"])
        assert served == {"e0", "e1"}  # least load with rotated ties spreads the work
        assert st.gateway.degraded
        text = await (await s.get(st.url + "/metrics")).text()
        assert "kvgate_gateway_router_degraded 1.0" in text
        st.routing.down = False
        await wait_until(lambda: not st.gateway.degraded, 5)
        status, headers, _ = await post(
            s,
            st.url + "/v1/completions",
            {"model": MODEL, "prompt": "x"},
            **{"x-kvgate-debug": "1"},
        )
        assert status == 200 and "policy=list" in headers["x-kvgate-route"]


async def test_router_that_lost_its_engines_does_not_stop_serving() -> None:
    async with gateway_stack(2) as st, aiohttp.ClientSession() as s:
        st.routing.forget_engines = True
        await wait_until(lambda: all(not e.router_alive for e in st.gateway.pool.engines.values()))
        status, _, _ = await post(s, st.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert status == 200


async def test_models_is_the_union_and_unknown_model_is_404() -> None:
    engines_models = [("a", "b"), ("b", "c")]
    async with gateway_stack(2) as st, aiohttp.ClientSession() as s:
        for eng, models in zip(st.engines, engines_models, strict=True):
            eng.models = models
        await st.gateway.refresh_engines()
        data = await (await s.get(st.url + "/v1/models")).json()
        assert [m["id"] for m in data["data"]] == ["a", "b", "c"]
        status, _, body = await post(s, st.url + "/v1/completions", {"model": "zzz", "prompt": "x"})
        err = orjson.loads(body)["error"]
        assert status == 404 and err["code"] == "model_not_found" and err["param"] == "model"
        # Routed per model: "c" only goes to the engine that serves it.
        for _ in range(3):
            status, _, body = await post(
                s, st.url + "/v1/completions", {"model": "c", "prompt": "x"}
            )
            assert status == 200 and orjson.loads(body)["engine"] == "e1"


async def test_health_ready_and_drain_admin() -> None:
    cfg = GatewayConfig(admin_token="s3cret", health_interval_s=0.2)
    async with gateway_stack(2, config=cfg) as st, aiohttp.ClientSession() as s:
        assert (await s.get(st.url + "/health")).status == 200
        assert (await s.get(st.url + "/ready")).status == 200
        assert (await s.get(st.url + "/admin/engines")).status == 401
        bad = {"Authorization": "Bearer nope"}
        assert (await s.get(st.url + "/admin/engines", headers=bad)).status == 401
        assert (await s.post(st.url + "/admin/engines/e0/drain", headers=bad)).status == 401
        good = {"Authorization": "Bearer s3cret"}
        r = await s.get(st.url + "/admin/engines", headers=good)
        assert r.status == 200
        assert {e["id"] for e in (await r.json())["engines"]} == {"e0", "e1"}
        r = await s.post(st.url + "/admin/engines/e0/drain", headers=good)
        assert r.status == 200 and (await r.json())["draining"] is True
        assert (await s.post(st.url + "/admin/engines/nope/drain", headers=good)).status == 404
        for _ in range(4):
            _, _, body = await post(s, st.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
            assert orjson.loads(body)["engine"] == "e1"
        await s.post(st.url + "/admin/engines/e0/undrain", headers=good)
        engines = set()
        for _ in range(4):
            _, _, body = await post(s, st.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
            engines.add(orjson.loads(body)["engine"])
        assert engines == {"e0", "e1"}
        # Every engine ejected or drained: not ready.
        await s.post(st.url + "/admin/engines/e0/drain", headers=good)
        await s.post(st.url + "/admin/engines/e1/drain", headers=good)
        assert (await s.get(st.url + "/ready")).status == 503


async def test_admin_disabled_without_token() -> None:
    async with gateway_stack(1) as st, aiohttp.ClientSession() as s:
        r = await s.get(st.url + "/admin/engines", headers={"Authorization": "Bearer x"})
        assert r.status == 404
        assert "error" in await r.json()


async def test_graceful_shutdown_drains_open_streams() -> None:
    hold = asyncio.Event()
    async with gateway_stack(1, hold=hold) as st, aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": "p", "stream": True}
        async with s.post(st.url + "/v1/completions", json=body) as r:
            await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
            shutdown = asyncio.create_task(st.runner.cleanup())
            await wait_until(lambda: st.gateway.shutting_down)
            hold.set()
            rest = await asyncio.wait_for(r.read(), 5)
        await asyncio.wait_for(shutdown, 5)
        assert rest.endswith(b"data: [DONE]\n\n")


async def test_tcp_nodelay_on_both_sides() -> None:
    async with gateway_stack(1) as st, aiohttp.ClientSession() as s:
        await post(s, st.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
        # The socket the gateway opened to the engine, as the engine sees it accepted...
        assert st.engines[0].peer_nodelay == [True]
        # ...and the gateway's side of it, and the client connections the gateway accepted.
        pool = st.gateway.upstream
        assert pool is not None
        upstream = [t.get_extra_info("socket") for t in pool.connections()]
        accepted = [p.transport.get_extra_info("socket") for p in st.runner.server.connections]
        assert upstream and accepted
        for sock in upstream + accepted:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


@pytest.mark.parametrize("streaming", [False, True])
async def test_upstream_unreachable_everywhere_is_a_502(streaming: bool) -> None:
    async with gateway_stack(2) as st, aiohttp.ClientSession() as s:
        for e in st.engines:
            await e.stop()
        body = {"model": MODEL, "prompt": "x", "stream": streaming}
        status, _, data = await post(s, st.url + "/v1/completions", body)
        assert status in (502, 429)
        assert "error" in orjson.loads(data)


async def test_engine_with_unusable_url_is_a_failure_not_a_crash() -> None:
    cfg = GatewayConfig(max_retries=1, health_interval_s=60)
    async with gateway_stack(2, config=cfg) as st, aiohttp.ClientSession() as s:
        st.engines[0].url = "ftp://engine-0"  # what the router now says e0 is at
        for _ in range(4):
            status, _, body = await post(
                s, st.url + "/v1/completions", {"model": MODEL, "prompt": "x"}
            )
            assert status == 200 and orjson.loads(body)["engine"] == "e1"
        assert st.gateway.pool.engines["e0"].failures >= 1
        st.engines[1].url = "ftp://engine-1"
        st.gateway.pool.engines["e0"].breaker.success()  # let both be tried again
        st.gateway.pool.changed()
        status, _, body = await post(s, st.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
        err = orjson.loads(body)["error"]
        assert status == 502 and "unusable URL" in err["message"]


async def test_busy_poll_spins_only_while_requests_are_open() -> None:
    hold = asyncio.Event()
    cfg = GatewayConfig(health_interval_s=0.2, refresh_interval_s=0.2, busy_poll=True)
    async with gateway_stack(1, config=cfg, hold=hold) as st, aiohttp.ClientSession() as s:
        busy = st.gateway.busy_poll
        assert busy is not None and not busy.spinning  # nothing open: nothing spins
        body = {"model": MODEL, "prompt": "p", "stream": True}
        async with s.post(st.url + "/v1/completions", json=body) as r:
            await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
            assert busy.spinning
            turns = busy.turns
            await asyncio.sleep(0.05)  # the stream is held open upstream
            assert busy.turns > turns + 10  # the loop kept turning without sleeping
            hold.set()
            assert (await r.read()).endswith(b"data: [DONE]\n\n")
        await wait_until(lambda: not busy.spinning)
        idle_turns = busy.turns
        await asyncio.sleep(0.05)
        assert busy.turns == idle_turns
        hold.clear()
        async with s.post(st.url + "/v1/completions", json=body) as r:  # a client that leaves
            await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
            assert busy.spinning
            r.close()
        await wait_until(lambda: not busy.spinning)
        hold.set()
        status, _, _ = await post(s, st.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert status == 200
        await wait_until(lambda: not busy.spinning)
    async with gateway_stack(1) as st:
        assert st.gateway.busy_poll is None  # off by default


async def test_a_broker_blip_shorter_than_the_grace_keeps_the_router() -> None:
    """A broker health check that fails once (a slow ping on a busy machine) must not switch
    the gateway to least load; failing for ``broker_grace_s`` does, and recovery switches back."""
    cfg = GatewayConfig(health_interval_s=0.1, refresh_interval_s=0.05, broker_grace_s=0.6)
    async with gateway_stack(2, cfg) as st:
        health = {"ok": True}

        async def stats() -> dict:
            return {"broker_ok": health["ok"], "broker_lag_s": 0.0}

        st.gateway.stats = stats
        health["ok"] = False
        await asyncio.sleep(0.3)
        assert not st.gateway.degraded and st.gateway.broker_ok
        health["ok"] = True
        await asyncio.sleep(0.2)
        health["ok"] = False  # the clock restarts after a good check
        await asyncio.sleep(0.4)
        assert not st.gateway.degraded
        await wait_until(lambda: st.gateway.degraded, 3.0)
        health["ok"] = True
        await wait_until(lambda: not st.gateway.degraded, 3.0)


async def test_answers_lengths_reach_the_router_with_the_cap_it_was_told() -> None:
    """The router learns how long answers are against their stated caps from the gateway when
    the engine does not say (a plain vLLM): an answer's ``usage.completion_tokens``, or a
    stream's data events (one a token, less [DONE]), beside the max_tokens the router was told
    (the request's, else the default). A failed answer reports no length."""
    async with gateway_stack(1) as st, aiohttp.ClientSession() as s:
        chunks = st.engines[0].chunks
        base = {"model": MODEL, "prompt": "p"}
        assert (await post(s, st.url + "/v1/completions", {**base, "max_tokens": 64}))[0] == 200
        async with s.post(
            st.url + "/v1/completions", json={**base, "max_tokens": 128, "stream": True}
        ) as r:
            assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        assert (await post(s, st.url + "/v1/chat/completions", chat))[0] == 200
        await wait_until(lambda: len(st.routing.answers) == 3)
        default = GatewayConfig().default_max_tokens
        assert [a[1:] for a in st.routing.answers] == [
            (chunks, 64),
            (chunks, 128),
            (chunks, default),
        ]
        st.engines[0].fail_status = 500
        await post(s, st.url + "/v1/completions", {**base, "max_tokens": 64})
        await wait_until(lambda: len(st.routing.answers) >= 4)
        assert st.routing.answers[3][1:] == (0, 0)
        # tokens whose text says "data:" (and a newline) are still one event each
        st.engines[0].fail_status = None
        st.engines[0].token = "\ndata: x\n\ndata: y"
        async with s.post(
            st.url + "/v1/completions", json={**base, "max_tokens": 128, "stream": True}
        ) as r:
            assert r.status == 200 and b"data: x" in await r.read()
        await wait_until(lambda: len(st.routing.answers) >= 5)
        assert st.routing.answers[4][1:] == (chunks, 128)
