"""The exec probe of the bridge sidecar, against a real Redis and a real reporter."""

from __future__ import annotations

import asyncio

import pytest

import broker
from deploy import probe
from engine_reporter import Reporter

pytestmark = pytest.mark.redis


async def test_probe_follows_the_reporters_registration(
    redis_url: str, redis_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--broker", redis_url, "--broker-prefix", redis_prefix, "--engine-id", "vllm-0"]
    # asyncio.run inside the probe needs a thread of its own while this test's loop runs.
    run_probe = lambda: asyncio.to_thread(probe.main, argv)  # noqa: E731

    assert await run_probe() == 1  # nothing registered yet
    assert "not registered" in capsys.readouterr().err

    brk = await broker.connect(redis_url, prefix=redis_prefix)
    reporter = Reporter(brk, "vllm-0", registry_ttl_s=1.0)
    await reporter.start()
    try:
        for _ in range(50):  # the first registration happens in the reporter's loop
            if await run_probe() == 0:
                break
            await asyncio.sleep(0.05)
        assert await run_probe() == 0
    finally:
        await reporter.close(unregister=False)  # as if the bridge hung: no goodbye
    await asyncio.sleep(1.3)  # past the TTL
    assert await run_probe() == 1
    await brk.close()


def test_probe_reports_an_unreachable_broker(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--broker", "redis://127.0.0.1:1/0", "--engine-id", "x", "--timeout", "2"]
    assert probe.main(argv) == 1
    assert "broker check failed" in capsys.readouterr().err
