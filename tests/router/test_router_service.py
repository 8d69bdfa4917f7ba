"""The router's shells: engines publishing through real Redis, a router following them, the
HTTP service and RemoteRouter over 127.0.0.1, and a restarted router rebuilding its state."""

from __future__ import annotations

import asyncio
import base64
import random
import re
import time
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web

import broker as broker_mod
from broker.base import BrokerError
from broker.codec import encode_batch
from broker.events import BlockRemoved, BlockStored, Envelope, LoadHeartbeat, RequestFinished
from broker.memory import MemoryBroker
from engine_reporter import Reporter
from engine_reporter.hashing import chain_hashes, split_blocks
from router.api import RouteRequest
from router.client import RemoteRouter, RouterUnavailable
from router.core import Router, RouterConfig
from router.service import EmbeddedRouter, create_app

pytestmark = pytest.mark.redis

DOC_A = bytes(range(256)) * 32  # 8 KiB
DOC_B = bytes(reversed(range(256))) * 32
FAST = {"block_ms": 20, "discover_interval_s": 0.05, "snapshot_poll_s": 0.05}


def heartbeat(engine_id: str, url: str = "") -> LoadHeartbeat:
    return LoadHeartbeat(
        0, 0, 0, 0, 14_000, 0.0, "mistral-7b-a6000", url or f"http://{engine_id}", ("m",)
    )


def stored(key: bytes) -> tuple[BlockStored, list[int]]:
    blocks = list(split_blocks(key, 64))
    hashes = chain_hashes(None, blocks)
    return BlockStored(None, tuple(hashes), tuple(blocks)), hashes


async def until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def _reporters(broker, n: int) -> list[Reporter]:
    out = []
    for i in range(n):
        rep = Reporter(broker, f"eng{i}", flush_interval_s=0.002, registry_ttl_s=5.0)
        await rep.start()
        rep.emit(heartbeat(f"eng{i}"))
        out.append(rep)
    return out


async def serve_router(service: EmbeddedRouter) -> tuple[web.AppRunner, str]:
    """``kvgate router``'s HTTP app around ``service`` on a free loopback port."""
    runner = web.AppRunner(create_app(service))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def req(rid: str, key: bytes) -> RouteRequest:
    return RouteRequest(rid, "m", key, len(key) // 4, 16)


async def test_decisions_follow_cache_contents_published_through_redis(
    redis_url: str, redis_prefix: str
) -> None:
    engines_broker = await broker_mod.connect(redis_url, prefix=redis_prefix)
    router_broker = await broker_mod.connect(redis_url, prefix=redis_prefix)
    reps = await _reporters(engines_broker, 3)
    router = Router(RouterConfig("e2"), random.Random(0))
    service = EmbeddedRouter(router, router_broker, consumer_options=FAST)
    await service.start()
    try:
        await until(lambda: sum(e.alive for e in router.engines(time.time())) == 3)
        bs_a, hashes_a = stored(DOC_A)
        bs_b, _ = stored(DOC_B)
        reps[1].emit(bs_a)
        reps[2].emit(bs_b)
        await until(lambda: router.cluster.tree.match(DOC_A + DOC_B).per_engine != {})
        await until(lambda: router.cluster.tree.match(DOC_B).per_engine == {"eng2": len(DOC_B)})
        d = await service.route(req("q1", DOC_A + b"what is this?"))
        assert (d.engine_id, d.reason, d.matched_bytes) == ("eng1", "exploit", len(DOC_A))
        d = await service.route(req("q2", DOC_B + b"and this?"))
        assert (d.engine_id, d.reason) == ("eng2", "exploit")
        # eng1 evicts DOC_A: the next request for it is no longer an exploit on eng1
        reps[1].emit(BlockRemoved(tuple(hashes_a)))
        await until(lambda: "eng1" not in router.cluster.tree.match(DOC_A).per_engine)
        router.cluster.spec.clear_engine("eng1")  # the router's own guess from q1
        d = await service.route(req("q3", DOC_A + b"again"))
        assert d.reason != "exploit"
        # the engine's finish event releases the in-flight slot
        before = router.cluster.engines["eng2"].inflight
        assert before >= 1
        reps[2].emit(RequestFinished("q2", 16, 40.0, 20.0))
        await until(lambda: router.cluster.engines["eng2"].inflight == before - 1)
        assert router.cluster.released_by["event"] == 1
        st = service.state()
        assert st["broker"]["events"] > 0 and st["broker"]["malformed"] == 0
    finally:
        await service.close()
        for rep in reps:
            await rep.close()
        await engines_broker.close()
        await router_broker.close()


async def test_restarted_router_rebuilds_state_from_snapshots_and_streams(
    redis_url: str, redis_prefix: str
) -> None:
    engines_broker = await broker_mod.connect(redis_url, prefix=redis_prefix)
    reps = await _reporters(engines_broker, 2)
    bs_a, _ = stored(DOC_A)
    reps[0].emit(bs_a)
    for rep in reps:
        await rep.flush()
    # a router that starts after the events were published (and a second replica beside it)
    replicas = []
    try:
        for _ in range(2):
            b = await broker_mod.connect(redis_url, prefix=redis_prefix)
            r = Router(RouterConfig("e2"), random.Random(1))
            s = EmbeddedRouter(r, b, consumer_options=FAST)
            await s.start()
            replicas.append((b, r, s))
        for _, r, _ in replicas:
            await until(lambda r=r: r.cluster.tree.match(DOC_A).per_engine == {"eng0": len(DOC_A)})
            d = r.route(req("q", DOC_A + b"?"), time.time())
            assert (d.engine_id, d.reason) == ("eng0", "exploit")
    finally:
        for b, _, s in replicas:
            await s.close()
            await b.close()
        for rep in reps:
            await rep.close()
        await engines_broker.close()


async def test_http_service_and_remote_router(redis_prefix: str) -> None:
    broker = await broker_mod.connect("memory://")
    rep = Reporter(broker, "eng0", flush_interval_s=0.002)
    await rep.start()
    router = Router(RouterConfig("e2"), random.Random(0))
    service = EmbeddedRouter(router, broker, consumer_options=FAST)
    runner, base = await serve_router(service)
    remote = RemoteRouter(base, timeout_s=2.0)
    try:
        rep.emit(heartbeat("eng0", "http://127.0.0.1:9/v1"))
        rep.emit(stored(DOC_A)[0])
        await until(lambda: router.cluster.tree.match(DOC_A).per_engine != {})
        engines = await remote.engines()
        assert [(e.engine_id, e.url, e.alive) for e in engines] == [
            ("eng0", "http://127.0.0.1:9/v1", True)
        ]
        d = await remote.route(req("h1", DOC_A + b"hi"))
        assert (d.engine_id, d.reason, d.matched_bytes) == ("eng0", "exploit", len(DOC_A))
        assert d.candidates and d.candidates[0].engine_id == "eng0"
        # eng0 sends no request events: the gateway's first token ends h1's prefill
        await remote.first_token("h1", "eng0", 12.5)
        assert "h1" in router.cluster.engines["eng0"].decoding
        await remote.report("h1", "eng0", "failed")
        assert router.cluster.engines["eng0"].inflight == 0
        async with aiohttp.ClientSession() as http:
            for body, field in (
                (b"not json", "body"),
                (b"[]", "body"),
                (b'{"request_id": "x", "key_b64": "***"}', "key_b64"),
                (b'{"request_id": "x", "key_b64": "", "max_tokens": -1}', "max_tokens"),
                (b'{"request_id": "x", "key_b64": "", "slo": {"ttft_ms": 0}}', "slo.ttft_ms"),
            ):
                async with http.post(f"{base}/route", data=body) as resp:
                    assert resp.status == 400
                    assert (await resp.json())["error"]["param"] == field
            async with http.post(f"{base}/report", data=b'{"outcome": "maybe"}') as resp:
                assert resp.status == 400
            ok = b'"request_id": "x", "engine_id": "eng0", "outcome": "ok"'
            for extra, field in (
                (b', "output_tokens": -1, "max_tokens": 9', "output_tokens"),
                (b', "output_tokens": 5, "max_tokens": "9"', "max_tokens"),
                (b', "output_tokens": 5.5, "max_tokens": 9', "output_tokens"),
            ):
                async with http.post(f"{base}/report", data=b"{" + ok + extra + b"}") as resp:
                    assert resp.status == 400, extra
                    assert (await resp.json())["error"]["param"] == field
            body = b"{" + ok + b', "output_tokens": 5, "max_tokens": 9}'
            async with http.post(f"{base}/report", data=body) as resp:
                assert resp.status == 200  # (an answer's length beside its cap: accepted)
            for body, field in (
                (b"[1]", "body"),
                (b'{"request_id": "x", "engine_id": "eng0"}', "ttft_ms"),
                (b'{"request_id": "x", "engine_id": "eng0", "ttft_ms": -1}', "ttft_ms"),
                (b'{"request_id": "x", "engine_id": "eng0", "ttft_ms": "5"}', "ttft_ms"),
                (b'{"request_id": "x", "engine_id": "eng0", "ttft_ms": 1e30}', "ttft_ms"),
                (b'{"request_id": "", "engine_id": "eng0", "ttft_ms": 5}', "request_id"),
                (b'{"request_id": "x", "ttft_ms": 5}', "engine_id"),
            ):
                async with http.post(f"{base}/first_token", data=body) as resp:
                    assert resp.status == 400, body
                    assert (await resp.json())["error"]["param"] == field
            unknown = {"request_id": "gone", "engine_id": "eng0", "ttft_ms": 5}
            async with http.post(f"{base}/first_token", json=unknown) as resp:
                assert resp.status == 200 and (await resp.json()) == {"folded": False}
            ok_body = {"request_id": "raw", "key_b64": base64.b64encode(b"x").decode()}
            async with http.post(f"{base}/route", json=ok_body) as resp:
                assert resp.status == 200 and (await resp.json())["engine_id"] == "eng0"
            async with http.get(f"{base}/state") as resp:
                st = await resp.json()
                assert st["tree"]["bytes"] >= len(DOC_A) and st["engines"][0]["engine_id"] == "eng0"
                assert st["engines"][0]["speed"] == {
                    "prefill": 1.0,
                    "decode": 1.0,
                    "prefill_evidence": 0.0,
                    "decode_evidence": 0.0,
                }
                assert st["engines"][0]["reports_requests"] is False
                # the KV memory its requests hold as the router counts it (none decoding here)
                assert st["engines"][0]["held_kv_tokens"] == 0
            async with http.get(f"{base}/metrics") as resp:
                text = await resp.text()
                assert 'kvgate_router_decisions_total{policy="e2",reason="exploit"} 1.0' in text
                assert "kvgate_router_decision_seconds_bucket" in text
                assert "kvgate_router_tree_bytes" in text
                assert "kvgate_router_broker_lag_seconds" in text
                assert (
                    'kvgate_router_engine_speed_factor{engine="eng0",phase="prefill"} 1.0' in text
                )
                assert 'kvgate_router_engine_tpot_seconds{engine="eng0"} 0.15' in text
                # the request routed to eng0 is in its windowed load (what rebalancing weighs)
                window = re.search(
                    r'kvgate_router_engine_window_load_seconds\{engine="eng0"\} (\S+)', text
                )
                assert window is not None and float(window.group(1)) > 0
            async with http.get(f"{base}/health") as resp:
                assert resp.status == 200 and (await resp.json())["engines_alive"] == 1
            async with http.post(f"{base}/engines/eng0/drain") as resp:
                assert resp.status == 200
        d = await remote.route(req("h2", DOC_A))
        assert d.shed and d.retry_after_s
    finally:
        await remote.close()
        await runner.cleanup()
        await rep.close()
        await broker.close()
    with pytest.raises(RouterUnavailable):
        await RemoteRouter(base, timeout_s=0.5).route(req("x", b"k"))


async def test_stale_and_other_consumer_counters_are_exported() -> None:
    """Entries of a retired epoch were skipped with nothing in /state or /metrics to show it
    (nor sink errors, duplicates or reconnects in /metrics)."""
    broker = await broker_mod.connect("memory://")
    rep = Reporter(broker, "eng0", flush_interval_s=0.002)
    await rep.start()
    router = Router(RouterConfig("e2"), random.Random(0))
    service = EmbeddedRouter(router, broker, consumer_options=FAST)
    assert service.consumer.epoch_reclaim_s == router.config.cluster.heartbeat_ttl_s
    runner, base = await serve_router(service)
    try:
        rep.emit(heartbeat("eng0", "http://127.0.0.1:9/v1"))
        await until(service.is_ready)
        forged = Envelope("eng0", "forged", 0, time.time(), heartbeat("eng0"))
        await broker.append("eng0", [encode_batch([forged])])
        await until(lambda: service.consumer.stats.new_epochs == 1)
        rep.emit(heartbeat("eng0", "http://127.0.0.1:9/v1"))
        await until(lambda: service.consumer.stats.stale == 1)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/state") as resp:
                b = (await resp.json())["broker"]
                assert (b["stale"], b["new_epochs"], b["epochs_reclaimed"]) == (1, 1, 0)
            async with http.get(f"{base}/metrics") as resp:
                text = await resp.text()
            for name, value in (
                ("stale", 1),
                ("new_epochs", 1),
                ("epochs_reclaimed", 0),
                ("duplicates", 0),
                ("sink_errors", 0),
                ("reconnects", 0),
            ):
                assert f"kvgate_router_broker_{name}_total {float(value)}" in text, name
    finally:
        await runner.cleanup()
        await rep.close()
        await broker.close()


async def test_health_and_ready_fail_when_the_consumer_completes_no_read() -> None:
    """Discovery answered but every read failed (a broker error that is not an outage, as a
    position the broker refused once caused): the consumer counted as connected and /health
    and /ready stayed 200 while every engine went dead. Now both are 503 with a reason once no
    round of reads completed for ``stall_s``."""

    class FailingReads(MemoryBroker):
        fail = False

        async def read(self, positions, *, count=1000, block_ms=None):  # type: ignore[override]
            if self.fail:
                raise BrokerError("redis error: ResponseError: Invalid stream ID")
            return await super().read(positions, count=count, block_ms=block_ms)

    broker = FailingReads()
    rep = Reporter(broker, "eng0", flush_interval_s=0.002)
    await rep.start()
    router = Router(RouterConfig("e2"), random.Random(0))
    service = EmbeddedRouter(router, broker, consumer_options=FAST, stall_s=0.5)
    runner, base = await serve_router(service)
    try:
        rep.emit(heartbeat("eng0", "http://127.0.0.1:9/v1"))
        await until(service.is_ready)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/health") as resp:
                assert resp.status == 200
            broker.fail = True
            await asyncio.sleep(1.0)
            assert service.consumer.connected  # (not an outage: the broker answers)
            async with http.get(f"{base}/health") as resp:
                body = await resp.json()
                assert resp.status == 503 and "completed no read" in body["reason"]
            async with http.get(f"{base}/ready") as resp:
                assert resp.status == 503
                assert "completed no read" in (await resp.json())["error"]["message"]
            assert service.state()["broker"]["stalled"]
            broker.fail = False
            await until(lambda: service.problem() is None)
            async with http.get(f"{base}/health") as resp:
                assert resp.status == 200
    finally:
        await runner.cleanup()
        await rep.close()
        await broker.close()


async def test_router_is_not_ready_until_it_knows_an_engine_and_says_so() -> None:
    """Before the router knows a live engine, /ready is 503 with Retry-After and /route waits
    a moment and then answers 503 (not a decision over nothing); once an engine's heartbeat is
    in, both answer."""
    broker = await broker_mod.connect("memory://")
    router = Router(RouterConfig("e2"), random.Random(0))
    service = EmbeddedRouter(router, broker, consumer_options=FAST)
    runner, base = await serve_router(service)
    remote = RemoteRouter(base, timeout_s=2.0)
    rep = Reporter(broker, "eng0", flush_interval_s=0.002)
    body = {"request_id": "early", "key_b64": base64.b64encode(b"x").decode()}
    try:
        await until(lambda: service.consumer.caught_up)  # nothing to replay: no engine yet
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/ready") as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                assert "knows no live engine" in (await resp.json())["error"]["message"]
            t0 = time.monotonic()
            async with http.post(f"{base}/route", json=body) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert time.monotonic() - t0 >= 0.4  # it waited for readiness first
            assert not await remote.ready()
            await rep.start()
            rep.emit(heartbeat("eng0", "http://127.0.0.1:9/v1"))
            await until(service.is_ready)
            async with http.get(f"{base}/ready") as resp:
                assert resp.status == 200
            async with http.post(f"{base}/route", json=body) as resp:
                assert resp.status == 200 and (await resp.json())["engine_id"] == "eng0"
            assert await remote.ready()
            assert service.state()["ready"] and service.state()["broker"]["caught_up"]
    finally:
        await remote.close()
        await runner.cleanup()
        await rep.close()
        await broker.close()


async def test_a_restarted_router_is_ready_only_after_its_replay(
    redis_url: str, redis_prefix: str
) -> None:
    """The engine's heartbeat comes first in its stream and its cached document later: a
    router that replays one entry per read knows the engine before the document. Readiness
    waits for the whole replay, so the first moment it is ready, the document is known."""
    engines_broker = await broker_mod.connect(redis_url, prefix=redis_prefix)
    rep = Reporter(engines_broker, "eng0", flush_interval_s=0.002, snapshot_interval_s=3600)
    await rep.start()
    rep.emit(heartbeat("eng0"))
    await rep.flush()
    for i in range(30):
        rep.emit(stored(bytes([i]) * 256)[0])
        await rep.flush()
    rep.emit(stored(DOC_A)[0])
    await rep.flush()
    b = await broker_mod.connect(redis_url, prefix=redis_prefix)
    router = Router(RouterConfig("e2"), random.Random(1))
    service = EmbeddedRouter(router, b, consumer_options={**FAST, "count": 1})
    try:
        await service.start()
        seen_alive_early = False
        deadline = time.monotonic() + 10
        while not service.is_ready():
            assert time.monotonic() < deadline, "never ready"
            if any(e.alive for e in router.engines(time.time())):
                seen_alive_early = True
            await asyncio.sleep(0.001)
        assert router.cluster.tree.match(DOC_A).per_engine == {"eng0": len(DOC_A)}
        assert seen_alive_early  # knowing the engine alone did not make it ready
    finally:
        await service.close()
        await b.close()
        await rep.close()
        await engines_broker.close()
