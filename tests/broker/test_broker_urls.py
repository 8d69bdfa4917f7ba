"""Connecting by URL: parsing, passwords, Sentinel (a real one), bad schemes."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from redis_server import RedisProcess, free_port, redis_server_binary

import broker
from broker.base import START_ID, BrokerUnavailable
from broker.redis_broker import parse_sentinel_url


def test_sentinel_url_forms() -> None:
    cfg = parse_sentinel_url("redis+sentinel://:s3cret@h1:26379,h2:26380/mymaster/2")
    assert cfg["sentinels"] == [("h1", 26379), ("h2", 26380)]
    assert (cfg["service"], cfg["db"], cfg["password"], cfg["ssl"]) == (
        "mymaster",
        2,
        "s3cret",
        False,
    )
    cfg = parse_sentinel_url("rediss+sentinel://user:pw@[::1]:5000,h2/svc?sentinel_password=x")
    assert cfg["sentinels"] == [("::1", 5000), ("h2", 26379)]
    assert (cfg["username"], cfg["password"], cfg["sentinel_password"]) == ("user", "pw", "x")
    assert cfg["ssl"] and cfg["db"] == 0
    for bad in ("redis+sentinel://h1:1", "redis+sentinel://h1:1/a/1/x", "redis://h/svc"):
        with pytest.raises(ValueError):
            parse_sentinel_url(bad)


async def test_unknown_scheme_is_rejected() -> None:
    with pytest.raises(ValueError, match="scheme"):
        await broker.connect("mysql://localhost")


async def test_connect_is_lazy_and_unreachable_server_is_unavailable() -> None:
    b = await broker.connect(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(BrokerUnavailable):
        await b.ping()
    await b.close()


@pytest.mark.redis
async def test_password_in_url_authenticates() -> None:
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="kvgate-redis-auth-")
    proc = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--requirepass",
            "p@ss word",
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        good = await broker.connect(f"redis://:p%40ss%20word@127.0.0.1:{port}/0")
        for _ in range(200):
            try:
                await good.ping()
                break
            except BrokerUnavailable:
                await asyncio.sleep(0.02)
        ids = await good.append("e", [{b"k": b"v"}])
        assert await good.last_id("e") == ids[0]
        bad = await broker.connect(f"redis://:wrong@127.0.0.1:{port}/0")
        with pytest.raises(broker.BrokerError):
            await bad.ping()
        await good.close()
        await bad.close()
    finally:
        proc.terminate()
        proc.wait(5)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.redis
async def test_sentinel_url_reaches_the_master(redis_prefix) -> None:
    master = RedisProcess().start()
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-sentinel-"))
    conf = workdir / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {workdir}\n"
        f"sentinel monitor kvmaster 127.0.0.1 {master.port} 1\n"
        "sentinel down-after-milliseconds kvmaster 5000\n"
    )
    proc = subprocess.Popen(
        [redis_server_binary(), str(conf), "--sentinel"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        b = await broker.connect(
            f"redis+sentinel://127.0.0.1:{port}/kvmaster/0", prefix=redis_prefix
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                await b.ping()
                break
            except BrokerUnavailable:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        ids = await b.append("e", [{b"k": b"v"}], maxlen=10)
        got = await b.read({"e": START_ID})
        assert got == [("e", [(ids[0], {b"k": b"v"})])]
        await b.close()
    finally:
        proc.terminate()
        proc.wait(5)
        master.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


async def test_connect_refuses_a_database_that_is_not_a_number() -> None:
    """redis-py would quietly use database 0 for ``/abc``; kvgate refuses the URL."""
    with pytest.raises(ValueError, match="not a number"):
        await broker.connect("redis://127.0.0.1:6379/abc")
