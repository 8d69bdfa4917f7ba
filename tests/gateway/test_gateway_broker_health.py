"""The embedded router's broker health, as the gateway's degraded mode reads it."""

from __future__ import annotations

import asyncio

from gateway.routing import BROKER_ANSWERED_S, embedded_stats


class _Service:
    def __init__(self, broker_state: dict) -> None:
        self.broker_state = broker_state

    def state(self) -> dict:
        return {"broker": self.broker_state}


class _SlowBroker:
    """A broker whose ping never answers in time (a busy event loop), counted."""

    def __init__(self) -> None:
        self.pings = 0

    async def ping(self) -> None:
        self.pings += 1
        await asyncio.sleep(10)


async def test_a_consumer_answered_lately_is_proof_enough_against_a_slow_ping() -> None:
    broker = _SlowBroker()
    fresh = {"connected": True, "answered_s_ago": BROKER_ANSWERED_S / 2, "lag_s": 0.01}
    assert (await embedded_stats(_Service(fresh), broker)())["broker_ok"]
    assert broker.pings == 0  # not even asked
    stale = dict(fresh, answered_s_ago=BROKER_ANSWERED_S * 5)
    assert not (await embedded_stats(_Service(stale), broker)())["broker_ok"]
    never = dict(fresh, answered_s_ago=None)
    assert not (await embedded_stats(_Service(never), broker)())["broker_ok"]
    assert broker.pings == 2  # the ping decides when the reads say nothing
    down = dict(fresh, connected=False)
    assert not (await embedded_stats(_Service(down), broker)())["broker_ok"]


async def test_a_quiet_consumer_falls_back_on_a_ping_that_answers() -> None:
    class _Broker:
        async def ping(self) -> None:
            return None

    state = {"connected": True, "answered_s_ago": None, "lag_s": None}
    assert (await embedded_stats(_Service(state), _Broker())())["broker_ok"]
