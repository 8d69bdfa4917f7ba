"""``kvgate gateway --workers N``: several gateway processes behind one port, supervised.

The gateway runs as a real subprocess (``python -m kvgate.cli gateway --workers 2``) on a real
Redis broker; simulated engines (``engine.server``) run in the test's process and publish there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import openai
import pytest

from gateway.workers import RestartPolicy, RestartTracker, Supervisor, multi_worker_error

pytestmark = pytest.mark.timeout(90)

MODEL = "workers-model"
HOST = "127.0.0.1"


def _quiet_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports below the kernel's ephemeral range. A
    port bound to 0 comes from that range, and any outbound connection (the workers' Redis
    clients, their health checks) could take it before the gateway binds it: one run's metrics
    port was taken so ("address already in use")."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.Random()
    for _ in range(200):
        base = pick.randrange(10_000, max(low - n, 10_001))
        with contextlib.ExitStack() as stack:
            try:
                for i in range(n):
                    stack.enter_context(socket.socket()).bind((HOST, base + i))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {n} free consecutive ports")


def _port_pair() -> int:
    """A free loopback port whose successor is free too (for --metrics-port-base)."""
    return _quiet_ports(2)


def _free_port() -> int:
    return _quiet_ports(1)


def _children(pid: int) -> set[int]:
    """Live child processes of ``pid`` (from /proc)."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def _until(cond: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Stack:
    url: str
    proc: asyncio.subprocess.Process
    metrics_base: int
    stderr: list[bytes]

    def client(self) -> openai.AsyncOpenAI:
        """``Connection: close``: every request on a new connection, which the kernel may give
        to either worker (a kept-alive connection would stay on one)."""
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1",
            api_key="unused",
            max_retries=0,
            timeout=20,
            default_headers={"Connection": "close"},
        )


async def _completion_pid(oc: openai.AsyncOpenAI, i: int) -> int:
    raw = await oc.completions.with_raw_response.create(
        model=MODEL,
        prompt=f"shared system prompt {i % 2} " * 8 + f"question {i}",
        max_tokens=2,
        extra_headers={"x-kvgate-debug": "1"},
    )
    assert raw.parse().choices[0].text
    return int(raw.headers["x-kvgate-worker"])


@asynccontextmanager
async def workers_stack(redis_url: str, prefix: str) -> AsyncIterator[Stack]:
    """Two simulated engines on Redis, and ``kvgate gateway --workers 2`` on the same Redis."""
    import broker as broker_mod
    from engine.server import EngineServerConfig
    from engine.server import serve as serve_engine

    eb = await broker_mod.connect(redis_url, prefix=prefix)
    runners = []
    proc = None
    stderr: list[bytes] = []
    try:
        for i in range(2):
            r, _ = await serve_engine(
                EngineServerConfig(engine_id=f"w-engine-{i}", model=MODEL), eb
            )
            runners.append(r)
        port, metrics_base = _free_port(), _port_pair()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvgate.cli",
            "gateway",
            "--host",
            HOST,
            "--port",
            str(port),
            "--workers",
            "2",
            "--broker-url",
            redis_url,
            "--broker-prefix",
            prefix,
            "--metrics-port-base",
            str(metrics_base),
            "--health-interval",
            "0.5",
            "--drain-timeout",
            "10",
            "--no-access-log",
            "--log-level",
            "warning",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )

        async def collect() -> None:
            assert proc is not None and proc.stderr is not None
            while line := await proc.stderr.readline():
                stderr.append(line)

        reader = asyncio.create_task(collect())
        stack = Stack(f"http://{HOST}:{port}", proc, metrics_base, stderr)
        # Ready when each worker's own port says it knows a usable engine.
        deadline = time.monotonic() + 20
        async with aiohttp.ClientSession() as s:
            while True:
                assert proc.returncode is None, b"".join(stderr).decode()[-2000:]
                ok = 0
                for p in (metrics_base, metrics_base + 1):
                    with contextlib.suppress(aiohttp.ClientError, OSError):
                        async with s.get(f"http://{HOST}:{p}/health") as r:
                            ok += r.status == 200
                if ok == 2:
                    break
                assert time.monotonic() < deadline, b"".join(stderr).decode()[-2000:]
                await asyncio.sleep(0.1)
            # Each worker reaches the engines through its router (Redis heartbeats).
            oc = stack.client()
            deadline = time.monotonic() + 20
            while True:
                try:
                    await _completion_pid(oc, 0)
                    break
                except openai.APIStatusError:
                    assert time.monotonic() < deadline, b"".join(stderr).decode()[-2000:]
                    await asyncio.sleep(0.2)
            await oc.close()
        try:
            yield stack
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            reader.cancel()
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        for r in runners:
            with contextlib.suppress(Exception):
                await r.cleanup()
        await eb.close()


def _ok_requests(metrics_text: str, route: str) -> float:
    """``kvgate_gateway_requests_total{route=route,status="200"}`` in one exposition."""
    total = 0.0
    pattern = re.compile(
        r'^kvgate_gateway_requests_total\{(?=[^}]*route="'
        + re.escape(route)
        + r'")(?=[^}]*status="200")[^}]*\} (\S+)$',
        re.M,
    )
    for m in pattern.finditer(metrics_text):
        total += float(m.group(1))
    return total


@pytest.mark.redis
async def test_two_workers_share_port_restart_and_drain(redis_url: str, redis_prefix: str) -> None:
    async with workers_stack(redis_url, redis_prefix) as st:
        parent = st.proc.pid
        workers = _children(parent)
        assert len(workers) == 2, workers

        # Both workers take traffic from the openai SDK, through one port.
        oc = st.client()
        pids = [await _completion_pid(oc, i) for i in range(24)]
        assert set(pids) == workers, (set(pids), workers)
        chat = await oc.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=3
        )
        assert chat.choices[0].message.content

        # Each worker's registry on its own metrics port: together they count every request.
        async with aiohttp.ClientSession() as s:
            per_worker = []
            metric_pids = set()
            for p in (st.metrics_base, st.metrics_base + 1):
                async with s.get(f"http://{HOST}:{p}/metrics") as r:
                    per_worker.append(_ok_requests(await r.text(), "/v1/completions"))
                async with s.get(f"http://{HOST}:{p}/health") as r:
                    metric_pids.add((await r.json())["pid"])
        assert metric_pids == workers
        assert all(n > 0 for n in per_worker)
        # +1: the readiness probe's successful completion in workers_stack
        assert sum(per_worker) == len(pids) + 1, per_worker

        # A killed worker is replaced, and the new one serves. While it warms up (its router
        # catching up with Redis) requests that reach it wait for readiness: only connections
        # cut by the kill may fail, never an answer (a 404 "model not found" before).
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        await _until(lambda: len(_children(parent) - workers) == 1, 15, "a replacement worker")
        assert not _alive(victim)
        replacement = (_children(parent) - workers).pop()
        seen: set[int] = set()
        deadline = time.monotonic() + 15
        i = 100
        while replacement not in seen:
            assert time.monotonic() < deadline, seen
            with contextlib.suppress(openai.APIConnectionError):
                seen.add(await _completion_pid(oc, i))
            i += 1
        assert b"restarting" in b"".join(st.stderr)

        # SIGTERM while a stream is open: the stream finishes, the parent exits 0, no child left.
        live = _children(parent)
        stream = await oc.completions.create(
            model=MODEL, prompt="a longer answer please", max_tokens=40, stream=True
        )
        pieces = []
        async for ev in stream:
            if ev.choices:
                pieces.append(ev.choices[0].text)
                if len(pieces) == 1:
                    st.proc.send_signal(signal.SIGTERM)
        finish = ev.choices[0].finish_reason if ev.choices else None
        assert len(pieces) >= 2 and finish == "length", (len(pieces), finish)
        assert await asyncio.wait_for(st.proc.wait(), 20) == 0, b"".join(st.stderr).decode()
        await _until(lambda: not any(_alive(p) for p in live), 5, "the workers to be reaped")
        await oc.close()


def test_memory_broker_refuses_multiple_workers() -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "gateway", "--workers", "2", "--port", "0"],
        capture_output=True,
        timeout=60,
        env={**os.environ, "KVGATE_BROKER_URL": "memory://"},
    )
    assert done.returncode == 2
    assert b"memory://" in done.stderr and b"--workers 2" in done.stderr


def test_multi_worker_rules() -> None:
    assert multi_worker_error(1, None, "memory://") is None
    assert multi_worker_error(2, None, "redis://127.0.0.1:6379/0") is None
    assert multi_worker_error(2, "http://127.0.0.1:9000", "memory://") is None
    assert "memory://" in (multi_worker_error(3, None, "memory://") or "")


def test_restart_backoff_and_give_up() -> None:
    t = RestartTracker(RestartPolicy(fast_failure_s=10, max_fast_failures=3, backoff_s=0.5))
    assert t.failed(0, 1.0) == 0.5
    assert t.failed(0, 1.0) == 1.0
    assert t.failed(1, 1.0) == 0.5  # slots are counted apart
    assert t.failed(0, 1.0) is None  # third fast failure in a row of slot 0
    t2 = RestartTracker(RestartPolicy(fast_failure_s=10, max_fast_failures=2, backoff_s=0.5))
    assert t2.failed(0, 1.0) == 0.5
    assert t2.failed(0, 60.0) == 0.5  # it lived long: the count starts again
    assert t2.failed(0, 1.0) is None


def _always_crash(args: object, slot: int, port: int) -> int:
    return 3


def test_supervisor_gives_up_on_a_crash_loop() -> None:
    sup = Supervisor(
        None,  # type: ignore[arg-type]  # the worker main ignores it
        2,
        _always_crash,
        policy=RestartPolicy(fast_failure_s=10, max_fast_failures=3, backoff_s=0.01),
        drain_timeout_s=1,
    )
    t0 = time.monotonic()
    assert sup.run(HOST, 0) == 1
    assert sup.gave_up and not sup.workers
    assert time.monotonic() - t0 < 10
    assert not _children(os.getpid())
