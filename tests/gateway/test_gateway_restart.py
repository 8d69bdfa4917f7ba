"""A warm gateway killed (SIGKILL) under load and restarted on the same port: every request the
new process accepts is answered 200, none 404 while its embedded router rebuilds its state from
Redis, and the first routed request already exploits the cached prefix. Its access log, read
by ``kvgate logs explain``, says where the requests went and why.

The gateway runs as a real subprocess (``python -m kvgate.cli gateway``) on a real Redis;
simulated engines (``engine.server``) run in the test's process and publish there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
import pytest

from kvgate.cli import main as kvgate_main
from kvgate.logs import access_records

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(120)]

MODEL = "restart-model"
HOST = "127.0.0.1"
PREFIX = "You are a careful assistant. " * 370  # ~10.7 KB shared by every request
CLIENTS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Load:
    """What the clients saw: answers by (pid, status) with the time of each process's first
    answer, and transport errors by kind with their times."""

    answers: Counter[tuple[int, int]] = field(default_factory=Counter)
    first_answer: dict[int, float] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    error_times: list[float] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def answered(self, pid: int, status: int) -> None:
        self.answers[(pid, status)] += 1
        self.first_answer.setdefault(pid, time.monotonic())

    def failed(self, kind: str) -> None:
        self.errors[kind] += 1
        self.error_times.append(time.monotonic())


async def _client(url: str, load: Load, n: int) -> None:
    """Requests one after another, each on a new connection (so a new process gets them)."""
    connector = aiohttp.TCPConnector(force_close=True)
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
        i = 0
        while not load.stop.is_set():
            i += 1
            body = {"model": MODEL, "prompt": PREFIX + f"question {n}-{i}", "max_tokens": 2}
            try:
                async with s.post(
                    url + "/v1/completions", json=body, headers={"x-kvgate-debug": "1"}
                ) as r:
                    await r.read()
                    load.answered(int(r.headers.get("x-kvgate-worker", 0)), r.status)
            except aiohttp.ClientConnectorError:  # no process listens: a balancer retries
                load.failed("refused")
                await asyncio.sleep(0.02)
            except (aiohttp.ClientError, OSError) as exc:  # cut by the kill
                load.failed(type(exc).__name__)


async def _start_gateway(port: int, redis_url: str, prefix: str, log: Path):
    fh = open(log, "wb")  # noqa: SIM115  (the child writes to it; closed with the process)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgate.cli",
        "gateway",
        "--host",
        HOST,
        "--port",
        str(port),
        "--broker-url",
        redis_url,
        "--broker-prefix",
        prefix,
        "--log-level",
        "info",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=fh,
    )
    fh.close()
    return proc


async def _until_ready(url: str, proc, log: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while True:
            assert proc.returncode is None, log.read_text()[-2000:]
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            await asyncio.sleep(0.1)


async def test_a_killed_gateway_restarts_ready_with_no_failed_request(
    redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    import broker as broker_mod
    from engine.server import EngineServerConfig
    from engine.server import serve as serve_engine

    eb = await broker_mod.connect(redis_url, prefix=redis_prefix)
    runners = []
    procs = []
    port = _free_port()
    url = f"http://{HOST}:{port}"
    first_log, second_log = tmp_path / "gateway-1.log", tmp_path / "gateway-2.log"
    load = Load()
    try:
        for i in range(2):
            r, _ = await serve_engine(
                EngineServerConfig(engine_id=f"r-engine-{i}", model=MODEL, heartbeat_s=1.0), eb
            )
            runners.append(r)
        first = await _start_gateway(port, redis_url, redis_prefix, first_log)
        procs.append(first)
        await _until_ready(url, first, first_log)
        clients = [asyncio.create_task(_client(url, load, n)) for n in range(CLIENTS)]
        await asyncio.sleep(1.5)  # warm: the prefix is cached on an engine
        assert sum(n for (pid, _), n in load.answers.items() if pid == first.pid) >= 10
        killed_at = time.monotonic()
        os.kill(first.pid, signal.SIGKILL)
        await first.wait()
        second = await _start_gateway(port, redis_url, redis_prefix, second_log)
        procs.append(second)
        await _until_ready(url, second, second_log)
        await asyncio.sleep(2.0)  # load on the restarted gateway
        load.stop.set()
        await asyncio.gather(*clients)
    finally:
        load.stop.set()
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(p.wait(), 10)
                if p.returncode is None:
                    p.kill()
                    await p.wait()
        for r in runners:
            with contextlib.suppress(Exception):
                await r.cleanup()
        await eb.close()
    failed = {k: n for k, n in load.answers.items() if k[1] != 200}
    assert failed == {}, (failed, second_log.read_text()[-3000:])
    served_after = sum(n for (pid, _), n in load.answers.items() if pid == second.pid)
    assert served_after >= 10, load
    # Transport errors only from the kill: requests it cut (in flight, or queued on the dead
    # process's socket) and connections refused while no process listened; none once the new
    # process answers.
    back_at = load.first_answer[second.pid]
    assert all(killed_at <= t <= back_at for t in load.error_times), load.errors

    # The restarted gateway's access log: one line per request it answered, and its very
    # first routed request already used the rebuilt prefix state.
    lines = second_log.read_text().splitlines()
    records = list(access_records(lines))
    assert len(records) == served_after
    first_routed = min(records, key=lambda r: r["ts"])
    assert first_routed["reason"] == "exploit", first_routed
    assert first_routed["matched_bytes"] >= 10_000
    assert {r["engine"] for r in records} <= {"r-engine-0", "r-engine-1"}
    out = tmp_path / "explain.json"
    with open(out, "w") as fh, contextlib.redirect_stdout(fh):
        assert kvgate_main(["logs", "explain", "--json", str(second_log)]) == 0
    summary = orjson.loads(out.read_bytes())
    assert summary["requests"] == served_after and summary["statuses"] == {"200": served_after}
    assert sum(e["requests"] for e in summary["engines"].values()) == served_after
