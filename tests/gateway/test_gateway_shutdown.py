"""Stopping the gateway is bounded even when a background job swallows its cancellation.

That is what a broker ping does on Python 3.11 now and then: redis-py writes every command under
``asyncio.wait_for``, which returns normally when the cancel lands just after the write finished
(CPython gh-86296). The gateway's periodic jobs call it (``embedded_stats``); the job then went
on looping for ever and ``runner.cleanup()`` never returned (the flaky hang of
``test_redis_stopped_mid_run_gateway_keeps_serving`` in its teardown).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from gw_harness import FakeEngine, ListRouting, wait_until

from gateway.app import GATEWAY_KEY, create_app, serve
from gateway.config import GatewayConfig

pytestmark = pytest.mark.timeout(60)


class SwallowingStats:
    """A stats provider whose call, once armed, waits and then swallows the cancel it gets."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = asyncio.Event()
        self.swallowed = 0
        self.calls = 0

    async def __call__(self) -> dict:
        self.calls += 1
        if self.armed:
            self.armed = False
            self.entered.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.swallowed += 1  # and return normally, as wait_for does on Python 3.11
        return {"broker_ok": True, "broker_lag_s": 0.0}


async def test_stop_is_bounded_when_a_job_swallows_its_cancellation() -> None:
    engine = await FakeEngine("e0").start()
    stats = SwallowingStats()
    cfg = GatewayConfig(health_interval_s=0.05, refresh_interval_s=0.05, access_log=False)
    app = create_app(cfg, ListRouting([engine]), stats=stats)
    runner, _ = await serve(app, "127.0.0.1", 0, drain_timeout_s=0.5)
    gw = app[GATEWAY_KEY]
    try:
        await wait_until(lambda: gw.ready_at is not None, 10)
        stats.armed = True  # the periodic refresh job is the next caller
        await asyncio.wait_for(stats.entered.wait(), 10)
        started = time.monotonic()
        # Without the fix this waited for ever: the refresh loop outlived its cancel().
        await asyncio.wait_for(runner.cleanup(), 10)
        elapsed = time.monotonic() - started
        assert stats.swallowed == 1
        assert elapsed < 5, elapsed
        calls = stats.calls
        await asyncio.sleep(0.2)  # four refresh intervals: the job really stopped
        assert stats.calls == calls
    finally:
        await runner.cleanup()
        await engine.stop()
