"""Engine health as the gateway sees it: an outage is logged once each way; readiness."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest
from gw_harness import MODEL, gateway_stack, wait_until

from gateway.config import BreakerConfig, GatewayConfig


async def test_an_engine_outage_is_logged_once_down_and_once_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Health probes fail every cooldown while the engine is down; the log says "ejected" once
    and "readmitted" once when it serves again (not once per failed probe)."""
    cfg = GatewayConfig(
        health_interval_s=0.05,
        refresh_interval_s=0.05,
        breaker=BreakerConfig(failures=1, cooldown_s=0.05, max_cooldown_s=0.1),
    )
    caplog.set_level(logging.INFO, logger="kvgate.gateway")

    def lines(word: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage() == f"engine e1 {word}"]

    async with gateway_stack(2, cfg) as st:
        gone = st.engines[1]
        await gone.stop()
        breaker = st.gateway.pool.engines["e1"].breaker
        await wait_until(lambda: breaker.state != "closed")
        first_opened = breaker.opened_at
        await asyncio.sleep(1.0)  # ~20 probe rounds, several cooldowns, all failing
        assert breaker.opened_at > first_opened + 0.5  # re-opened by failed trials since
        await gone.start()  # back (on a new port the routing service announces)
        await wait_until(lambda: st.gateway.pool.engines["e1"].breaker.state == "closed", 5.0)
        await asyncio.sleep(0.3)
    ejected = [r for r in caplog.records if r.getMessage().startswith("engine e1 ejected")]
    assert len(ejected) == 1
    assert lines("readmitted") == ["engine e1 readmitted"]


async def test_a_request_before_ready_waits_for_readiness_instead_of_a_404() -> None:
    cfg = GatewayConfig(health_interval_s=60, refresh_interval_s=60, ready_wait_s=5.0)
    warm = asyncio.Event()
    async with gateway_stack(2, cfg, warm=warm) as st, aiohttp.ClientSession() as s:
        async with s.get(st.url + "/ready") as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert (await r.json())["routing_ready"] is False
        body = {"model": MODEL, "prompt": "early"}
        early = asyncio.create_task(s.post(st.url + "/v1/completions", json=body))
        await asyncio.sleep(0.3)
        assert not early.done()  # held, not answered 404
        warm.set()
        async with await asyncio.wait_for(early, 5) as r:
            assert r.status == 200
        async with s.get(st.url + "/ready") as r:
            assert r.status == 200 and (await r.json())["usable_engines"] == 2


async def test_a_gateway_that_stays_unready_answers_503_with_retry_after() -> None:
    cfg = GatewayConfig(health_interval_s=60, refresh_interval_s=60, ready_wait_s=0.3)
    never = asyncio.Event()
    async with gateway_stack(1, cfg, warm=never) as st, aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        async with s.post(st.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == "not_ready"
        assert time.monotonic() - t0 >= 0.3
        async with s.post(st.url + "/v1/completions", data=b"{bad") as r:
            assert r.status == 400  # bad input is still told at once
        async with s.get(st.url + "/health") as r:
            assert r.status == 200  # alive, just not ready
        assert st.engines[0].requests == []
