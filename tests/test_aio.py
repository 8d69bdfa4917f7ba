"""kvgate.aio.stop_tasks: bounded, and a swallowed cancellation does not keep a task alive."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from kvgate.aio import stop_tasks

pytestmark = pytest.mark.timeout(30)


async def _loop_that_swallows_one_cancel(ticks: list[int]) -> None:
    """A background loop whose first cancel() is lost (as in asyncio.wait_for on Python 3.11)."""
    swallowed = False
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True
        ticks.append(1)


async def test_a_task_that_swallowed_its_cancel_is_cancelled_again() -> None:
    ticks: list[int] = []
    task = asyncio.create_task(_loop_that_swallows_one_cancel(ticks))
    await asyncio.sleep(0.05)
    started = time.monotonic()
    left = await stop_tasks([task, None], 5.0, recancel_s=0.1)
    assert not left and task.cancelled()
    assert time.monotonic() - started < 2


async def test_a_task_that_never_ends_is_given_up_on_at_the_deadline(caplog) -> None:
    give_up = asyncio.Event()

    async def stubborn() -> None:
        while not give_up.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    try:
        # (at WARNING whatever level an earlier test left the root logger at)
        with caplog.at_level(logging.WARNING, logger="kvgate.aio"):
            started = time.monotonic()
            left = await stop_tasks([task], 0.3, what="test job", recancel_s=0.05)
        assert left == {task} and not task.done()
        assert time.monotonic() - started < 2
        assert "test job still running" in caplog.text and "stubborn" in caplog.text
    finally:
        give_up.set()  # the task ends only this way: never leave it to the loop's teardown
        await task


async def test_finished_and_failed_tasks_need_no_waiting() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    done = asyncio.create_task(asyncio.sleep(0))
    failed = asyncio.create_task(fails())
    await asyncio.sleep(0.01)
    assert await stop_tasks([done, failed], 1.0) == set()
