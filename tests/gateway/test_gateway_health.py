"""Engine health as the gateway sees it: an outage is logged once each way; readiness."""

from __future__ import annotations

import asyncio
import logging

import pytest
from gw_harness import gateway_stack, wait_until

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
